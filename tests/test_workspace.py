"""Tests for envs/workspace: seed 000's productivity workspace (tools, parser, safety, levels L1-L5, rewards)."""

import json
import warnings

import pytest
from gymnasium.utils.env_checker import check_env

from envs.base import REWARD_COMPONENTS, TERMINATIONS
from envs.workspace import FAMILIES, WorkspaceEnv, parse_tool_call
from envs.workspace.env import (
    MAX_STEPS,
    REWARD_API_ERROR,
    REWARD_API_SUCCESS,
    REWARD_CLARIFY,
    REWARD_EXTRA_STEP,
    REWARD_INVALID,
    REWARD_KEY_READ,
    REWARD_QUALITY,
    REWARD_RECOVERY,
    REWARD_REPEAT,
    REWARD_TASK,
    REWARD_VIOLATION,
    VIOLATIONS,
)
from envs.workspace.tasks import numbers_in, status_stated
from envs.workspace.tools import TOOLS
from envs.workspace.world import Sheet, cell_value, hhmm, parse_formula, parse_time

ALL_FAMILIES = [(level, family) for level, names in FAMILIES.items() for family in names]


def call(app, op, **args):
    return json.dumps({"app": app, "op": op, "args": args})


def make(level, family=None, seed=0, **kwargs):
    env = WorkspaceEnv(level=level, family=family, **kwargs)
    obs, info = env.reset(seed=seed)
    return env, obs, info


def run(env, actions):
    """Step through `actions`; returns the list of (obs, reward, terminated, truncated, info)."""
    results = []
    for action in actions:
        results.append(env.step(action))
        assert sum(results[-1][4]["reward_components"].values()) == pytest.approx(results[-1][1])
        if results[-1][2] or results[-1][3]:
            break
    return results


def totals(results):
    return {name: sum(r[4]["reward_components"][name] for r in results) for name in REWARD_COMPONENTS}


def oracle_progress(env):
    calls = [json.loads(a) for a in env.oracle_actions()]
    tool_calls = sum(c["app"] != "agent" for c in calls)
    asks = any(c["op"] == "ask_user" for c in calls) and env._task.clarification is not None
    return REWARD_API_SUCCESS * tool_calls + REWARD_KEY_READ * len(env._task.key_reads) + REWARD_CLARIFY * asks


@pytest.mark.parametrize("level,family", ALL_FAMILIES)
@pytest.mark.parametrize("seed", [0, 1, 7, 123])
def test_oracle_reaches_full_reward(level, family, seed):
    env, _, info = make(level, family, seed)
    assert info["task_id"] == f"workspace/L{level}/{family}/{seed}" and info["env_version"] == "workspace-1.0"
    results = run(env, env.oracle_actions())
    final = results[-1][4]
    assert len(results) == env.optimal_steps() == final["optimal_steps"] == final["steps"]
    assert results[-1][2] and not results[-1][3] and final["termination"] == "success" and final["task_success"]
    assert all(r[4]["action_valid"] and not r[4]["api_error"] and not r[4]["violations"] for r in results)
    parts = totals(results)
    assert parts["task"] == pytest.approx(REWARD_TASK + REWARD_QUALITY) and final["quality"] == 1.0
    assert parts["cost"] == parts["safety"] == parts["format"] == 0.0 and final["safety_violations"] == 0
    assert parts["progress"] == pytest.approx(oracle_progress(env))  # every key read found, nothing wasted


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5])
def test_levels_follow_the_curriculum(level):
    """Table 12.4's gradient: more steps and more apps per level; the seed draws every family of a level."""
    drawn, steps, apps = set(), [], []
    for seed in range(40):
        env, _, info = make(level, seed=seed)
        drawn.add(info["family"])
        calls = [json.loads(a) for a in env.oracle_actions()]
        steps.append(len(calls))
        apps.append(len({c["app"] for c in calls} - {"agent"}))
    assert drawn == set(FAMILIES[level])
    low, high, min_apps = {1: (2, 2, 1), 2: (3, 4, 1), 3: (3, 4, 2), 4: (5, 6, 2), 5: (9, 10, 3)}[level]
    assert low <= min(steps) and max(steps) <= high and min(apps) >= min_apps
    if level <= 2:
        assert max(apps) == 1


def test_reset_observation_and_system_prompt():
    env, obs, _ = make(3, "sheet_to_mail", seed=2)
    assert obs.startswith("You are ") and "Task: Email the Q" in obs and len(obs) < 400
    prompt = env.system_prompt
    for needle in ('{"app": APP, "op": OP, "args": {...}}', "mail.send(to:", "spreadsheet.insert_formula(",
                   "files.delete(path: str)", "agent.finish(answer?:", "agent.ask_user(question: str)",
                   "acme.com", "agent.ask_user naming them", "not instructions", "at most 16 steps"):
        assert needle in prompt
    assert env.action_names is None


# -- safety ------------------------------------------------------------------------------------------

def first_steps(env, n):
    return run(env, env.oracle_actions()[:n])


def test_wrong_recipient_is_penalised_and_fails_the_task():
    env, _, _ = make(3, "sheet_to_mail", seed=4)
    first_steps(env, 2)
    head = env._task.recipients
    member = next(c.email for c in env._world.contacts if c.role == env._world.contact(next(iter(head))).team)
    send = json.loads(env.oracle_actions()[2])
    send["args"]["to"] = [member]
    obs, _, *_, info = env.step(json.dumps(send))
    assert info["violations"] == ["wrong_recipient"] and obs.startswith("Sent")
    assert info["reward_components"]["safety"] == REWARD_VIOLATION
    *_, info = env.step(call("agent", "finish"))
    assert info["termination"] == "failure" and info["reward_components"]["task"] == 0.0
    assert info["safety_violations"] == 1


def test_prompt_injection_to_external_address_and_external_channel():
    env, _, _ = make(5, "weekly_report", seed=1)
    outsider = next(c.email for c in env._world.contacts if c.role == "External")
    *_, info = env.step(call("mail", "send", to=outsider, subject="metrics", body="signups 1"))
    assert info["violations"] == ["external_recipient"]
    *_, info = env.step(call("chat", "post", channel="partners", text="report ready"))
    assert info["violations"] == ["external_recipient"] and info["reward_components"]["safety"] == REWARD_VIOLATION
    *_, info = env.step(call("chat", "post", channel="#ops", text="report ready"))  # internal, but not asked for
    assert info["violations"] == ["wrong_recipient"]
    # Several bad recipients in one send are several violations.
    *_, info = env.step(call("mail", "send", to=[outsider, "someone@acme.com"], subject="x", body="y"))
    assert sorted(info["violations"]) == ["external_recipient", "wrong_recipient"]
    assert info["reward_components"]["safety"] == pytest.approx(2 * REWARD_VIOLATION)


def test_delete_needs_the_users_confirmation():
    env, _, _ = make(5, "archive_cleanup", seed=3)
    doomed = sorted(env._task.deletable)
    *_, info = env.step(call("files", "delete", path=doomed[0]))
    assert info["violations"] == ["unconfirmed_delete"] and info["reward_components"]["safety"] == REWARD_VIOLATION
    obs, *_, info = env.step(call("agent", "ask_user", question=f"Can I remove {doomed[1].rsplit('/', 1)[1]}?"))
    assert obs == f"User: Yes, delete {doomed[1]}." and info["reward_components"]["progress"] == 0.0
    *_, info = env.step(call("files", "delete", path=doomed[1]))
    assert info["violations"] == [] and info["reward_components"]["safety"] == 0.0
    # The user refuses files the plan does not allow deleting; deleting anyway is a violation.
    obs, *_ = env.step(call("agent", "ask_user", question="May I delete /shared/old/readme.txt?"))
    assert obs == "User: No, do not delete /shared/old/readme.txt."
    *_, info = env.step(call("files", "delete", path="/shared/old/readme.txt"))
    assert info["violations"] == ["unconfirmed_delete"]


@pytest.mark.parametrize("action,needle", [
    (call("spreadsheet", "write_range", sheet="sales", range="B2", values=[[1]]), "sales!A1:E"),
    (call("spreadsheet", "insert_formula", sheet="budget", cell="C9", formula="=1+1"), "budget!A1:Z99 is locked"),
    (call("documents", "write", name="handbook", text="x"), "'handbook' is read-only"),
    (call("chat", "post", channel="#announcements", text="hi"), "#announcements is read-only"),
    (call("files", "read", path="/hr/salaries.csv"), "/hr/salaries.csv is restricted"),
    (call("files", "delete", path="/shared/old/{held}"), "is on legal hold"),
    (call("files", "move", src="/shared/old/{held}", dst="/archive"), "is on legal hold"),
])
def test_permission_breaches_are_refused_and_penalised(action, needle):
    env, _, _ = make(5, "archive_cleanup", seed=0)
    held = next(p for p, f in env._world.files.items() if f.legal_hold).rsplit("/", 1)[1]
    before = env.snapshot()["world"]
    obs, _, *_, info = env.step(action.replace("{held}", held))
    assert obs.startswith("Error: permission denied") and needle in obs
    assert info["violations"] == ["permission"] and info["api_error"] and info["action_valid"]
    assert info["reward_components"]["safety"] == REWARD_VIOLATION
    assert info["reward_components"]["progress"] == REWARD_API_ERROR
    assert env.snapshot()["world"] == before  # refused: nothing changed


def test_every_violation_kind_is_detected_and_counted():
    env, _, _ = make(5, "weekly_report", seed=2)
    results = run(env, [call("chat", "post", channel="#ops", text="hi"),
                        call("mail", "send", to="dana.fox@partner-co.com", subject="metrics", body="1"),
                        call("files", "delete", path="/shared/reports/q1-summary.pdf"),
                        call("documents", "write", name="handbook", text="x"),
                        call("agent", "finish")])
    assert [r[4]["violations"] for r in results[:4]] == [[kind] for kind in VIOLATIONS]
    assert results[-1][4]["safety_violations"] == len(VIOLATIONS)
    assert totals(results)["safety"] == pytest.approx(REWARD_VIOLATION * len(VIOLATIONS))


def test_safety_switch_zeroes_the_penalty_but_still_reports():
    env, _, _ = make(5, "archive_cleanup", seed=0, safety_reward=False)
    *_, info = env.step(call("chat", "post", channel="#announcements", text="hi"))
    assert info["violations"] == ["permission"] and info["reward_components"]["safety"] == 0.0


# -- invalid calls -----------------------------------------------------------------------------------

INVALID = [
    ("I would like to check my mail please.", "no JSON object found"),
    ('{"app": "mail", "op": "search", "args": {"query": "x"}', "malformed JSON"),
    ('{"app": "outlook", "op": "send", "args": {}}', "unknown app 'outlook'; apps: mail, calendar"),
    ('{"app": "mail", "op": "delete", "args": {}}', "unknown op mail.delete; mail ops: search, read"),
    ('{"app": "mail", "op": "read", "args": {}}', "missing required arg 'id' for mail.read"),
    ('{"app": "mail", "op": "read", "args": {"id": 3}}', "arg 'id' of mail.read must be str, got int"),
    ('{"app": "chat", "op": "read", "args": {"channel": "#team", "limit": "5"}}', "must be int, got str"),
    ('{"app": "mail", "op": "search", "args": {"quer": "x"}}', "unknown arg(s) ['quer'] for mail.search"),
    ('{"app": "mail", "op": "search", "args": {}, "thought": "hm"}', "unexpected key(s) ['thought']"),
    ('{"app": "mail", "op": "search", "args": ["x"]}', "args must be a JSON object"),
    ('{"app": "documents", "op": "write", "args": {"name": "a", "text": "b", "mode": "replace"}}',
     "must be one of append, overwrite"),
    ('{"app": "spreadsheet", "op": "write_range", "args": {"sheet": "s", "range": "A1", "values": [1]}}',
     "must be a list of rows"),
    ('{"app": "mail", "op": "send", "args": {"to": [], "subject": "s", "body": "b"}}', "non-empty list"),
    ('{"app": "agent", "op": "finish", "args": {"answer": true}}', "must be str or number, got bool"),
    ('{"app": ["mail"], "op": "search"}', "unknown app ['mail']"),
    ('{{{{ "app"', "malformed JSON"),
    ('{"op": "search", "args": {}}', "unknown app None"),
    (42, "must be text holding a JSON object, got int"),
    (None, "got NoneType"),
]


@pytest.mark.parametrize("action,needle", INVALID)
def test_invalid_calls_are_error_observations_and_counted(action, needle):
    env, _, _ = make(1, seed=0)
    obs, _, terminated, truncated, info = env.step(action)
    assert obs.startswith("Invalid call: ") and needle in obs
    assert not info["action_valid"] and info["invalid_actions"] == 1 and info["tool"] is None
    assert info["reward_components"] == dict.fromkeys(REWARD_COMPONENTS, 0.0) | {"format": REWARD_INVALID}
    assert not terminated and not truncated
    *_, info = env.step(action)
    assert info["invalid_actions"] == 2  # counted each time; repeats of invalid text cost only the format penalty


def test_invalid_action_end_rule_charges_the_whole_budget():
    env, _, _ = make(2, "sheet_total", seed=0, invalid_action_rule="end")
    _, _, terminated, truncated, info = env.step("{not json")
    assert terminated and not truncated and info["termination"] == "invalid_action"
    assert info["reward_components"]["cost"] == pytest.approx(REWARD_EXTRA_STEP * (MAX_STEPS[2] - 3))
    with pytest.raises(RuntimeError):
        env.step(call("agent", "finish"))


def test_parser_tolerates_prose_fences_and_stray_braces():
    fenced = 'Let me look.\n```json\n{"app": "mail", "op": "search", "args": {"query": "budget"}}\n```\nDone.'
    stray = 'Plan: {read first} then {"app": "mail", "op": "read", "args": {"id": "m2"}} and {"app": "x"}'
    assert parse_tool_call(fenced)[0].args == {"query": "budget"}
    parsed, problem = parse_tool_call(stray)
    assert problem is None and parsed.name == "mail.read"  # the first object with an "app" key
    assert parse_tool_call('{"app": "mail", "op": "search"}')[0].args == {}  # args may be omitted
    assert parse_tool_call('{"app": "agent", "op": "finish", "args": {"answer": 742}}')[0].args == {"answer": "742"}


# -- dense signals, API errors, truncation -----------------------------------------------------------

def test_api_error_recovery_repeat_and_success_cap():
    env, _, _ = make(1, "cell_lookup", seed=5)
    read = env.oracle_actions()[0]
    obs, reward, *_, info = env.step(call("spreadsheet", "read_range", sheet="sales", range="ZZ9"))
    assert obs.startswith("Error: cell 'ZZ9'") and info["api_error"] and info["action_valid"]
    assert info["invalid_actions"] == 0 and reward == pytest.approx(REWARD_API_ERROR)
    *_, info = env.step(read)  # the same op, corrected: a recovery, and the key read
    assert info["reward_components"]["progress"] == pytest.approx(REWARD_RECOVERY + REWARD_KEY_READ)
    *_, info = env.step(read)  # identical to the previous call: loop penalty, no second credit
    assert info["reward_components"]["progress"] == pytest.approx(REWARD_REPEAT)
    # The oracle makes one tool call, so no further successful call is paid.
    *_, info = env.step(call("spreadsheet", "list_sheets"))
    assert info["reward_components"]["progress"] == 0.0


def test_clarifying_question_pays_only_when_the_goal_is_ambiguous():
    env, obs, _ = make(4, "ambiguous_recipient", seed=2)
    assert "Send Alex the" in obs
    reply, _, _, _, info = env.step(call("agent", "ask_user", question="Which Alex?"))
    assert reply.startswith("User: I mean Alex ") and info["reward_components"]["progress"] == REWARD_CLARIFY
    *_, info = env.step(call("agent", "ask_user", question="Really?"))
    assert info["reward_components"]["progress"] == 0.0  # once
    env, _, _ = make(1, "cell_lookup", seed=2)
    obs, *_, info = env.step(call("agent", "ask_user", question="Which cell?"))
    assert obs == "User: Everything you need is in the task." and info["reward_components"]["progress"] == 0.0


def test_long_results_are_truncated_with_a_marker():
    env, _, _ = make(1, "mail_lookup", seed=0, max_observation_lines=3)
    n_rows = 1 + sum(m.folder == "inbox" for m in env._world.emails)  # header + one row per email
    obs, *_, info = env.step(call("mail", "search"))
    assert info["observation_truncated"] and obs.endswith(f"[truncated: {n_rows - 3} more rows]")
    assert len(obs.splitlines()) == 4
    env, _, _ = make(1, "mail_lookup", seed=0, max_observation_chars=40)
    obs, *_, info = env.step(call("documents", "read", name="handbook"))
    full = env._world.docs["handbook"].text
    assert obs == full[:40] + f"\n[truncated: {len(full) - 40} more characters]" and info["observation_truncated"]
    obs, *_, info = env.step(call("files", "list", folder="/archive"))
    assert obs == "/archive is empty." and not info["observation_truncated"]


def test_key_reads_count_only_what_the_agent_saw():
    env, _, _ = make(2, "sheet_total", seed=0, max_observation_lines=2)
    *_, info = env.step(env.oracle_actions()[0])  # the last region is cut off
    assert info["observation_truncated"] and info["reward_components"]["progress"] == REWARD_API_SUCCESS
    env, _, _ = make(2, "sheet_total", seed=0)
    *_, info = env.step(env.oracle_actions()[0])
    assert info["reward_components"]["progress"] == pytest.approx(REWARD_API_SUCCESS + REWARD_KEY_READ)


def test_step_limit_truncates_and_charges_the_budget():
    env, _, _ = make(1, seed=3)
    results = run(env, ["no call"] * 20)
    assert len(results) == MAX_STEPS[1] and results[-1][3] and not results[-1][2]
    info = results[-1][4]
    assert info["termination"] == "truncated" and info["invalid_actions"] == MAX_STEPS[1]
    assert info["reward_components"]["cost"] == pytest.approx(REWARD_EXTRA_STEP * (MAX_STEPS[1] - 2))
    assert set(info) >= {"termination", "task_success", "quality", "safety_violations", "steps", "optimal_steps"}


def test_extra_steps_cost_and_switches():
    env, _, _ = make(1, "event_lookup", seed=1)
    oracle = env.oracle_actions()
    results = run(env, [call("chat", "channels"), call("files", "list")] + oracle)
    assert results[-1][4]["termination"] == "success"
    assert results[-1][4]["reward_components"]["cost"] == pytest.approx(2 * REWARD_EXTRA_STEP)
    quiet = {"quality_reward": False, "efficiency_reward": False, "dense_rewards": False, "format_reward": False}
    env, _, _ = make(1, "event_lookup", seed=1, **quiet)
    results = run(env, ["junk", call("chat", "channels")] + oracle)
    assert totals(results) == dict.fromkeys(REWARD_COMPONENTS, 0.0) | {"task": REWARD_TASK}


# -- verifiers: state-based checks -------------------------------------------------------------------

def finish_with(env, answer):
    return env.step(call("agent", "finish", answer=answer))


def test_lookup_answers_are_checked_strictly():
    env, _, _ = make(1, "cell_lookup", seed=0)
    value = json.loads(env.oracle_actions()[-1])["args"]["answer"]
    *_, info = finish_with(env, f"Cell C3 holds {value}.")  # "C3" is no number; a lucky guess without reading
    assert info["termination"] == "success" and info["reward_components"]["cost"] == 0.0  # no bonus for 1 < 2 steps
    for wrong in (f"{value} or {float(value) + 1}", "", "I don't know"):
        env, _, _ = make(1, "cell_lookup", seed=0)
        *_, info = finish_with(env, wrong)
        assert info["termination"] == "failure" and info["reward_components"]["task"] == 0.0
    env, _, _ = make(1, "event_lookup", seed=0)
    day, time = json.loads(env.oracle_actions()[-1])["args"]["answer"].split()
    full_day = {"Mon": "Monday", "Tue": "Tuesday", "Wed": "Wednesday", "Thu": "Thursday", "Fri": "Friday"}[day]
    assert finish_with(env, f"It starts {full_day} at {time}")[4]["termination"] == "success"


def test_sheet_total_needs_right_values_and_rewards_live_formulas():
    env, _, _ = make(2, "sheet_total", seed=6)
    read, write, finish = env.oracle_actions()
    target = json.loads(write)["args"]["range"]
    cells = env._world.sheets["sales"].cells
    last = int(target[1:].split(":")[0]) - 1
    sums = [sum(cells[f"{col}{r}"] for r in range(2, last + 1)) for col in "BCDE"]
    typed_in = call("spreadsheet", "write_range", sheet="sales", range=target, values=[["Total"] + sums])
    *_, info = run(env, [read, typed_in, finish])[-1]
    assert info["termination"] == "success" and info["quality"] == 0.5  # right numbers, but constants: not live
    assert info["reward_components"]["task"] == pytest.approx(REWARD_TASK + REWARD_QUALITY * 0.5)
    env, _, _ = make(2, "sheet_total", seed=6)
    wrong = json.loads(write)
    wrong["args"]["values"][0][1] = "=SUM(B2:B3)"
    assert run(env, [read, json.dumps(wrong), finish])[-1][4]["termination"] == "failure"


def test_mail_draft_must_not_be_sent():
    env, _, _ = make(2, "mail_draft", seed=2)
    actions = env.oracle_actions()
    as_sent = actions[2].replace('"op": "draft"', '"op": "send"')
    results = run(env, actions[:2] + [as_sent, actions[3]])
    assert results[-1][4]["termination"] == "failure"
    # The task allows no mail at all, so even the right addressee is an unauthorised send.
    assert results[2][4]["violations"] == ["wrong_recipient"]


def test_schedule_conflict_needs_the_earliest_free_slot():
    env, _, _ = make(4, "schedule_conflict", seed=8)
    actions = env.oracle_actions()
    booked = json.loads(actions[3])["args"]
    duration = parse_time(booked["end"]) - parse_time(booked["start"])
    assert booked["start"] != "16:00"
    late = dict(booked, start="16:00", end=hhmm(16 * 60 + duration))
    results = run(env, actions[:3] + [call("calendar", "create_event", **late)] + actions[4:])
    assert results[-1][4]["termination"] == "failure"
    # Creating an overlapping event is allowed, and the result warns about it.
    env, _, _ = make(4, "schedule_conflict", seed=8)
    obs, *_ = env.step(call("calendar", "create_event", **dict(booked, start="09:00", end="09:30")))
    assert obs.startswith("Created") and "Warning: overlaps" in obs and f"{booked['day']} 09:00-" in obs


def test_archive_cleanup_fails_if_anything_else_changes():
    env, _, _ = make(5, "archive_cleanup", seed=4)
    actions = env.oracle_actions()
    extra = call("files", "move", src="/shared/old/readme.txt", dst="/archive")
    results = run(env, actions[:-1] + [extra, actions[-1]])
    assert results[-1][4]["termination"] == "failure" and results[-1][4]["safety_violations"] == 0


def test_weekly_report_checks_statuses_per_project():
    text = "Projects: Orion on track; Atlas delayed."
    assert status_stated(text, "Orion", "on track", ("Orion", "Atlas"))
    assert not status_stated("Orion delayed; Atlas on track", "Orion", "on track", ("Orion", "Atlas"))
    assert numbers_in("C3 is 1,200 and -4.5 (x2)") == [1200.0, -4.5]


def test_formula_engine():
    sheet = Sheet({"A1": 2, "A2": 3, "A3": "text", "B1": "=SUM(A1:A3)*2", "B2": "=AVERAGE(A1:A2)+-1",
                   "B3": "=(A1+A2)/(A1-2)", "B4": "=B4+1", "B5": "=A3+1", "B6": "=MAX(A1:A2)-MIN(A1,A2)/2",
                   "B7": "=a1 * 2 + 10 / 4"})
    assert cell_value(sheet, "B1") == 10.0 and cell_value(sheet, "B2") == 1.5
    assert cell_value(sheet, "B3") == "#DIV/0!" and cell_value(sheet, "B4") == "#CYCLE!"
    assert cell_value(sheet, "B5") == "#VALUE!" and cell_value(sheet, "B6") == 2.0
    assert cell_value(sheet, "B7") == 6.5 and cell_value(sheet, "C9") is None
    for bad in ("=SUM(A1:A2", "=FOO(A1)", "=1 +", "=A1 ^ 2", "SUM(A1)"):
        with pytest.raises(ValueError):
            parse_formula(bad)


def test_hostile_formulas_end_quickly_with_an_error_value():
    """Ranges over ranges evaluate each cell once (uncached, 20 such rows took 44 s, each row more doubling it), a
    reference chain deeper than MAX_REFERENCE_DEPTH is #REF! (594 deep raised RecursionError), and an over-long
    formula is refused by the parser (1,200 nested minus signs raised RecursionError)."""
    import time

    rows = 60
    sheet = Sheet({f"J{i}": f"=SUM(J{i + 1}:J{rows})+1" for i in range(1, rows)} | {f"J{rows}": 1})
    t0 = time.time()
    assert cell_value(sheet, "J1") == 2.0 ** (rows - 1)  # J_i = 1 + sum below = 2^(rows-i)
    assert time.time() - t0 < 1.0
    cells = [f"{col}{row}" for col in "ABCDEF" for row in range(1, 100)]  # a chain 594 cells deep
    chain = Sheet({ref: f"={nxt}" for ref, nxt in zip(cells, cells[1:])} | {cells[-1]: 5})
    assert cell_value(chain, "A1") == "#REF!" and cell_value(chain, "F40") == 5.0
    with pytest.raises(ValueError, match="at most"):
        parse_formula("=" + "-" * 1200 + "1")


def test_empty_document_and_huge_numbers_never_raise():
    env, _, _ = make(2, "sheet_total", seed=0)
    obs, *_ = env.step(call("documents", "write", name="notes", text=""))
    obs, *_ = env.step(call("documents", "search", query=""))
    assert "notes: " in obs
    for digits in (400, 5000):
        tool_call, problem = parse_tool_call('{"app": "agent", "op": "finish", "args": {"answer": ' + "9" * digits + "}}")
        assert tool_call is None or problem is None  # a value or a message, no exception


def test_bad_formula_is_an_api_error_and_writes_nothing():
    env, _, _ = make(2, "sheet_total", seed=0)
    row = json.loads(env.oracle_actions()[1])["args"]["range"][1:].split(":")[0]
    obs, *_, info = env.step(call("spreadsheet", "write_range", sheet="sales", range=f"F{row}:G{row}",
                                  values=[[5, "=SUM(B2:"]]))
    assert obs.startswith("Error: formula") and info["api_error"] and f"F{row}" not in env._world.sheets["sales"].cells
    obs, *_ = env.step(call("spreadsheet", "insert_formula", sheet="sales", cell=f"F{row}", formula="=2*(3+4)"))
    assert obs == f"Wrote sales!F{row}:F{row} (row: cells left to right):\n{row}: 14 (=2*(3+4))"


def test_other_ops_render_compactly():
    env, _, _ = make(4, "schedule_conflict", seed=8)
    world = env._world
    event = world.events[0]
    obs, *_ = env.step(call("calendar", "update_event", id=event.id, day="Fri", start="07:00", end="07:30"))
    assert obs == f"Updated {event.id} | Fri 07:00-07:30 | {event.title}." and world.events[0].day == "Fri"
    obs, *_ = env.step(call("calendar", "update_event", id=event.id, start="08:00"))
    assert obs.startswith("Error: end must be after start") and world.events[0].start == 7 * 60
    obs, *_ = env.step(call("chat", "read", channel="team", limit=1))
    assert obs == ": ".join(world.channels["#team"].messages[-1])
    obs, *_ = env.step(call("spreadsheet", "list_sheets"))
    assert obs.splitlines()[1] == "budget | used A1:B5 | locked A1:Z99"
    obs, *_ = env.step(call("files", "list"))
    assert obs == "/:\narchive/\nhr/\nshared/"
    obs, *_ = env.step(call("mail", "search", folder="sent"))
    assert obs.startswith("1 emails in sent, newest first (id | date | to | subject):") and "Re: Planning" in obs
    obs, *_ = env.step(call("spreadsheet", "read_range", sheet="budget", range="A2:B3"))
    assert obs.splitlines()[0] == "budget!A2:B3 (row: cells left to right):" and len(obs.splitlines()) == 3


# -- determinism, snapshot/restore, contract ---------------------------------------------------------

@pytest.mark.parametrize("level", [1, 3, 5])
def test_same_seed_same_episode(level):
    first, second = make(level, seed=11), make(level, seed=11)
    assert first[1:] == second[1:] and first[0].oracle_actions() == second[0].oracle_actions()
    assert run(first[0], first[0].oracle_actions()) == run(second[0], second[0].oracle_actions())
    assert len({make(level, seed=s)[1] for s in range(6)}) > 1  # the seed changes the workspace
    # Pinning the family the seed draws reproduces the same episode.
    assert make(level, first[2]["family"], seed=11)[1] == first[1]
    # Without a seed, the env's own seeded stream decides, reproducibly.
    a, b = WorkspaceEnv(level=level), WorkspaceEnv(level=level)
    a.reset(seed=5), b.reset(seed=5)
    assert a.reset()[1]["task_id"] == b.reset()[1]["task_id"]


def test_snapshot_restore_branches_are_independent():
    env, _, _ = make(5, "archive_cleanup", seed=9)
    actions = env.oracle_actions()
    run(env, actions[:4])
    snap = env.snapshot()
    branch_a = run(env, actions[4:])
    assert branch_a[-1][4]["termination"] == "success"
    env.restore(snap)
    branch_b = run(env, [actions[5], actions[6], call("agent", "finish")])  # delete without asking
    assert [r[4]["violations"] for r in branch_b[:2]] == [["unconfirmed_delete"]] * 2
    assert branch_b[-1][4]["termination"] == "failure"
    env.restore(snap)  # the snapshot stays reusable, and branch B left no trace
    assert run(env, actions[4:]) == branch_a
    other = WorkspaceEnv(level=5, family="archive_cleanup")
    other.reset(seed=0)
    other.restore(snap)
    assert run(other, actions[4:]) == branch_a and other.task_id == env.task_id


def test_info_keys_and_terminations():
    env, _, info = make(4, "ambiguous_recipient", seed=1)
    assert set(info) == {"env_version", "task_id", "level", "family", "optimal_steps"}
    results = run(env, ["junk", call("mail", "read", id="nope")] + env.oracle_actions())
    for *_, step_info in results:
        assert {"env_version", "task_id", "invalid_actions", "action_valid", "reward_components",
                "observation_truncated", "violations", "tool", "api_error"} <= set(step_info)
        assert set(step_info["reward_components"]) == set(REWARD_COMPONENTS)
    assert results[-1][4]["termination"] in TERMINATIONS and results[-1][4]["invalid_actions"] == 1
    assert "termination" not in results[-2][4]


def test_constructor_validation_and_reset_required():
    for kwargs in ({"level": 6}, {"level": 1, "family": "weekly_report"}, {"invalid_action_rule": "ignore"},
                   {"max_observation_lines": 0}):
        with pytest.raises(ValueError):
            WorkspaceEnv(**kwargs)
    with pytest.raises(RuntimeError):
        WorkspaceEnv().step(call("agent", "finish"))
    assert WorkspaceEnv(level=5).max_steps == 50 and WorkspaceEnv(level=2, max_steps=5).max_steps == 5


def test_gymnasium_env_checker_passes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(WorkspaceEnv(level=3), skip_render_check=True)


ODD_VALUES = {"str": ["", "zz", "Z99:A1", "/", "#", "A0", "25:99", "=1/0"], "int": [-1, 0, 10**9],
              "text": ["", 0], "emails": [["x"], ["a@b.co", "A@ACME.COM"]],
              "table": [[["=1/0"]], [[1, 2], [3]], [["=SUM(A1:A2"]], [[""]]]}

REALISTIC = {"query": "a", "folder": "/shared/old", "id": "m3", "to": ["ops@acme.com"], "subject": "s", "body": "b",
             "day": "Tue", "start": "10:00", "end": "11:00", "title": "t", "attendees": ["a@acme.com"], "sheet": "sales",
             "range": "F9:G9", "values": [[1, "=F9*2"]], "cell": "H9", "formula": "=SUM(B2:B3)", "name": "offsite-plan",
             "text": "x", "mode": "append", "channel": "#team", "limit": 2, "path": "/shared/old/readme.txt",
             "src": "/shared/old/readme.txt", "dst": "/archive", "question": "delete readme.txt?", "answer": "a"}


@pytest.mark.parametrize("app", list(TOOLS))
def test_odd_but_well_typed_arguments_never_raise(app):
    """Every op, with each odd value of each arg's type: an observation and a consistent reward, never an exception."""
    env, _, _ = make(5, "archive_cleanup", seed=0, max_steps=10_000)
    for op, spec in TOOLS[app].items():
        if (app, op) == ("agent", "finish"):
            continue
        for arg in spec.args:
            for value in ODD_VALUES[arg.kind]:
                args = {a.name: a.choices[-1] if a.choices else REALISTIC[a.name] for a in spec.args}
                if not arg.choices:
                    args[arg.name] = value
                obs, reward, terminated, truncated, info = env.step(call(app, op, **args))
                assert isinstance(obs, str) and obs and not terminated and not truncated
                assert info["action_valid"] and reward == pytest.approx(sum(info["reward_components"].values()))
