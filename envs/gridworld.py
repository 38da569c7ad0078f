"""GridWorld Resource Collector (seed 003, section 7) as a text environment.

The fixed layout (`gridworld`), row 0 at the top:

    ..R....G
    .WW.....
    S...R...
    ..W...G.

S start, R resource (collected once), G goal (reaching either goal ends the episode with success),
W wall. At most `max_steps` (20) steps. Actions: `action_names = ["up", "down", "left", "right"]`,
given as an index 0..3 or as text (the first of those words in the text, case-insensitive).

Rewards, reported as separate components that sum to the step reward:
- `progress` +1.0 for each resource collected (REWARD_RESOURCE);
- `task` +3.0 on reaching a goal (REWARD_GOAL);
- `cost` -0.05 for every step, invalid ones included (REWARD_STEP);
- `format` -0.1 for an invalid or unparsable action (REWARD_INVALID);
- `safety` always 0.
Moving into a wall or off the grid is a valid action: the position is unchanged, the observation
says the move was blocked, and the step cost applies.

Invalid actions follow one rule, chosen by `invalid_action_rule`:
- "penalty" (default): error observation, -0.1, the step is consumed, the episode goes on;
- "end": the same, and the episode terminates with termination `invalid_action`; the `cost`
  component then also charges every step left in the budget, so that ending an episode with
  garbage can never beat playing it out.
The episode ends with `success` at a goal, or `truncated` after `max_steps` steps.

`gridworld-procedural` (ProceduralGridWorldEnv) draws random solvable layouts of the same kind. Its
train/test split is fixed by the layout's content (sha1 of the layout text mod 5 == 0 -> test), so
no layout can be in both splits.

Two state encoders (seed 003 §2.2: the encoder turns the state into text the LM can read), chosen by
`observation`; the dynamics and rewards are the same:
- "grid" (default): the status line and the grid drawn as rows of characters, A for the agent.
- "relative" (ids `gridworld-relative`, `gridworld-procedural-relative`): egocentric, as BabyAI-Text
  describes what the agent sees (Carta et al. 2023): every resource left and every goal as an offset
  from the agent in move words, nearest first ("Resources left: 1 up 2 right; 3 left."), and the moves a
  wall or the edge blocks right now. Walls further away are not described, so planning around them
  is left to trial: the layout is partly observed. On a fresh layout each episode, a 135M model can
  copy a move word from this text where it would have to locate itself in a drawn grid.
- "relative-visits" (ids `gridworld-relative-visits`, `gridworld-procedural-relative-visits`, ...): "relative" plus a
  line of visit counts, "Visits: here 3, up 1, left 2.": how many steps the agent has spent on this cell (a blocked or
  invalid move is one more) and on each cell an unblocked move leads to (cells never visited are not listed). A policy
  that reads only the current text cannot tell the third pass through a dead end from the first (its greedy failures
  on held-out layouts are loops between two cells: benchmarks/results/grpo_agent_procedural.md); the counts, a
  count-based exploration memory in words, make a loop visible in the observation itself. Measured with PPO (masked,
  400 episodes) they lowered the held-out goal rate, from 77% ± 6 to 61% ± 12, with more loops, not fewer (same page).

Potential-based reward shaping (seed 003 §3.2; Ng, Harada & Russell 1999), off by default: with
`shaping=w > 0` (ids `gridworld-shaped`, `gridworld-procedural-relative-shaped`, ...: w = SHAPING_WEIGHT) every
step adds F = Φ(s') - Φ(s) to the `progress` component, where Φ(s) = -w * (fewest steps from s that collect
every resource left and then reach a goal) and Φ = 0 once the episode succeeds. Moving along a shortest path
earns +w, moving away -w, a blocked or invalid move 0. The discount is 1, as GRPO's returns are undiscounted
(under PPO's gamma = 0.99 the sum no longer telescopes exactly; the per-step signal is the same).
Over an episode F telescopes to Φ(s_T) - Φ(s_0): -Φ(s_0) is the same for every episode on a layout (a group's
advantage cancels it), so what shaping adds to a return is Φ(s_T), zero after success and -w * (steps still
lacking) when the step limit (or, under rule "end", an invalid action) ends the episode: partial credit for
ending closer. With two resources (the seed layout, the procedural default) a success still beats every other
ending, shaped or not (at least 3 - 20 * 0.05 = 2 against at most 2 - 1 - w), so shaping reorders failures only.

A blocked-move penalty, off by default: `blocked_penalty=p > 0` (ids `gridworld-relative-shaped-blocked`,
`gridworld-procedural-relative-shaped-blocked`: shaping w and p = BLOCKED_PENALTY = w) adds -p to `cost` for every move
a wall or the edge blocks. Under the potential alone a blocked move costs only the step (-0.05) while a step away
from the goal costs -w - 0.05, so a policy unsure of the way around a wall is paid to bump into it, and a greedy
policy that does so sees the same text again and repeats itself to the step limit (benchmarks/results/
grpo_agent_procedural.md). With p = w a wasted step costs what a step away does. This term is not potential-based,
but an optimal policy never makes a blocked move (it only spends a step), so the optimal policies are unchanged; a
success with fewer than 6 blocked moves still out-returns every failure (at least 3 - 1 - 0.2 k, no resource
collected, against at most 0.8). Measured with PPO on the procedural layouts it did not raise the held-out goal rate
(same results page).
"""

from __future__ import annotations

import copy
import functools
import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from envs.base import TextEnv, reward_components

REWARD_RESOURCE = 1.0
REWARD_GOAL = 3.0
REWARD_STEP = -0.05
REWARD_INVALID = -0.1
MAX_STEPS = 20
SHAPING_WEIGHT = 0.2  # w of the "-shaped" ids: a step closer nets +0.15 after the step cost, a step away -0.25
BLOCKED_PENALTY = SHAPING_WEIGHT  # p of the "-shaped-blocked" ids: a blocked move nets -0.25, as a step away does

SEED003_LAYOUT = ("..R....G", ".WW.....", "S...R...", "..W...G.")
ACTIONS = ("up", "down", "left", "right")
MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))  # (d_row, d_col) per action; row 0 is the top
INVALID_FEEDBACK = "Invalid action. Reply with one of: " + ", ".join(ACTIONS) + "."
OBSERVATIONS = ("grid", "relative", "relative-visits")

Pos = tuple[int, int]


@dataclass(frozen=True)
class Layout:
    """An immutable grid, parsed from its rows of S/R/G/W/. characters."""

    grid: tuple[str, ...]
    start: Pos = field(init=False)
    resources: tuple[Pos, ...] = field(init=False)
    goals: frozenset[Pos] = field(init=False)
    walls: frozenset[Pos] = field(init=False)

    def __post_init__(self) -> None:
        grid = tuple(self.grid)
        if not grid or len({len(row) for row in grid}) != 1 or set("".join(grid)) - set(".SRGW"):
            raise ValueError(f"layout must be equal-length rows of '.SRGW', got {grid!r}")
        cells: dict[str, list[Pos]] = {ch: [] for ch in ".SRGW"}
        for r, row in enumerate(grid):
            for c, ch in enumerate(row):
                cells[ch].append((r, c))
        if len(cells["S"]) != 1 or not cells["G"]:
            raise ValueError(f"layout needs exactly one S and at least one G, got {grid!r}")
        derived = {"grid": grid, "start": cells["S"][0], "resources": tuple(cells["R"]),
                   "goals": frozenset(cells["G"]), "walls": frozenset(cells["W"])}
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen dataclass: fields derived once, here

    @property
    def text(self) -> str:
        return "\n".join(self.grid)

    @property
    def digest(self) -> str:
        return hashlib.sha1(self.text.encode()).hexdigest()

    def move(self, pos: Pos, action: int) -> tuple[Pos, str | None]:
        """Where `action` leads from `pos`, and what blocked it ("wall", "edge") if anything."""
        r, c = pos[0] + MOVES[action][0], pos[1] + MOVES[action][1]
        if not (0 <= r < len(self.grid) and 0 <= c < len(self.grid[0])):
            return pos, "edge"
        if (r, c) in self.walls:
            return pos, "wall"
        return (r, c), None


@dataclass(frozen=True)
class GridState:
    """Everything that changes within an episode. Immutable, so branches can never share state."""

    pos: Pos
    collected: frozenset[Pos] = frozenset()
    steps: int = 0
    invalid_actions: int = 0
    termination: str | None = None  # set once the episode is over
    path: tuple[Pos, ...] = ()  # the cell after each step, the start first ("relative-visits" counts in it)


class GridWorldVerifier:
    """Scores one transition from the states the dynamics produced; no agent text reaches it."""

    def __init__(self, layout: Layout, max_steps: int, shaping: float = 0.0, blocked_penalty: float = 0.0) -> None:
        self.layout, self.max_steps, self.shaping, self.blocked_penalty = layout, max_steps, shaping, blocked_penalty

    def potential(self, state: GridState) -> float:
        """Φ(s) = -w * steps still needed (module docstring); 0 after success."""
        if self.shaping == 0.0 or state.termination == "success":
            return 0.0
        return -self.shaping * remaining_path_length(self.layout, state.pos, state.collected)

    def score(self, before: GridState, action: int | None, after: GridState) -> dict[str, float]:
        steps_charged = 1
        if after.termination == "invalid_action":
            steps_charged = self.max_steps - before.steps  # the whole budget the episode forfeits
        blocked = action is not None and self.layout.move(before.pos, action)[1] is not None
        return reward_components(
            format=REWARD_INVALID if action is None else 0.0,
            progress=REWARD_RESOURCE * (len(after.collected) - len(before.collected))
            + self.potential(after) - self.potential(before),
            task=REWARD_GOAL if after.pos in self.layout.goals else 0.0,
            cost=REWARD_STEP * steps_charged - (self.blocked_penalty if blocked else 0.0),
        )


def _search(layout: Layout, pos: Pos, collected: frozenset[Pos], budget: int | None) -> dict:
    """BFS over (position, collected-resources bitmask) up to `budget` steps (None: no limit).

    Returns {(pos, mask): (fewest steps, first action of such a path)}. Goal cells end the episode,
    so they are reached but never expanded.
    """
    bits = {p: 1 << i for i, p in enumerate(layout.resources)}
    root = (pos, sum(bits[p] for p in collected))
    found: dict[tuple[Pos, int], tuple[int, int | None]] = {root: (0, None)}
    frontier, depth = [root], 0
    while frontier and (budget is None or depth < budget):
        depth += 1
        next_frontier = []
        for node in frontier:
            if node[0] in layout.goals:
                continue
            first = found[node][1]
            for action in range(len(MOVES)):
                new_pos, blocked = layout.move(node[0], action)
                child = (new_pos, node[1] | bits.get(new_pos, 0))
                if blocked is None and child not in found:
                    found[child] = (depth, action if first is None else first)
                    next_frontier.append(child)
        frontier = next_frontier
    return found


@functools.lru_cache(maxsize=65536)
def remaining_path_length(layout: Layout, pos: Pos, collected: frozenset[Pos]) -> int | None:
    """Fewest steps from `pos` that collect every resource not in `collected` and then reach a goal
    (None: impossible; 0 on a goal with nothing left)."""
    full = (1 << len(layout.resources)) - 1
    found = _search(layout, pos, collected, None)
    lengths = [d for (p, mask), (d, _) in found.items() if p in layout.goals and mask == full]
    return min(lengths, default=None)


def shortest_path_length(layout: Layout | tuple[str, ...]) -> int | None:
    """Fewest steps from S that collect every resource and then reach a goal (None: impossible)."""
    layout = layout if isinstance(layout, Layout) else Layout(tuple(layout))
    return remaining_path_length(layout, layout.start, frozenset())


def plan(layout: Layout, state: GridState, max_steps: int) -> tuple[float, int | None]:
    """(best achievable return from `state` on, an action that starts an optimal path).

    The action is None only when the episode is over. Ties go to the shortest path.
    """
    budget = max_steps - state.steps
    if state.termination is not None or budget <= 0:
        return 0.0, None
    found = _search(layout, state.pos, state.collected, budget)
    best_value, best_action = -float("inf"), 0  # action 0 when nothing beats standing still
    for (pos, mask), (steps, action) in found.items():
        gained = REWARD_RESOURCE * (bin(mask).count("1") - len(state.collected))
        if pos in layout.goals:
            value = gained + REWARD_GOAL + REWARD_STEP * steps
        else:  # no goal: the episode runs until the step limit
            value = gained + REWARD_STEP * budget
        if value > best_value:
            best_value, best_action = value, action if action is not None else 0
    return best_value, best_action


class GridWorldEnv(TextEnv):
    """The seed-003 GridWorld (or any `layout` given as rows of S/R/G/W/. characters)."""

    env_version = "gridworld-1.0"
    action_names = list(ACTIONS)

    def __init__(self, layout: tuple[str, ...] | list[str] | None = None, max_steps: int = MAX_STEPS,
                 invalid_action_rule: str = "penalty", render_mode: str | None = None, observation: str = "grid",
                 shaping: float = 0.0, blocked_penalty: float = 0.0) -> None:
        super().__init__()
        if invalid_action_rule not in ("penalty", "end"):
            raise ValueError(f"invalid_action_rule must be 'penalty' or 'end', got {invalid_action_rule!r}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        if observation not in OBSERVATIONS:
            raise ValueError(f"observation must be one of {OBSERVATIONS}, got {observation!r}")
        self.fixed_layout = Layout(tuple(layout or SEED003_LAYOUT))  # what `_choose_layout` returns
        self.max_steps, self.invalid_action_rule, self.render_mode = max_steps, invalid_action_rule, render_mode
        if not shaping >= 0.0:
            raise ValueError(f"shaping must be a weight >= 0, got {shaping!r}")
        if not blocked_penalty >= 0.0:
            raise ValueError(f"blocked_penalty must be >= 0, got {blocked_penalty!r}")
        self.observation, self.shaping, self.blocked_penalty = observation, float(shaping), float(blocked_penalty)
        # What the agent reads and how it is rewarded are part of the environment's version (seed 001).
        self.env_version = type(self).env_version + (f"-{observation}" if observation != "grid" else "") + \
            (f"-shaped{self.shaping:g}" if self.shaping else "") + \
            (f"-blocked{self.blocked_penalty:g}" if self.blocked_penalty else "") + \
            (f"-steps{max_steps}" if max_steps != MAX_STEPS else "") + ("-end" if invalid_action_rule == "end" else "")
        self._layout: Layout | None = None
        self._initial: GridState | None = None
        self._state: GridState | None = None

    @property
    def system_prompt(self) -> str:
        if self.observation.startswith("relative"):
            visits = (" It also says how many times you have been here and on the cells next to you."
                      if self.observation == "relative-visits" else "")
            return (
                "You are on a grid. Collect resources (+1 each), then reach a goal (+3, ends the episode). Each "
                "observation says where the resources left and the goals are from you, as moves (e.g. 2 up 1 left), "
                f"and which moves a wall or the edge blocks.{visits} Each step costs 0.05; at most {self.max_steps} "
                "steps. Reply with exactly one word: up, down, left or right."
            )
        return (
            "You are A on a grid. Collect resources R (+1 each), then reach a goal G (+3, ends the "
            "episode). W is a wall, . is empty. Row 0 is the top: up decreases the row, down "
            f"increases it. Each step costs 0.05; at most {self.max_steps} steps. "
            "Reply with exactly one word: up, down, left or right."
        )

    @property
    def task_id(self) -> str:
        layout = self._require_layout()
        return "gridworld/seed003" if layout.grid == SEED003_LAYOUT else f"gridworld/{layout.digest[:10]}"

    def _choose_layout(self, seed: int | None) -> Layout:
        return self.fixed_layout  # the seed never changes the fixed layout

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._layout = self._choose_layout(seed)
        if self.shaping and remaining_path_length(self._layout, self._layout.start, frozenset()) is None:
            raise ValueError("shaping needs a layout whose resources and a goal can all be reached; "
                             f"this one cannot:\n{self._layout.text}")
        self._initial = self._state = GridState(pos=self._layout.start, path=(self._layout.start,))
        return self._observation(None), {"env_version": self.env_version, "task_id": self.task_id}

    def step(self, action: str | int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        layout = self._require_layout()
        before = self._state
        if before.termination is not None:
            raise RuntimeError("episode is over; call reset()")  # a caller bug, not an agent error
        index = self.action_index(action)
        after = replace(before, steps=before.steps + 1, path=before.path + (before.pos,))
        termination = None
        if index is None:
            after = replace(after, invalid_actions=before.invalid_actions + 1)
            feedback = INVALID_FEEDBACK
            termination = "invalid_action" if self.invalid_action_rule == "end" else None
        else:
            pos, blocked = layout.move(before.pos, index)
            after = replace(after, pos=pos, collected=before.collected | ({pos} & set(layout.resources)),
                            path=before.path + (pos,))
            events = [f"You moved {ACTIONS[index]}"]
            if len(after.collected) > len(before.collected):
                events.append("collected a resource")
            if pos in layout.goals:
                events.append("reached the goal")
                termination = "success"
            feedback = f"Blocked: {blocked}." if blocked else " and ".join(events) + "."
        if termination is None and after.steps >= self.max_steps:
            termination = "truncated"
        self._state = after = replace(after, termination=termination)
        verifier = GridWorldVerifier(layout, self.max_steps, self.shaping, self.blocked_penalty)
        components = verifier.score(before, index, after)
        info: dict[str, Any] = {"env_version": self.env_version, "task_id": self.task_id,
                                "invalid_actions": after.invalid_actions, "action_valid": index is not None,
                                "action_index": index, "reward_components": components}
        if termination is not None:
            info["termination"] = termination
        terminated = termination in ("success", "invalid_action")
        return self._observation(feedback), sum(components.values()), terminated, termination == "truncated", info

    def legal_actions(self) -> list[int]:
        """The moves no wall or edge blocks from here (the relative observation lists the blocked ones; the grid shows
        the walls and edges)."""
        layout, pos = self._require_layout(), self._state.pos
        return [a for a in range(len(ACTIONS)) if layout.move(pos, a)[1] is None]

    def render(self) -> str:
        layout = self._require_layout()
        rows = [list(row.replace("S", ".")) for row in layout.grid]
        for r, c in self._state.collected:
            rows[r][c] = "."
        rows[self._state.pos[0]][self._state.pos[1]] = "A"
        return "\n".join("".join(row) for row in rows)

    def _observation(self, feedback: str | None) -> str:
        state, layout = self._state, self._layout
        status = f"Step {state.steps}/{self.max_steps}. Resources {len(state.collected)}/{len(layout.resources)}."
        if self.observation.startswith("relative"):
            visits = [describe_visits(layout, state)] if self.observation == "relative-visits" else []
            return "\n".join(([feedback] if feedback else []) + [status, describe_relative(layout, state)] + visits)
        return "\n".join(([feedback] if feedback else []) + [status + " You are A.", self.render()])

    def _require_layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("call reset() first")
        return self._layout

    def snapshot(self) -> dict[str, Any]:
        self._require_layout()
        return copy.deepcopy({"layout": self._layout, "initial": self._initial, "state": self._state,
                              "np_random": self.np_random.bit_generator.state})

    def restore(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)  # the snapshot stays reusable for other branches
        self._layout, self._initial, self._state = state["layout"], state["initial"], state["state"]
        self.np_random.bit_generator.state = state["np_random"]

    def optimal_steps(self) -> int | None:
        """Fewest steps that collect every resource and then reach a goal, on this episode's layout."""
        return shortest_path_length(self._require_layout())

    def optimal_return(self) -> float:
        """Best achievable return of this episode, from its start, within the step limit. With shaping w, what the
        potential adds to a success, -Φ(s_0) = w * (its shortest path), is included: the optimal policy is the
        same (Ng et al. 1999), its return is not; a blocked-move penalty changes neither."""
        layout = self._require_layout()
        return plan(layout, self._initial, self.max_steps)[0] - \
            GridWorldVerifier(layout, self.max_steps, self.shaping).potential(self._initial)

    def optimal_action(self, state: dict[str, Any] | None = None) -> int | None:
        """An optimal next action index from the current state (or from a `snapshot()`)."""
        if state is None:
            return plan(self._require_layout(), self._state, self.max_steps)[1]
        return plan(state["layout"], state["state"], self.max_steps)[1]


def _offset_words(pos: Pos, target: Pos) -> str:
    """`target` as moves from `pos`, rows first: "2 up 1 left", "3 right"."""
    d_row, d_col = target[0] - pos[0], target[1] - pos[1]
    words = ([f"{abs(d_row)} {'up' if d_row < 0 else 'down'}"] if d_row else []) + \
            ([f"{abs(d_col)} {'left' if d_col < 0 else 'right'}"] if d_col else [])
    return " ".join(words)


def describe_relative(layout: Layout, state: GridState) -> str:
    """The "relative" encoder: resources left and goals as offsets from the agent, nearest first (ties in
    reading order), then the moves blocked from here."""
    def listed(cells) -> str:
        near = sorted(cells, key=lambda cell: (abs(cell[0] - state.pos[0]) + abs(cell[1] - state.pos[1]), cell))
        return "; ".join(_offset_words(state.pos, cell) for cell in near) or "none"

    left = [cell for cell in layout.resources if cell not in state.collected]
    blocked = [f"{ACTIONS[a]} ({why})" for a in range(len(ACTIONS)) if (why := layout.move(state.pos, a)[1])]
    return (f"Resources left: {listed(left)}. Goals: {listed(layout.goals)}. "
            f"Blocked: {', '.join(blocked) or 'nothing'}.")


def describe_visits(layout: Layout, state: GridState) -> str:
    """The "relative-visits" line: steps spent on this cell, then on each cell an unblocked move leads to (if any)."""
    near = [f"{ACTIONS[a]} {count}" for a in range(len(ACTIONS))
            if (cell := layout.move(state.pos, a))[1] is None and (count := state.path.count(cell[0]))]
    return "Visits: " + ", ".join([f"here {state.path.count(state.pos)}", *near]) + "."


def layout_split(layout: Layout) -> str:
    """The fixed split of a layout, from its content alone: about 1 in 5 layouts is "test"."""
    return "test" if int(layout.digest, 16) % 5 == 0 else "train"


def _random_layout(rng: np.random.Generator, rows: int, cols: int, n_resources: int) -> Layout:
    area = rows * cols
    n_goals = int(rng.integers(1, 3))
    n_walls = int(rng.integers(area // 8, 3 * area // 16 + 1))  # 4..6 walls on the 4x8 grid
    symbols = "S" + "R" * n_resources + "G" * n_goals + "W" * n_walls
    if len(symbols) > area:
        raise ValueError(f"a {rows}x{cols} grid cannot hold {n_resources} resources, goals and walls")
    grid = [["."] * cols for _ in range(rows)]
    for symbol, cell in zip(symbols, rng.permutation(area)):
        grid[cell // cols][cell % cols] = symbol
    return Layout(tuple("".join(row) for row in grid))


@functools.lru_cache(maxsize=4096)
def procedural_layout(seed: int, split: str, rows: int, cols: int, n_resources: int, max_steps: int) -> Layout:
    """The layout of `split` that `seed` selects: the first candidate drawn from a generator seeded
    by `seed` that is in the split and solvable (all resources, then a goal, within max_steps)."""
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        layout = _random_layout(rng, rows, cols, n_resources)
        steps = shortest_path_length(layout)
        if layout_split(layout) == split and steps is not None and steps <= max_steps:
            return layout
    raise RuntimeError(f"no solvable {rows}x{cols} layout within {max_steps} steps; raise max_steps")


class ProceduralGridWorldEnv(GridWorldEnv):
    """Random solvable layouts; `reset(seed=s)` always gives the same layout of the split for s."""

    env_version = "gridworld-procedural-1.0"

    def __init__(self, split: str = "train", rows: int = 4, cols: int = 8, n_resources: int = 2,
                 max_steps: int = MAX_STEPS, invalid_action_rule: str = "penalty",
                 render_mode: str | None = None, observation: str = "grid", shaping: float = 0.0,
                 blocked_penalty: float = 0.0) -> None:
        super().__init__(max_steps=max_steps, invalid_action_rule=invalid_action_rule, render_mode=render_mode,
                         observation=observation, shaping=shaping, blocked_penalty=blocked_penalty)
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self.split, self.rows, self.cols, self.n_resources = split, rows, cols, n_resources
        if (rows, cols, n_resources) != (4, 8, 2):  # another layout distribution: another environment version
            self.env_version += f"-{rows}x{cols}-resources{n_resources}"

    @property
    def task_id(self) -> str:
        return f"gridworld-procedural/{self._require_layout().digest[:10]}"

    def _choose_layout(self, seed: int | None) -> Layout:
        # Without a seed, continue the env's own seeded stream (gymnasium's convention).
        layout_seed = seed if seed is not None else int(self.np_random.integers(2**31))
        return procedural_layout(layout_seed, self.split, self.rows, self.cols, self.n_resources, self.max_steps)
