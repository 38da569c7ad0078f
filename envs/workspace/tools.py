"""The workspace's tools: JSON tool calls, their typed schema, the parser, and each app's operations
(seed 000, "动作空间设计": structured, type-safe API calls, one JSON object naming app, op and args;
the taxonomy's Outlook/Excel/Word/Teams/SharePoint become mail, spreadsheet, documents, chat, files,
plus calendar).

A call is `{"app": APP, "op": OP, "args": {...}}`. `parse_tool_call` takes the first JSON object in
the model's text that has an "app" key (prose around it and ```json fences are fine) and checks it
against `TOOLS`: unknown app/op, unexpected top-level keys, missing required args, unknown args and
wrongly typed args are *invalid calls* (the env counts them). A well-typed call the app rejects
(no such id, a time that is not HH:MM, permission denied) is an *API error*: valid, but it fails.

The dynamics here never score anything: operations mutate the `World` and report `events` (mail
sent, message posted, file deleted, permission denied) that the verifier judges.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envs.workspace.world import (
    DAYS,
    Doc,
    Email,
    Event,
    File,
    Sheet,
    World,
    cell_value,
    fmt_number,
    hhmm,
    in_range,
    overlaps,
    parse_formula,
    parse_range,
    parse_time,
    used_range,
)

ARG_KINDS = {
    "str": "str",
    "int": "int",
    "text": "str or number",
    "emails": "email address or list of them",
    "table": "list of rows, each a list of str/number",
}
EMAIL_RE = re.compile(r"[^@\s]+@[^@\s]+\.[a-z]{2,}", re.IGNORECASE)


class ToolError(Exception):
    """An API error: the call was well formed but the app rejects it."""


class PermissionDenied(ToolError):
    """An API error that is also an attempted permission breach (the verifier's "permission")."""


@dataclass(frozen=True)
class Arg:
    name: str
    kind: str  # a key of ARG_KINDS
    required: bool = True
    choices: tuple[str, ...] = ()
    hint: str = ""  # the value's format, shown in the system prompt instead of the bare type


@dataclass(frozen=True)
class Op:
    args: tuple[Arg, ...]
    handler: Callable[[World, dict[str, Any]], ToolResult] | None  # None: handled by the env (agent app)


@dataclass(frozen=True)
class ToolCall:
    app: str
    op: str
    args: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.app}.{self.op}"

    def canonical(self) -> str:
        return json.dumps({"app": self.app, "op": self.op, "args": self.args}, sort_keys=True)


@dataclass
class ToolResult:
    text: str
    ok: bool = True
    events: list[dict[str, Any]] = field(default_factory=list)
    unit: str = "lines"  # what truncation counts: "rows" for listings, "lines" for documents


# -- parsing ------------------------------------------------------------------------------------------

_DECODER = json.JSONDecoder()


def parse_tool_call(action: object) -> tuple[ToolCall | None, str | None]:
    """(the call, None) or (None, what is wrong with it). Never raises."""
    if not isinstance(action, str):
        return None, f"the action must be text holding a JSON object, got {type(action).__name__}"
    decode_error, found = None, None
    for match in re.finditer(r"\{", action):
        try:
            value, _ = _DECODER.raw_decode(action, match.start())
        except json.JSONDecodeError as error:
            decode_error = decode_error or f"malformed JSON ({error.msg} at char {error.pos})"
            continue
        except ValueError as error:  # e.g. an integer past Python's 4,300-digit conversion limit
            decode_error = decode_error or f"malformed JSON ({error})"
            continue
        if isinstance(value, dict):
            if "app" in value:
                found = value
                break
            found = found if found is not None else value  # an object without "app": reported below
    if found is None or ("app" not in found and decode_error):
        return None, decode_error or "no JSON object found"
    return validate_call(found)


def validate_call(obj: dict[str, Any]) -> tuple[ToolCall | None, str | None]:
    extra = sorted(set(obj) - {"app", "op", "args"})
    if extra:
        return None, f"unexpected key(s) {extra}; a call has only app, op, args"
    app, op, args = obj.get("app"), obj.get("op"), obj.get("args", {})
    if not isinstance(app, str) or app not in TOOLS:
        return None, f"unknown app {app!r}; apps: {', '.join(TOOLS)}"
    if not isinstance(op, str) or op not in TOOLS[app]:
        return None, f"unknown op {app}.{op}; {app} ops: {', '.join(TOOLS[app])}"
    if not isinstance(args, dict):
        return None, f"args must be a JSON object, got {type(args).__name__}"
    spec = {arg.name: arg for arg in TOOLS[app][op].args}
    unknown = sorted(set(args) - set(spec))
    if unknown:
        return None, f"unknown arg(s) {unknown} for {app}.{op}; valid: {', '.join(spec) or 'none'}"
    clean: dict[str, Any] = {}
    for name, arg in spec.items():
        if name not in args:
            if arg.required:
                return None, f"missing required arg '{name}' for {app}.{op}"
            continue
        value, problem = _coerce(args[name], arg)
        if problem:
            return None, f"arg '{name}' of {app}.{op} {problem}"
        clean[name] = value
    return ToolCall(app, op, clean), None


def _is_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past a float's range is no usable number here
        return False


def _coerce(value: object, arg: Arg) -> tuple[Any, str | None]:
    """The normalised value, or a description of the type problem."""
    got = f"got {type(value).__name__}"
    if arg.kind == "str":
        if not isinstance(value, str):
            return None, f"must be str, {got}"
        if arg.choices and value not in arg.choices:
            return None, f"must be one of {', '.join(arg.choices)}, got {value!r}"
        return value, None
    if arg.kind == "int":
        return (value, None) if isinstance(value, int) and not isinstance(value, bool) else (None, f"must be int, {got}")
    if arg.kind == "text":
        if _is_number(value):
            return fmt_number(value), None
        return (value, None) if isinstance(value, str) else (None, f"must be str or number, {got}")
    if arg.kind == "emails":
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            return None, f"must be an email address or a non-empty list of them, {got}"
        return [v.strip().lower() for v in values], None
    if not (isinstance(value, list) and value and all(isinstance(row, list) and row for row in value)
            and all(isinstance(v, str) or _is_number(v) for row in value for v in row)):
        return None, f"must be a list of rows, each a non-empty list of str/number, {got}"
    return value, None


# -- mail ---------------------------------------------------------------------------------------------

def _matches(query: str, *fields: str) -> bool:
    return query.lower() in " ".join(fields).lower()


def _required_text(args: dict[str, Any], name: str) -> str:
    if not args[name].strip():
        raise ToolError(f"{name} must not be empty")
    return args[name]


def _check_addresses(addresses: list[str]) -> None:
    bad = [a for a in addresses if not EMAIL_RE.fullmatch(a)]
    if bad:
        raise ToolError(f"not an email address: {', '.join(bad)} (look addresses up with mail.contacts)")


def mail_search(world: World, args: dict[str, Any]) -> ToolResult:
    folder, query = args.get("folder", "inbox"), args.get("query", "")
    found = [m for m in world.emails if m.folder == folder
             and _matches(query, world.display(m.sender), m.subject, m.body, *m.to)]
    found.sort(key=lambda m: (m.date, m.id), reverse=True)
    if not found:
        return ToolResult(f"No emails in {folder} match {query!r}.", unit="rows")
    who = "from" if folder == "inbox" else "to"
    rows = [f"{m.id} | {m.date} | {world.display(m.sender) if folder == 'inbox' else ', '.join(m.to)} | {m.subject}"
            for m in found]
    return ToolResult("\n".join([f"{len(found)} emails in {folder}, newest first (id | date | {who} | subject):"] + rows),
                      unit="rows")


def mail_read(world: World, args: dict[str, Any]) -> ToolResult:
    mail = next((m for m in world.emails if m.id == args["id"]), None)
    if mail is None:
        raise ToolError(f"no email with id {args['id']!r}; find ids with mail.search")
    return ToolResult(f"From: {world.display(mail.sender)}\nTo: {', '.join(mail.to)}\nDate: {mail.date}\n"
                      f"Subject: {mail.subject}\n\n{mail.body}")


def mail_contacts(world: World, args: dict[str, Any]) -> ToolResult:
    query = args.get("query", "")
    found = [c for c in world.contacts if _matches(query, c.name, c.email, c.role)]
    if not found:
        return ToolResult(f"No contacts match {query!r}.", unit="rows")
    return ToolResult("\n".join(f"{c.name} | {c.email} | {c.role}" for c in found), unit="rows")


def _compose(world: World, args: dict[str, Any], folder: str) -> Email:
    _check_addresses(args["to"])
    mail = Email(world.new_id("m" if folder == "sent" else "d"), world.user.email, list(args["to"]),
                 args["subject"], args["body"], "2025-03-07 17:30", folder)
    world.emails.append(mail)
    return mail


def mail_draft(world: World, args: dict[str, Any]) -> ToolResult:
    mail = _compose(world, args, "drafts")
    return ToolResult(f"Draft {mail.id} saved (to {', '.join(mail.to)}); not sent.")


def mail_send(world: World, args: dict[str, Any]) -> ToolResult:
    mail = _compose(world, args, "sent")
    return ToolResult(f"Sent {mail.id} to {', '.join(mail.to)}.", events=[{"kind": "send", "to": list(mail.to)}])


# -- calendar -----------------------------------------------------------------------------------------

def _day(text: str) -> str:
    day = text.strip()[:3].title()
    if day not in DAYS:
        raise ToolError(f"day {text!r} must be one of {', '.join(DAYS)}")
    return day


def _event_row(world: World, event: Event) -> str:
    people = ", ".join(world.display(a).split(" <")[0] for a in event.attendees)
    row = f"{event.id} | {event.day} {hhmm(event.start)}-{hhmm(event.end)} | {event.title}"
    return row + (f" | with {people}" if people else "")


def calendar_list_events(world: World, args: dict[str, Any]) -> ToolResult:
    day = _day(args["day"]) if "day" in args else None
    found = [e for e in world.events if (day is None or e.day == day) and _matches(args.get("query", ""), e.title)]
    found.sort(key=lambda e: (DAYS.index(e.day), e.start))
    if not found:
        return ToolResult("No events" + (f" on {day}." if day else " match."), unit="rows")
    return ToolResult("\n".join(_event_row(world, e) for e in found), unit="rows")


def _schedule(world: World, event: Event, verb: str) -> ToolResult:
    if event.start >= event.end:
        raise ToolError("end must be after start")
    clashes = [e for e in world.events if e.id != event.id and overlaps(e, event)]
    text = f"{verb} {_event_row(world, event)}."
    if clashes:
        text += " Warning: overlaps " + "; ".join(_event_row(world, e) for e in clashes) + "."
    return ToolResult(text)


def calendar_create_event(world: World, args: dict[str, Any]) -> ToolResult:
    attendees = args.get("attendees", [])
    _check_addresses(attendees)
    event = Event(world.new_id("e"), _required_text(args, "title"), _day(args["day"]), parse_time_arg(args["start"]),
                  parse_time_arg(args["end"]), attendees)
    result = _schedule(world, event, "Created")
    world.events.append(event)
    return result


def calendar_update_event(world: World, args: dict[str, Any]) -> ToolResult:
    event = next((e for e in world.events if e.id == args["id"]), None)
    if event is None:
        raise ToolError(f"no event with id {args['id']!r}; find ids with calendar.list_events")
    _check_addresses(args.get("attendees", []))
    updated = Event(event.id, _required_text(args, "title") if "title" in args else event.title,
                    _day(args["day"]) if "day" in args else event.day,
                    parse_time_arg(args["start"]) if "start" in args else event.start,
                    parse_time_arg(args["end"]) if "end" in args else event.end,
                    args.get("attendees", event.attendees))
    result = _schedule(world, updated, "Updated")
    world.events[world.events.index(event)] = updated
    return result


def parse_time_arg(text: str) -> int:
    try:
        return parse_time(text)
    except ValueError as error:
        raise ToolError(str(error)) from None


# -- spreadsheet --------------------------------------------------------------------------------------

def _sheet(world: World, name: str) -> Sheet:
    if name not in world.sheets:
        raise ToolError(f"no sheet {name!r}; sheets: {', '.join(world.sheets)}")
    return world.sheets[name]


def _cells(range_ref: str) -> list[list[str]]:
    try:
        return parse_range(range_ref)
    except ValueError as error:
        raise ToolError(str(error)) from None


def _show(sheet: Sheet, ref: str) -> str:
    raw, value = sheet.cells.get(ref), cell_value(sheet, ref)
    shown = "" if value is None else fmt_number(value) if isinstance(value, float) else value
    return f"{shown} ({raw})" if isinstance(raw, str) and raw.startswith("=") else shown


def _render_rows(name: str, sheet: Sheet, cells: list[list[str]]) -> str:
    header = f"{name}!{cells[0][0]}:{cells[-1][-1]} (row: cells left to right):"
    return "\n".join([header] + [f"{row[0][1:]}: " + " | ".join(_show(sheet, ref) for ref in row) for row in cells])


def spreadsheet_list_sheets(world: World, args: dict[str, Any]) -> ToolResult:
    rows = [f"{name} | used {used_range(s) or 'empty'}" + (f" | locked {s.locked}" if s.locked else "")
            for name, s in world.sheets.items()]
    return ToolResult("\n".join(rows), unit="rows")


def spreadsheet_read_range(world: World, args: dict[str, Any]) -> ToolResult:
    sheet = _sheet(world, args["sheet"])
    range_ref = args.get("range") or used_range(sheet)
    if range_ref is None:
        return ToolResult(f"Sheet {args['sheet']!r} is empty.")
    return ToolResult(_render_rows(args["sheet"], sheet, _cells(range_ref)), unit="rows")


def _write(world: World, name: str, cells: list[list[str]], values: list[list[Any]]) -> ToolResult:
    sheet = _sheet(world, name)
    locked = [ref for row in cells for ref in row if in_range(ref, sheet.locked)]
    if locked:
        raise PermissionDenied(f"permission denied: {name}!{sheet.locked} is locked (tried {', '.join(locked[:3])})")
    for row, row_values in zip(cells, values):
        for ref, value in zip(row, row_values):
            if isinstance(value, str) and value.strip().startswith("="):
                try:
                    parse_formula(value.strip())
                except ValueError as error:
                    raise ToolError(str(error)) from None
    for row, row_values in zip(cells, values):  # validated first, so a bad formula writes nothing
        for ref, value in zip(row, row_values):
            if value == "":
                sheet.cells.pop(ref, None)
            elif isinstance(value, str) and value.strip().startswith("="):
                sheet.cells[ref] = value.strip().upper()
            else:
                sheet.cells[ref] = value
    return ToolResult("Wrote " + _render_rows(name, sheet, cells), unit="rows")


def spreadsheet_write_range(world: World, args: dict[str, Any]) -> ToolResult:
    cells, values = _cells(args["range"]), args["values"]
    shape = (len(cells), len(cells[0]))
    if (len(values), len(values[0])) != shape or any(len(row) != shape[1] for row in values):
        raise ToolError(f"values must be {shape[0]} row(s) of {shape[1]} value(s) to fill {args['range']}")
    return _write(world, args["sheet"], cells, values)


def spreadsheet_insert_formula(world: World, args: dict[str, Any]) -> ToolResult:
    cells = _cells(args["cell"])
    if len(cells) != 1 or len(cells[0]) != 1:
        raise ToolError(f"cell {args['cell']!r} must be a single cell")
    if not args["formula"].strip().startswith("="):
        raise ToolError(f"formula {args['formula']!r} must start with '='")
    return _write(world, args["sheet"], cells, [[args["formula"]]])


# -- documents ----------------------------------------------------------------------------------------

def documents_search(world: World, args: dict[str, Any]) -> ToolResult:
    query, rows = args.get("query", ""), []
    for name, doc in world.docs.items():
        hit = next((line for line in doc.text.splitlines() if _matches(query, line)), None)
        if hit is not None or _matches(query, name):
            rows.append(f"{name}{' (read-only)' if doc.read_only else ''}: {hit or (doc.text.splitlines() or [''])[0]}")
    return ToolResult("\n".join(rows) if rows else f"No documents match {query!r}.", unit="rows")


def documents_read(world: World, args: dict[str, Any]) -> ToolResult:
    if args["name"] not in world.docs:
        raise ToolError(f"no document {args['name']!r}; find names with documents.search")
    return ToolResult(world.docs[args["name"]].text)


def documents_write(world: World, args: dict[str, Any]) -> ToolResult:
    name, text, mode = _required_text(args, "name"), args["text"], args.get("mode", "append")
    doc = world.docs.get(name)
    if doc is not None and doc.read_only:
        raise PermissionDenied(f"permission denied: document {name!r} is read-only")
    if doc is None or mode == "overwrite":
        world.docs[name] = Doc(text)
    else:
        doc.text = doc.text + ("" if doc.text.endswith("\n") else "\n") + text
    return ToolResult(f"Saved {name} ({len(world.docs[name].text.splitlines())} lines).")


# -- chat ---------------------------------------------------------------------------------------------

def _channel(world: World, name: str) -> str:
    name = name if name.startswith("#") else f"#{name}"
    if name not in world.channels:
        raise ToolError(f"no channel {name!r}; channels: {', '.join(world.channels)}")
    return name


def chat_channels(world: World, args: dict[str, Any]) -> ToolResult:
    rows = [name + (" (external members)" if c.external else "") + (" (read-only)" if c.read_only else "")
            for name, c in world.channels.items()]
    return ToolResult("\n".join(rows), unit="rows")


def chat_read(world: World, args: dict[str, Any]) -> ToolResult:
    name = _channel(world, args["channel"])
    limit = args.get("limit", 10)
    if limit < 1:
        raise ToolError("limit must be at least 1")
    messages = world.channels[name].messages[-limit:]
    return ToolResult("\n".join(f"{author}: {text}" for author, text in messages) or f"{name} is empty.", unit="rows")


def chat_post(world: World, args: dict[str, Any]) -> ToolResult:
    name = _channel(world, args["channel"])
    channel = world.channels[name]
    if channel.read_only:
        raise PermissionDenied(f"permission denied: {name} is read-only")
    channel.messages.append((world.user.name.split()[0], _required_text(args, "text")))
    return ToolResult(f"Posted to {name}.", events=[{"kind": "post", "channel": name, "external": channel.external}])


# -- files --------------------------------------------------------------------------------------------

def _folder(world: World, path: str) -> str:
    path = "/" + path.strip().strip("/") if path.strip("/ ") else "/"
    if path not in world.folders:
        raise ToolError(f"no folder {path!r}")
    return path


def _file(world: World, path: str) -> tuple[str, File]:
    path = "/" + path.strip().strip("/")
    if path not in world.files:
        raise ToolError(f"no file {path!r}; list folders with files.list")
    return path, world.files[path]


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


def files_list(world: World, args: dict[str, Any]) -> ToolResult:
    folder = _folder(world, args.get("folder", "/"))
    subfolders = sorted(f.rsplit("/", 1)[1] + "/" for f in world.folders if f != "/" and _parent(f) == folder)
    entries = [f"{path.rsplit('/', 1)[1]} ({len(file.content)} bytes)" + (" [legal hold]" if file.legal_hold else "")
               + (" [restricted]" if file.restricted else "")
               for path, file in sorted(world.files.items()) if _parent(path) == folder]
    return ToolResult("\n".join([f"{folder}:"] + subfolders + entries) if subfolders or entries
                      else f"{folder} is empty.", unit="rows")


def files_read(world: World, args: dict[str, Any]) -> ToolResult:
    path, file = _file(world, args["path"])
    if file.restricted:
        raise PermissionDenied(f"permission denied: {path} is restricted")
    return ToolResult(file.content)


def files_move(world: World, args: dict[str, Any]) -> ToolResult:
    path, file = _file(world, args["src"])
    folder = _folder(world, args["dst"])
    if file.legal_hold:
        raise PermissionDenied(f"permission denied: {path} is on legal hold")
    target = f"{folder.rstrip('/')}/{path.rsplit('/', 1)[1]}"
    if target in world.files:
        raise ToolError(f"{target} already exists")
    world.files[target] = world.files.pop(path)
    return ToolResult(f"Moved {path} to {target}.")


def files_delete(world: World, args: dict[str, Any]) -> ToolResult:
    path, file = _file(world, args["path"])
    if file.legal_hold:
        raise PermissionDenied(f"permission denied: {path} is on legal hold")
    del world.files[path]
    return ToolResult(f"Deleted {path}.", events=[{"kind": "delete", "path": path,
                                                   "confirmed": path in world.confirmed_deletions}])


# -- the schema ---------------------------------------------------------------------------------------

def _optional(name: str, kind: str, choices: tuple[str, ...] = (), hint: str = "") -> Arg:
    return Arg(name, kind, required=False, choices=choices, hint=hint)


DAY, TIME = "Mon..Fri", "HH:MM"


TOOLS: dict[str, dict[str, Op]] = {
    "mail": {
        "search": Op((_optional("query", "str"), _optional("folder", "str", ("inbox", "sent", "drafts"))), mail_search),
        "read": Op((Arg("id", "str"),), mail_read),
        "contacts": Op((_optional("query", "str"),), mail_contacts),
        "draft": Op((Arg("to", "emails"), Arg("subject", "str"), Arg("body", "str")), mail_draft),
        "send": Op((Arg("to", "emails"), Arg("subject", "str"), Arg("body", "str")), mail_send),
    },
    "calendar": {
        "list_events": Op((_optional("day", "str", hint=DAY), _optional("query", "str")), calendar_list_events),
        "create_event": Op((Arg("title", "str"), Arg("day", "str", hint=DAY), Arg("start", "str", hint=TIME),
                            Arg("end", "str", hint=TIME), _optional("attendees", "emails")), calendar_create_event),
        "update_event": Op((Arg("id", "str"), _optional("title", "str"), _optional("day", "str", hint=DAY),
                            _optional("start", "str", hint=TIME), _optional("end", "str", hint=TIME),
                            _optional("attendees", "emails")), calendar_update_event),
    },
    "spreadsheet": {
        "list_sheets": Op((), spreadsheet_list_sheets),
        "read_range": Op((Arg("sheet", "str"), _optional("range", "str", hint="A1:C4 (default: used range)")),
                         spreadsheet_read_range),
        "write_range": Op((Arg("sheet", "str"), Arg("range", "str", hint="A1:C4"),
                           Arg("values", "table", hint="[[str/number, ...], ...] (text starting with = is a formula)")),
                          spreadsheet_write_range),
        "insert_formula": Op((Arg("sheet", "str"), Arg("cell", "str", hint="B3"),
                              Arg("formula", "str", hint="=SUM(B2:B5) (SUM AVERAGE MIN MAX + - * /)")),
                             spreadsheet_insert_formula),
    },
    "documents": {
        "search": Op((_optional("query", "str"),), documents_search),
        "read": Op((Arg("name", "str"),), documents_read),
        "write": Op((Arg("name", "str"), Arg("text", "str"),
                     _optional("mode", "str", ("append", "overwrite"), hint="append (default)|overwrite")),
                    documents_write),
    },
    "chat": {
        "channels": Op((), chat_channels),
        "read": Op((Arg("channel", "str"), _optional("limit", "int")), chat_read),
        "post": Op((Arg("channel", "str"), Arg("text", "str")), chat_post),
    },
    "files": {
        "list": Op((_optional("folder", "str"),), files_list),
        "read": Op((Arg("path", "str"),), files_read),
        "move": Op((Arg("src", "str", hint="file path"), Arg("dst", "str", hint="folder")), files_move),
        "delete": Op((Arg("path", "str"),), files_delete),
    },
    "agent": {
        "finish": Op((_optional("answer", "text"),), None),
        "ask_user": Op((Arg("question", "str"),), None),
    },
}


def execute(world: World, call: ToolCall) -> ToolResult:
    """Run a validated call of an app (not `agent`) against `world`; API errors become failed results."""
    try:
        return TOOLS[call.app][call.op].handler(world, call.args)
    except PermissionDenied as error:
        return ToolResult(f"Error: {error}", ok=False, events=[{"kind": "denied", "detail": str(error)}])
    except ToolError as error:
        return ToolResult(f"Error: {error}", ok=False)


def schema_text() -> str:
    """One line per op, `app.op(arg: kind, optional?: kind)`, for the system prompt."""
    lines = []
    for app, ops in TOOLS.items():
        for op, spec in ops.items():
            args = ", ".join(f"{a.name}{'' if a.required else '?'}: {a.hint or '|'.join(a.choices) or ARG_KINDS[a.kind]}"
                             for a in spec.args)
            lines.append(f"{app}.{op}({args})")
    return "\n".join(lines)
