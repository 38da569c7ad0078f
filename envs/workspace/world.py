"""The workspace's state (seed 000, "生产力副驾的形式化 MDP 定义": S is the whole workspace — documents,
mail threads, calendar events, files, permissions — of which the agent sees only what tools return),
its deterministic generation from a seed, and the spreadsheet's formula engine.

Everything here is plain data: `World` is deep-copied by snapshot/restore, and nothing in it scores
anything (the verifier lives in `tasks.py` / `env.py`).
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field

import numpy as np

COMPANY_DOMAIN = "acme.com"
DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri")
DATES = dict(zip(DAYS, ("2025-03-03", "2025-03-04", "2025-03-05", "2025-03-06", "2025-03-07")))
WORK_START, WORK_END = 9 * 60, 17 * 60  # minutes after midnight
# No "Alex": the ambiguous-recipient family adds two people of that name.
FIRST_NAMES = ("Alice", "Bob", "Carol", "David", "Erin", "Frank", "Grace", "Hugo", "Iris", "Jamal", "Kira",
               "Liam", "Maya", "Noah", "Olga", "Priya", "Quinn", "Ravi", "Sofia", "Tom")
LAST_NAMES = ("Berg", "Chen", "Diaz", "Garcia", "Kim", "Lopez", "Novak", "Okafor", "Patel", "Rossi", "Sato",
              "Silva", "Weber", "Young", "Zhang", "Moreau")
TEAMS = ("Finance", "Sales", "Design", "Ops", "Legal")
EXTERNAL_PEOPLE = (("Dana", "Fox", "partner-co.com"), ("Lee", "Moss", "vendorhub.net"))
REGIONS = ("North", "South", "East", "West", "Central")
QUARTERS = ("Q1", "Q2", "Q3", "Q4")
BUDGET_ITEMS = ("Travel", "Software", "Hiring", "Training")
BACKGROUND_MAIL = (
    ("Lunch on Friday?", "Shall we try the new place on Friday at noon?"),
    ("Offsite venue ideas", "I shortlisted two venues for the offsite, details next week."),
    ("Printer on floor 3", "The printer on floor 3 is fixed again."),
    ("Parking permits", "New parking permits are available at reception."),
    ("Security training", "Reminder: the security training is due this month."),
    ("Team photo", "The team photo is on Thursday after lunch."),
)
BACKGROUND_EVENTS = ("Standup", "Design review", "Vendor call", "Planning", "Hiring sync", "Retro")
MAX_ROW = 99  # sheets are A..Z x 1..99


@dataclass
class Contact:
    name: str
    email: str
    team: str
    role: str  # "Head of Finance", "Finance", ... or "External"


@dataclass
class Email:
    id: str
    sender: str
    to: list[str]
    subject: str
    body: str
    date: str  # "2025-03-04 09:15"; sorts chronologically as text
    folder: str  # "inbox", "sent" or "drafts"


@dataclass
class Event:
    id: str
    title: str
    day: str
    start: int  # minutes after midnight
    end: int
    attendees: list[str]


@dataclass
class Sheet:
    cells: dict[str, int | float | str]  # "B3" -> number, text, or formula text starting with "="
    locked: str | None = None  # a range ("A1:E5") nobody may write: the data block, or the whole sheet


@dataclass
class Doc:
    text: str
    read_only: bool = False


@dataclass
class Channel:
    messages: list[tuple[str, str]]  # (author, text)
    read_only: bool = False
    external: bool = False  # has members outside the company


@dataclass
class File:
    content: str
    legal_hold: bool = False  # may not be deleted or moved
    restricted: bool = False  # may not be read


@dataclass
class World:
    user: Contact
    contacts: list[Contact]
    emails: list[Email]
    events: list[Event]
    sheets: dict[str, Sheet]
    docs: dict[str, Doc]
    channels: dict[str, Channel]
    files: dict[str, File]
    folders: set[str]
    confirmed_deletions: set[str] = field(default_factory=set)  # paths the user approved
    next_id: int = 1

    def new_id(self, prefix: str) -> str:
        self.next_id += 1
        return f"{prefix}{self.next_id}"

    def contact(self, email: str) -> Contact | None:
        return next((c for c in self.contacts + [self.user] if c.email == email), None)

    def head_of(self, team: str) -> Contact:
        return next(c for c in self.contacts if c.role == f"Head of {team}")

    def display(self, email: str) -> str:
        contact = self.contact(email)
        return f"{contact.name} <{email}>" if contact else email


# -- small helpers ------------------------------------------------------------------------------------

def hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def parse_time(text: str) -> int:
    match = re.fullmatch(r"([01]\d|2[0-3]):([0-5]\d)", text.strip())
    if not match:
        raise ValueError(f"time {text!r} must be HH:MM (24-hour)")
    return int(match.group(1)) * 60 + int(match.group(2))


def overlaps(a: Event, b: Event) -> bool:
    return a.day == b.day and a.start < b.end and b.start < a.end


def fmt_number(value: float) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4f}".rstrip("0").rstrip(".")
    return str(int(value))


def email_address(first: str, last: str, domain: str = COMPANY_DOMAIN) -> str:
    return f"{first}.{last}@{domain}".lower()


# -- cells, ranges and formulas -----------------------------------------------------------------------

class FormulaError(Exception):
    """A spreadsheet error value ("#DIV/0!", "#VALUE!", "#CYCLE!"), shown in the cell."""


def parse_cell(ref: str) -> tuple[int, int]:
    """"C7" -> (3, 7); columns A..Z, rows 1..99."""
    match = re.fullmatch(r"([A-Z])([1-9]\d?)", ref.strip().upper())
    if not match:
        raise ValueError(f"cell {ref!r} must look like B3 (column A-Z, row 1-{MAX_ROW})")
    return ord(match.group(1)) - 64, int(match.group(2))


def cell_name(col: int, row: int) -> str:
    return f"{chr(64 + col)}{row}"


def parse_range(ref: str) -> list[list[str]]:
    """"A1:B2" -> [["A1", "B1"], ["A2", "B2"]]; a single cell is a 1x1 range."""
    first, _, last = ref.strip().upper().partition(":")
    (c0, r0), (c1, r1) = parse_cell(first), parse_cell(last or first)
    if c1 < c0 or r1 < r0:
        raise ValueError(f"range {ref!r} must go from top-left to bottom-right")
    return [[cell_name(c, r) for c in range(c0, c1 + 1)] for r in range(r0, r1 + 1)]


def in_range(ref: str, range_ref: str | None) -> bool:
    if range_ref is None:
        return False
    (c, r), rows = parse_cell(ref), parse_range(range_ref)
    (c0, r0), (c1, r1) = parse_cell(rows[0][0]), parse_cell(rows[-1][-1])
    return c0 <= c <= c1 and r0 <= r <= r1


def used_range(sheet: Sheet) -> str | None:
    if not sheet.cells:
        return None
    coords = [parse_cell(ref) for ref in sheet.cells]
    return f"A1:{cell_name(max(c for c, _ in coords), max(r for _, r in coords))}"


_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|([A-Z][1-9]\d?:[A-Z][1-9]\d?)|([A-Z]+)(?=\s*\()|([A-Z][1-9]\d?)|(.))")
FUNCTIONS = ("SUM", "AVERAGE", "MIN", "MAX")
ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


MAX_FORMULA_CHARS = 200
MAX_REFERENCE_DEPTH = 64  # cells reached one inside another by a formula's references (deeper: #REF!)


def parse_formula(text: str) -> tuple:
    """Parse "=SUM(B2:B5)/2 + C3" into a small AST; raises ValueError naming the syntax problem.

    Grammar: expr = term (("+"|"-") term)*; term = unary (("*"|"/") unary)*; unary = "-" unary | atom;
    atom = number | cell | FUNC "(" arg ("," arg)* ")" | "(" expr ")"; arg = range | expr.
    """
    if not text.startswith("="):
        raise ValueError(f"formula {text!r} must start with '='")
    if len(text) > MAX_FORMULA_CHARS:  # (the parser recurses per nesting level: bounded text, bounded depth)
        raise ValueError(f"formula of {len(text)} characters: at most {MAX_FORMULA_CHARS}")
    tokens: list[tuple[str, str]] = []
    for number, range_ref, func, cell, other in _TOKEN.findall(text[1:].strip().upper()):
        kind = "num" if number else "range" if range_ref else "func" if func else "cell" if cell else "op"
        value = number or range_ref or func or cell or other
        if kind == "op" and value not in "+-*/(),":
            raise ValueError(f"formula {text!r}: unexpected {value!r}")
        tokens.append((kind, value))
    position = 0

    def peek() -> tuple[str, str] | None:
        return tokens[position] if position < len(tokens) else None

    def take(expected: str | None = None) -> tuple[str, str]:
        nonlocal position
        token = peek()
        if token is None or (expected is not None and token[1] != expected):
            raise ValueError(f"formula {text!r}: expected {expected or 'a value'}")
        position += 1
        return token

    def expr() -> tuple:
        node = term()
        while peek() and peek()[1] in "+-" and peek()[0] == "op":
            node = ("bin", take()[1], node, term())
        return node

    def term() -> tuple:
        node = unary()
        while peek() and peek()[1] in "*/" and peek()[0] == "op":
            node = ("bin", take()[1], node, unary())
        return node

    def unary() -> tuple:
        if peek() == ("op", "-"):
            take()
            return ("neg", unary())
        return atom()

    def atom() -> tuple:
        kind, value = take()
        if kind == "num":
            return ("num", float(value))
        if kind == "cell":
            return ("cell", value)
        if kind == "func":
            if value not in FUNCTIONS:
                raise ValueError(f"formula {text!r}: unknown function {value}; known: {', '.join(FUNCTIONS)}")
            take("(")
            args = [argument()]
            while peek() == ("op", ","):
                take()
                args.append(argument())
            take(")")
            return ("func", value, args)
        if value == "(":
            node = expr()
            take(")")
            return node
        raise ValueError(f"formula {text!r}: unexpected {value!r}")

    def argument() -> tuple:
        if peek() and peek()[0] == "range":
            return ("range", take()[1])
        return expr()

    tree = expr()
    if position != len(tokens):
        raise ValueError(f"formula {text!r}: unexpected {tokens[position][1]!r}")
    return tree


def evaluate_cell(sheet: Sheet, ref: str, visiting: frozenset[str] = frozenset(),
                  cache: dict | None = None) -> float | str | None:
    """The value a cell shows: a number, text, None (empty), or raises FormulaError.

    Each formula cell is evaluated once per call (`cache`): a chain of ranges over ranges would otherwise be
    re-evaluated exponentially often. A cached value is never stale within a call: a cell that evaluated cleanly
    has no cycle below it, so no path can reach it through one of its own dependencies."""
    raw = sheet.cells.get(ref)
    if raw is None or isinstance(raw, (int, float)):
        return raw if raw is None else float(raw)
    if not raw.startswith("="):
        return raw
    if ref in visiting:
        raise FormulaError("#CYCLE!")
    if len(visiting) >= MAX_REFERENCE_DEPTH:
        raise FormulaError("#REF!")
    cache = {} if cache is None else cache
    if ref not in cache:
        cache[ref] = _evaluate(parse_formula(raw), sheet, visiting | {ref}, cache)
    return cache[ref]


def _evaluate(node: tuple, sheet: Sheet, visiting: frozenset[str], cache: dict) -> float:
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "cell":
        value = evaluate_cell(sheet, node[1], visiting, cache)
        if isinstance(value, str):
            raise FormulaError("#VALUE!")
        return 0.0 if value is None else value
    if kind == "neg":
        return -_evaluate(node[1], sheet, visiting, cache)
    if kind == "bin":
        left, right = _evaluate(node[2], sheet, visiting, cache), _evaluate(node[3], sheet, visiting, cache)
        if node[1] == "/" and right == 0:
            raise FormulaError("#DIV/0!")
        return ARITHMETIC[node[1]](left, right)
    values: list[float] = []  # a function: ranges skip empty and text cells, as spreadsheets do
    for arg in node[2]:
        if arg[0] == "range":
            for ref in (r for row in parse_range(arg[1]) for r in row):
                value = evaluate_cell(sheet, ref, visiting, cache)
                if isinstance(value, float):
                    values.append(value)
        else:
            values.append(_evaluate(arg, sheet, visiting, cache))
    if node[1] == "SUM":
        return math.fsum(values)
    if node[1] == "AVERAGE":
        if not values:
            raise FormulaError("#DIV/0!")
        return math.fsum(values) / len(values)
    return (min if node[1] == "MIN" else max)(values, default=0.0)


def cell_value(sheet: Sheet, ref: str) -> float | str | None:
    """`evaluate_cell` with errors as their display text."""
    try:
        return evaluate_cell(sheet, ref)
    except FormulaError as error:
        return str(error)


# -- the seeded base workspace ------------------------------------------------------------------------

def _pick(rng: np.random.Generator, pool: tuple, k: int) -> list:
    return [pool[i] for i in rng.choice(len(pool), size=k, replace=False)]


def base_world(rng: np.random.Generator) -> World:
    """A small workspace: 11 colleagues in 5 teams (plus the user, in Ops), 2 external contacts, a few
    emails, events, two sheets, documents, chat channels and files. Task families add to it."""
    firsts, lasts = _pick(rng, FIRST_NAMES, 12), _pick(rng, LAST_NAMES, 12)
    people = [Contact(f"{f} {l}", email_address(f, l), "", "") for f, l in zip(firsts, lasts)]
    user, colleagues = people[0], people[1:]
    user.team, user.role = "Ops", "Ops"
    for i, person in enumerate(colleagues):
        person.team = TEAMS[i % len(TEAMS)]
        person.role = f"Head of {person.team}" if i < len(TEAMS) else person.team
    external = [Contact(f"{f} {l}", email_address(f, l, d), "External", "External") for f, l, d in EXTERNAL_PEOPLE]
    world = World(user=user, contacts=colleagues + external, emails=[], events=[], sheets={}, docs={},
                  channels={}, files={}, folders={"/", "/shared", "/shared/reports", "/hr", "/archive"})

    for subject, body in _pick(rng, BACKGROUND_MAIL, 4):
        sender = colleagues[int(rng.integers(len(colleagues)))]
        world.emails.append(Email(world.new_id("m"), sender.email, [user.email], subject, body,
                                  random_date(rng), "inbox"))
    world.emails.append(Email(world.new_id("m"), user.email, [colleagues[0].email], "Re: Planning",
                              "Thanks, see you there.", random_date(rng), "sent"))

    for title in _pick(rng, BACKGROUND_EVENTS, 4):
        add_free_event(world, rng, title, DAYS[int(rng.integers(len(DAYS)))], int(rng.choice([30, 60])))

    regions = list(REGIONS[: int(rng.integers(3, 6))])
    sales = {"A1": "Region", **{f"{chr(66 + q)}1": name for q, name in enumerate(QUARTERS)}}
    for row, region in enumerate(regions, start=2):
        sales[f"A{row}"] = region
        for q in range(len(QUARTERS)):
            sales[f"{chr(66 + q)}{row}"] = int(rng.integers(100, 1000))
    world.sheets["sales"] = Sheet(sales, locked=f"A1:E{len(regions) + 1}")
    budget = {"A1": "Item", "B1": "Amount"}
    for row, item in enumerate(BUDGET_ITEMS, start=2):
        budget[f"A{row}"], budget[f"B{row}"] = item, int(rng.integers(10, 180)) * 50
    world.sheets["budget"] = Sheet(budget, locked="A1:Z99")

    world.docs["handbook"] = Doc("# Team handbook\nCore hours are 10:00-16:00.\nExpenses need a receipt.\n"
                                 "Share numbers only inside the company.", read_only=True)
    world.docs["offsite-plan"] = Doc("# Offsite plan\nVenue: to be decided.\nBudget owner: Finance.")

    def said(person: Contact, text: str) -> tuple[str, str]:
        return (person.name.split()[0], text)

    world.channels["#team"] = Channel([said(colleagues[1], "Morning all!"), said(colleagues[2], "Standup moved to 9:30.")])
    world.channels["#ops"] = Channel([said(colleagues[3], "Backups ran fine overnight.")])
    world.channels["#announcements"] = Channel([("HR", "The office is closed on Monday the 17th.")], read_only=True)
    world.channels["#partners"] = Channel([said(external[0], "Looking forward to the launch!")], external=True)

    world.files["/shared/reports/q1-summary.pdf"] = File("Q1 summary: revenue up 4%.")
    world.files["/shared/reports/q2-summary.pdf"] = File("Q2 summary: revenue flat.")
    world.files["/hr/salaries.csv"] = File("name,salary\n(confidential)", restricted=True)
    return world


def random_date(rng: np.random.Generator, day: str | None = None) -> str:
    day = day or DAYS[int(rng.integers(len(DAYS)))]
    return f"{DATES[day]} {hhmm(int(rng.integers(8 * 60, 17 * 60)))}"  # before the agent's 17:30 "now"


def add_free_event(world: World, rng: np.random.Generator, title: str, day: str, duration: int,
                   attendees: list[str] | None = None) -> Event:
    """Add an event at a random half-hour start in working hours that overlaps nothing that day."""
    starts = [s for s in range(WORK_START, WORK_END - duration + 1, 30)
              if not any(overlaps(Event("", "", day, s, s + duration, []), e) for e in world.events)]
    start = starts[int(rng.integers(len(starts)))]
    event = Event(world.new_id("e"), title, day, start, start + duration, attendees or [])
    world.events.append(event)
    return event
