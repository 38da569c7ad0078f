"""Environments written by others, as agentrl text environments (seed 003, section 2.2; section 6.1).

Seed 003 builds an agent environment from three parts: a state encoder (the simulator's state as text
the model can read), an action parser (the model's text as an action) and a reward function. Here the
simulator is someone else's, unchanged, and this module supplies the other parts, so every algorithm
runs on it by `--env-id`. Section 6.1 lists BabyAI among the benchmarks where RL agents are compared
with LLM agents; gymnasium's toy-text games are the classic tabular RL tasks.

| id             | class               | simulator                                                      |
| -------------- | ------------------- | -------------------------------------------------------------- |
| frozenlake     | FrozenLakeTextEnv   | gymnasium FrozenLake-v1 (4x4 map, not slippery by default)     |
| taxi           | TaxiTextEnv         | gymnasium Taxi-v4                                              |
| cliffwalking   | CliffWalkingTextEnv | gymnasium CliffWalking-v1                                      |
| babyai-<level> | BabyAITextEnv       | minigrid BabyAI-<Level>-v0 (needs `minigrid`, imported lazily) |

The toy-text observations are a status line (step count, positions in words) over the game's map;
the BabyAI ones are words only. Each adds one line of feedback on the last action when there is some.

Common to all of them:
- The simulator is built by `gymnasium.make(...)` (so the registered spec and its kwargs apply) and
  stepped through `.unwrapped`: the time limit is counted by the adapter (toy text) or by minigrid's
  own `step_count` (BabyAI), never by gymnasium's TimeLimit wrapper, whose private counter a
  `snapshot()` would miss.
- `reset(seed=s)` seeds the simulator with `s` (seed None continues its own random stream).
- `env_version` names the simulator's library version too (seed 001: environments are versioned
  infrastructure; a new gymnasium or minigrid may change the dynamics).
- Rewards are the simulator's own, unchanged (invalid actions aside), split into components that
  sum to them (below).
- Invalid actions, one rule: text naming no action (or an index out of range) consumes a step (it
  counts toward the time limit) without moving the simulator, returns the error observation
  "Invalid action. Reply with one of: ...", and costs `invalid_penalty` as the `format` component.
- The episode ends `truncated` when `max_steps` steps (invalid ones included) have been taken.

FrozenLake (`FrozenLakeTextEnv`; actions left, down, right, up, gymnasium's order): reach G across
frozen cells F without stepping into a hole H. Reward 1 on reaching G (`task`), 0 otherwise (a hole
would go to `safety`, a frozen step to `cost`; both are 0 in gymnasium). Termination `success` at G,
`failure` in a hole. `max_steps` defaults to the spec's limit (100 on 4x4, 200 on 8x8);
`invalid_penalty` -0.1, so text that names no move is strictly worse than any move (moves cost 0).
`is_slippery` defaults to False (deterministic; gymnasium's own default is True): slippery moves go
the chosen way with probability 1/3 and to either side otherwise.

Taxi (`TaxiTextEnv`; actions south, north, east, west, pickup, dropoff): fetch the passenger from
one of R, G, Y, B and drop them at the destination. Each step's reward is exactly one of
gymnasium's three: +20 for the delivery (`task`; it ends the episode with `success`), -10 for an
illegal pickup or dropoff (`safety`: a rule broken) and -1 for any other step (`cost`; dropping the
passenger in the taxi at another of the four stands is legal and costs -1). `max_steps` 200 (the
spec's); `invalid_penalty` -10, gymnasium's own price of an illegal action. `is_rainy` (off by
default) makes moves slip sideways with probability 0.2.

CliffWalking (`CliffWalkingTextEnv`; actions up, right, down, left): walk from the bottom-left corner
to the bottom-right one along the cliff C. Every step costs -1 (`cost`); stepping into the cliff
costs -100 (`safety`) and sends the agent back to the start, but does NOT end the episode (as in
gymnasium and Sutton & Barto's example 6.6). Reaching the goal ends it with `success` (that step
costs -1 like any other; there is no `task` reward). gymnasium sets no time limit, so `max_steps`
defaults to 100; `invalid_penalty` -1, the price of a step that goes nowhere (like walking into
the edge). The optimal return is -13.

BabyAI (`BabyAITextEnv(level="GoToLocal")`; actions turn left, turn right, go forward, pick up,
drop, toggle: minigrid's own indices 0..5, the `done` action is left out as in BabyAI-Text): the
observation is the mission and the agent's 7x7 egocentric view described in words, in the style of
BabyAI-Text / GLAM (Carta et al. 2023): every visible object as "a red ball 2 steps forward and
1 step left", and the nearest wall straight ahead, to the left and to the right. Reward: minigrid's
success reward 1 - 0.9 * steps / max_steps (`task`), termination `success` when the instruction is
achieved, `failure` when minigrid's verifier rules it failed (e.g. the wrong object picked up in a
strict level), `truncated` at minigrid's max_steps (set per level at reset, or fixed by the
`max_steps` kwarg). An invalid action passes a turn: minigrid's step counter advances (so it lowers
a later success reward like any step) but the world does not change; `invalid_penalty` -0.1.
`snapshot()` deep-copies the minigrid env (measured here: about 1 ms on a one-room 8x8 level,
8-26 ms on the 22x22 mazes of GoTo and BossLevel), and `restore()` copies it again, so a restore
replaces the object behind `game`. Potential-based shaping (Ng, Harada & Russell 1999; seed 003 §3.2, as
envs/gridworld.py does it), off by default, GoTo levels only: with `shaping=w > 0` (ids `babyai-<goto level>-shaped`,
w = BABYAI_SHAPING_WEIGHT) every step adds F = Φ(s') - Φ(s) to `progress`, Φ(s) = -w * (fewest turn / forward /
toggle actions from the agent's cell and heading to facing one of the objects the mission names, found by
`babyai_goto_distance`; 0 when facing one, so 0 after success). The target cells are minigrid's own
(`instrs.desc.obj_poss`, fixed at reset, what its verifier checks), so the shaped and unshaped levels share optimal
policies and the goal rate; only returns differ. Importing minigrid 3.2.0 imports pygame (pygame-ce, a hard
dependency of minigrid that installs as a wheel and needs no display); nothing here renders with it.

Each adapter's verifier (a separate class) derives components and termination from the simulator's
reward and states; nothing the agent writes reaches it. The toy-text adapters also plan exactly
(`optimal_action`, `optimal_return`): finite-horizon dynamic programming over gymnasium's transition
table `P`, expected return first, ties broken toward shorter expected episodes.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import functools
import hashlib
import io
from dataclasses import dataclass, replace
from typing import Any

import gymnasium
import numpy as np

from envs.base import TextEnv, reward_components

INVALID_FEEDBACK = "Invalid action. Reply with one of: {}."
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}  # (d_row, d_col), row 0 on top
TAXI_STANDS = "RGYB"  # gymnasium's names of Taxi's four stands, in its index order
TAXI_IN_TAXI = 4  # the passenger-location value meaning "in the taxi"
TAXI_ACTIONS = ["south", "north", "east", "west", "pickup", "dropoff"]
TAXI_ILLEGAL = -10.0  # gymnasium's reward for an illegal pickup or dropoff
CLIFF_FALL = -100.0  # gymnasium's reward for stepping into the cliff
BABYAI_ACTIONS = ["turn left", "turn right", "go forward", "pick up", "drop", "toggle"]
# Levels to register as babyai-<level.lower()>; BabyAITextEnv takes any other registered level as well.
BABYAI_LEVELS = ("GoToRedBall", "GoToObj", "GoToLocal", "GoTo", "PickupLoc", "Pickup", "Open", "Unlock",
                 "PutNextLocal", "Synth", "BossLevel")
BABYAI_SHAPING_WEIGHT = 0.1  # w of the babyai-<goto level>-shaped ids: a step along a shortest path earns +0.1
BABYAI_GOTO_LEVELS = ("GoToRedBall", "GoToObj", "GoToLocal", "GoTo")  # the registered levels shaping applies to
PLAN_TIE = 1e-9  # expected returns this close count as equal when the planner breaks ties

Outcome = tuple[dict[str, float], str | None]  # (reward components, termination or None)


@dataclass(frozen=True)
class EpisodeState:
    """The adapter's own per-episode bookkeeping; the simulator holds the rest."""

    task_id: str
    start: int | None = None  # toy text: the episode's start state (for `optimal_return`)
    steps: int = 0
    invalid_actions: int = 0
    termination: str | None = None


def _check_render_mode(render_mode: str | None) -> None:
    if render_mode not in (None, "ansi"):
        raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")


def _step_info(env_version: str, episode: EpisodeState, index: int | None,
               components: dict[str, float]) -> dict[str, Any]:
    info: dict[str, Any] = {"env_version": env_version, "task_id": episode.task_id,
                            "invalid_actions": episode.invalid_actions, "action_valid": index is not None,
                            "action_index": index, "reward_components": components}
    if episode.termination is not None:
        info["termination"] = episode.termination
    return info


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


class TabularPlanner:
    """Exact finite-horizon planning over a gymnasium toy-text transition table.

    `P[s][a]` lists the outcomes (probability, next state, reward, terminated). For every budget h of
    steps left the planner computes V_h(s), the best expected return, and L_h(s), the expected number
    of steps such a policy takes (the tie-breaker), extending its tables as larger budgets are asked.
    """

    def __init__(self, transitions: dict[int, dict[int, list[tuple]]]) -> None:
        n_states, n_actions = len(transitions), len(transitions[0])
        width = max(len(outcomes) for row in transitions.values() for outcomes in row.values())
        shape = (n_states, n_actions, width)
        self.prob, self.reward = np.zeros(shape), np.zeros(shape)
        self.next = np.zeros(shape, dtype=np.int64)
        ends = np.ones(shape, dtype=bool)  # padding outcomes have probability 0, so their values never count
        for s, row in transitions.items():
            for a, outcomes in row.items():
                for k, (p, s_next, r, terminated) in enumerate(outcomes):
                    self.prob[s, a, k], self.next[s, a, k], self.reward[s, a, k], ends[s, a, k] = p, s_next, r, terminated
        self.goes_on = self.prob * ~ends
        self.values, self.lengths = [np.zeros(n_states)], [np.zeros(n_states)]

    def _q(self, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """Expected return and expected length of every (state, action) with `budget` >= 1 steps left."""
        self._extend(budget - 1)
        values, lengths = self.values[budget - 1], self.lengths[budget - 1]
        q = (self.prob * self.reward).sum(-1) + (self.goes_on * values[self.next]).sum(-1)
        q_length = self.prob.sum(-1) + (self.goes_on * lengths[self.next]).sum(-1)
        return q, q_length

    @staticmethod
    def _best(q: np.ndarray, q_length: np.ndarray) -> np.ndarray:
        tied = q >= q.max(axis=1, keepdims=True) - PLAN_TIE
        return np.where(tied, q_length, np.inf).argmin(axis=1)  # the first action among equally short ones

    def _extend(self, budget: int) -> None:
        while len(self.values) <= budget:
            q, q_length = self._q(len(self.values))
            best, rows = self._best(q, q_length), np.arange(len(q))
            self.values.append(q[rows, best])
            self.lengths.append(q_length[rows, best])

    def value(self, state: int, budget: int) -> float:
        """Best expected return from `state` with `budget` steps left."""
        self._extend(budget)
        return float(self.values[budget][state])

    def action(self, state: int, budget: int) -> int:
        """An action achieving `value(state, budget)`, for `budget` >= 1."""
        q, q_length = self._q(budget)
        return int(self._best(q[state:state + 1], q_length[state:state + 1])[0])


class GymTextAdapter(TextEnv):
    """What every adapter here shares: the wrapped gymnasium game, reset, the episode record, step's guard."""

    _game: gymnasium.Env
    _episode: EpisodeState | None = None

    @abc.abstractmethod
    def _task_id(self) -> str:
        ...

    @abc.abstractmethod
    def _observation(self, feedback: str | None) -> str:
        ...

    def _start_state(self) -> int | None:
        """What `EpisodeState.start` records at reset (toy text: the state, for `optimal_return`)."""
        return None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        with contextlib.redirect_stdout(io.StringIO()):  # BabyAI's level generator prints every layout it rejects
            self._game.reset(seed=seed)
        self._episode = EpisodeState(task_id=self._task_id(), start=self._start_state())
        return self._observation(None), {"env_version": self.env_version, "task_id": self._episode.task_id}

    def _require_episode(self) -> EpisodeState:
        if self._episode is None:
            raise RuntimeError("call reset() first")
        return self._episode

    def _live_episode(self) -> EpisodeState:
        """The episode `step` acts in; stepping a finished one is a caller bug, not an agent error."""
        episode = self._require_episode()
        if episode.termination is not None:
            raise RuntimeError("episode is over; call reset()")
        return episode


class ToyTextEnv(GymTextAdapter):
    """A gymnasium toy-text game (its whole state is the integer `s` of the unwrapped env) as text."""

    gym_id: str = ""
    name: str = ""
    default_max_steps: int | None = None  # used when the gymnasium spec sets no time limit

    def __init__(self, *, max_steps: int | None, invalid_penalty: float, render_mode: str | None,
                 **game_kwargs: Any) -> None:
        super().__init__()
        _check_render_mode(render_mode)
        self._game = gymnasium.make(self.gym_id, disable_env_checker=True, **game_kwargs).unwrapped
        if max_steps is None:
            max_steps = gymnasium.spec(self.gym_id).max_episode_steps or self.default_max_steps
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        self.max_steps, self.invalid_penalty, self.render_mode = max_steps, float(invalid_penalty), render_mode
        self.env_version = f"{self.name}-1.0+gymnasium-{gymnasium.__version__}"
        self.verifier = self._make_verifier()
        self._episode: EpisodeState | None = None

    @property
    def game(self) -> gymnasium.Env:
        """The unwrapped gymnasium env, to read (its map, `decode`, `P`); stepping it bypasses the adapter."""
        return self._game

    @abc.abstractmethod
    def _make_verifier(self) -> Any:
        """The verifier: `score(before, action, reward, terminated, after) -> (components, termination)`."""

    @abc.abstractmethod
    def _status(self) -> str:
        """The text line above the map: step count and where things are."""

    @abc.abstractmethod
    def _describe(self, before: int, action: int, after: int, reward: float) -> str:
        """One sentence saying what the valid `action` did."""

    def _start_state(self) -> int:
        return int(self._game.s)

    def step(self, action: str | int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        episode = self._live_episode()
        index = self.action_index(action)
        termination = None
        if index is None:
            components = reward_components(format=self.invalid_penalty)
            feedback = INVALID_FEEDBACK.format(", ".join(self.action_names))
            episode = replace(episode, invalid_actions=episode.invalid_actions + 1)
        else:
            before = int(self._game.s)
            after, reward, terminated, _, _ = self._game.step(index)
            components, termination = self.verifier.score(before, index, float(reward), bool(terminated), int(after))
            feedback = self._describe(before, index, int(after), float(reward))
        episode = replace(episode, steps=episode.steps + 1)
        if termination is None and episode.steps >= self.max_steps:
            termination = "truncated"
        self._episode = episode = replace(episode, termination=termination)
        info = _step_info(self.env_version, episode, index, components)
        terminated = termination in ("success", "failure")
        return self._observation(feedback), sum(components.values()), terminated, termination == "truncated", info

    def snapshot(self) -> dict[str, Any]:
        self._require_episode()
        return copy.deepcopy({"episode": self._episode, "s": self._game.s, "lastaction": self._game.lastaction,
                              "game_rng": self._game.np_random.bit_generator.state,
                              "np_random": self.np_random.bit_generator.state})

    def restore(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)  # the snapshot stays reusable for other branches
        self._episode = state["episode"]
        self._game.s, self._game.lastaction = state["s"], state["lastaction"]
        self._game.np_random.bit_generator.state = state["game_rng"]
        self.np_random.bit_generator.state = state["np_random"]

    def optimal_action(self, state: dict[str, Any] | None = None) -> int | None:
        """An optimal next action index from the current state (or from a `snapshot()`); None once over."""
        episode = self._require_episode() if state is None else state["episode"]
        s = int(self._game.s if state is None else state["s"])
        budget = self.max_steps - episode.steps
        if episode.termination is not None or budget <= 0:
            return None
        return self._planner.action(s, budget)

    def optimal_return(self) -> float:
        """Best expected return of this episode from its start state, within `max_steps`."""
        return self._planner.value(self._require_episode().start, self.max_steps)

    @functools.cached_property
    def _planner(self) -> TabularPlanner:
        return TabularPlanner(self._game.P)  # P never changes, so one planner serves every episode

    def _observation(self, feedback: str | None) -> str:
        return "\n".join(([feedback] if feedback else []) + [self._status(), self.render()])


class GridToyTextEnv(ToyTextEnv):
    """FrozenLake and CliffWalking: a grid whose state is row * ncol + col."""

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, int]:
        ...

    @property
    @abc.abstractmethod
    def goal(self) -> int:
        """The goal state."""

    def cell(self, s: int) -> tuple[int, int]:
        """(row, col) of state `s`."""
        return divmod(int(s), self.shape[1])

    def _status(self) -> str:
        (row, col), (goal_row, goal_col) = self.cell(self._game.s), self.cell(self.goal)
        return (f"Step {self._episode.steps}/{self.max_steps}. You are A at row {row}, col {col}; "
                f"the goal G is at row {goal_row}, col {goal_col}.")

    def _describe(self, before: int, action: int, after: int, reward: float) -> str:
        (r0, c0), (r1, c1) = self.cell(before), self.cell(after)
        chosen = self.action_names[action]
        if (r1, c1) == (r0, c0):
            return f"You tried to move {chosen} and stayed in place."
        moved = next(name for name, delta in MOVES.items() if delta == (r1 - r0, c1 - c0))
        return f"You moved {chosen}." if moved == chosen else f"You tried to move {chosen} and slid {moved}."


class FrozenLakeVerifier:
    """FrozenLake by the cell reached: G -> `task` and success, H -> `safety` and failure, else `cost`."""

    def __init__(self, desc: np.ndarray) -> None:
        self.letters = [bytes(letter) for letter in desc.ravel()]

    def score(self, before: int, action: int, reward: float, terminated: bool, after: int) -> Outcome:
        letter = self.letters[after]
        if letter == b"G":
            return reward_components(task=reward), "success"
        if letter == b"H":
            return reward_components(safety=reward), "failure"
        return reward_components(cost=reward), None


class FrozenLakeTextEnv(GridToyTextEnv):
    """gymnasium's FrozenLake as text: the map with the agent A, and where the agent and the goal are."""

    name = "frozenlake"
    action_names = ["left", "down", "right", "up"]

    def __init__(self, map_name: str = "4x4", is_slippery: bool = False, max_steps: int | None = None,
                 invalid_penalty: float = -0.1, render_mode: str | None = None) -> None:
        if map_name not in ("4x4", "8x8"):  # gymnasium's None draws a map from an unseeded generator
            raise ValueError(f"map_name must be '4x4' or '8x8', got {map_name!r}")
        self.gym_id = "FrozenLake8x8-v1" if map_name == "8x8" else "FrozenLake-v1"  # the 8x8 spec allows 200 steps
        self.map_name, self.is_slippery = map_name, is_slippery
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty, render_mode=render_mode,
                         map_name=map_name, is_slippery=is_slippery)

    @property
    def shape(self) -> tuple[int, int]:
        return self._game.desc.shape

    @property
    def goal(self) -> int:
        return int(np.flatnonzero(self._game.desc.ravel() == b"G")[0])

    @property
    def system_prompt(self) -> str:
        slip = (" The ice is slippery: a move goes the chosen way only 1 time in 3, otherwise to a side."
                if self.is_slippery else "")
        return ("You are A on a frozen lake drawn as a grid: S start, F frozen (safe), H hole, G goal. "
                "Reach G (+1, ends the episode); stepping into a hole ends it with nothing. Row 0 is the top: "
                f"up decreases the row, down increases it.{slip} At most {self.max_steps} steps. "
                "Reply with exactly one word: left, down, right or up.")

    def render(self) -> str:
        rows = [[letter.decode() for letter in row] for row in self._game.desc]
        row, col = self.cell(self._game.s)
        rows[row][col] = "A"
        return "\n".join("".join(row) for row in rows)

    def _describe(self, before: int, action: int, after: int, reward: float) -> str:
        outcome = {b"G": " You reached the goal.", b"H": " You fell into a hole."}.get(self.verifier.letters[after], "")
        return super()._describe(before, action, after, reward) + outcome

    def _make_verifier(self) -> FrozenLakeVerifier:
        return FrozenLakeVerifier(self._game.desc)

    def _task_id(self) -> str:
        return f"frozenlake/{self.map_name}{'-slippery' if self.is_slippery else ''}"


class CliffWalkingVerifier:
    """CliffWalking by reward: the cliff's -100 -> `safety`, every other step -> `cost`; the goal is success."""

    def __init__(self, goal: int) -> None:
        self.goal = goal

    def score(self, before: int, action: int, reward: float, terminated: bool, after: int) -> Outcome:
        if reward == CLIFF_FALL:
            return reward_components(safety=reward), None  # back to the start; the episode goes on
        return reward_components(cost=reward), "success" if after == self.goal else None


class CliffWalkingTextEnv(GridToyTextEnv):
    """gymnasium's CliffWalking as text: the 4x12 map with the agent A, the cliff C and the goal G."""

    gym_id, name = "CliffWalking-v1", "cliffwalking"
    default_max_steps = 100
    action_names = ["up", "right", "down", "left"]

    def __init__(self, is_slippery: bool = False, max_steps: int | None = None, invalid_penalty: float = -1.0,
                 render_mode: str | None = None) -> None:
        self.is_slippery = is_slippery
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty, render_mode=render_mode,
                         is_slippery=is_slippery)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(n) for n in self._game.shape)

    @property
    def goal(self) -> int:
        return self.shape[0] * self.shape[1] - 1  # the bottom-right corner

    @property
    def system_prompt(self) -> str:
        slip = (" The ground is slippery: a move goes the chosen way only 1 time in 3, otherwise to a side."
                if self.is_slippery else "")
        return ("You are A on a grid: . is safe ground, C a cliff, G the goal. Reach G, which ends the episode. "
                "Every step costs 1; stepping into the cliff costs 100 and sends you back to the start "
                "(bottom-left). Row 0 is the top: up decreases the row, down increases it."
                f"{slip} At most {self.max_steps} steps. Reply with exactly one word: up, right, down or left.")

    def render(self) -> str:
        rows, cols = self.shape
        lines = ["." * cols] * (rows - 1) + ["." + "C" * (cols - 2) + "G"]  # gymnasium's cliff: the bottom row's inside
        row, col = self.cell(self._game.s)
        lines[row] = lines[row][:col] + "A" + lines[row][col + 1:]
        return "\n".join(lines)

    def _describe(self, before: int, action: int, after: int, reward: float) -> str:
        if reward == CLIFF_FALL:
            return f"You tried to move {self.action_names[action]}, fell off the cliff and are back at the start."
        outcome = " You reached the goal." if after == self.goal else ""
        return super()._describe(before, action, after, reward) + outcome

    def _make_verifier(self) -> CliffWalkingVerifier:
        return CliffWalkingVerifier(self.goal)

    def _task_id(self) -> str:
        return f"cliffwalking{'-slippery' if self.is_slippery else ''}"


class TaxiVerifier:
    """Taxi by gymnasium's three rewards: delivery -> `task` and success, illegal -10 -> `safety`, else `cost`."""

    def score(self, before: int, action: int, reward: float, terminated: bool, after: int) -> Outcome:
        if terminated:  # Taxi ends only with the delivery
            return reward_components(task=reward), "success"
        if reward == TAXI_ILLEGAL:
            return reward_components(safety=reward), None
        return reward_components(cost=reward), None


class TaxiTextEnv(ToyTextEnv):
    """gymnasium's Taxi as text: the map with the taxi T, and where the passenger and the destination are."""

    gym_id, name = "Taxi-v4", "taxi"
    action_names = list(TAXI_ACTIONS)

    def __init__(self, is_rainy: bool = False, max_steps: int | None = None, invalid_penalty: float = TAXI_ILLEGAL,
                 render_mode: str | None = None) -> None:
        self.is_rainy = is_rainy
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty, render_mode=render_mode,
                         is_rainy=is_rainy)

    @property
    def system_prompt(self) -> str:
        rain = (" It rains: a move goes the chosen way 8 times in 10, otherwise to a side." if self.is_rainy else "")
        return ("You drive the taxi T on a 5x5 map. Pick up the passenger waiting at one of the stands R, G, Y, "
                "B and drop them at their destination: +20, which ends the episode. Every other step costs 1; "
                "a pickup or dropoff where it is not allowed costs 10. A | between cells is a wall: east and west "
                "cannot cross it. Row 0 is the top: south increases the row, north decreases it."
                f"{rain} At most {self.max_steps} steps. "
                "Reply with exactly one word: south, north, east, west, pickup or dropoff.")

    def decode(self, s: int) -> tuple[int, int, int, int]:
        """(taxi row, taxi col, passenger location 0-3 = R G Y B or 4 = in the taxi, destination 0-3)."""
        return tuple(int(v) for v in self._game.decode(int(s)))

    def render(self) -> str:
        taxi_row, taxi_col, _, _ = self.decode(self._game.s)
        rows = [line.decode()[1:-1] for line in (b"".join(row) for row in self._game.desc[1:-1])]  # frame dropped
        rows[taxi_row] = rows[taxi_row][:2 * taxi_col] + "T" + rows[taxi_row][2 * taxi_col + 1:]
        return "\n".join(rows)

    def _place(self, stand: int) -> str:
        row, col = self._game.locs[stand]
        return f"{TAXI_STANDS[stand]} (row {row}, col {col})"

    def _status(self) -> str:
        taxi_row, taxi_col, passenger, destination = self.decode(self._game.s)
        where = "in the taxi" if passenger == TAXI_IN_TAXI else f"at {self._place(passenger)}"
        return (f"Step {self._episode.steps}/{self.max_steps}. Taxi T at row {taxi_row}, col {taxi_col}. "
                f"Passenger {where}; destination {self._place(destination)}.")

    def _describe(self, before: int, action: int, after: int, reward: float) -> str:
        chosen = self.action_names[action]
        (r0, c0, _, _), (r1, c1, passenger1, destination) = self.decode(before), self.decode(after)
        if chosen == "pickup":
            return "You picked up the passenger." if reward != TAXI_ILLEGAL else "Illegal pickup: no passenger here."
        if chosen == "dropoff":
            if reward == TAXI_ILLEGAL:
                return "Illegal dropoff: no passenger in the taxi, or not at a stand."
            if passenger1 == destination:
                return "You dropped the passenger at the destination."
            return f"You dropped the passenger at {TAXI_STANDS[passenger1]}, not the destination."
        if (r1, c1) == (r0, c0):
            return f"You tried to drive {chosen} but a wall or the edge is in the way."
        moved = dict(zip(((1, 0), (-1, 0), (0, 1), (0, -1)), TAXI_ACTIONS))[(r1 - r0, c1 - c0)]
        return f"You drove {chosen}." if moved == chosen else f"You tried to drive {chosen} and slid {moved}."

    def _make_verifier(self) -> TaxiVerifier:
        return TaxiVerifier()

    def _task_id(self) -> str:
        return f"taxi{'-rainy' if self.is_rainy else ''}/{int(self._game.s)}"  # the start state is the task


def _import_minigrid() -> Any:
    try:
        import minigrid  # registers the BabyAI-* ids with gymnasium; imports pygame (a minigrid dependency)
    except ImportError as error:
        raise ImportError("BabyAI needs minigrid: pip install minigrid==3.2.0") from error
    return minigrid


def babyai_gym_id(level: str) -> str:
    """The gymnasium id of a BabyAI level, any case: "gotolocal", "GoToLocal" -> "BabyAI-GoToLocal-v0"."""
    _import_minigrid()
    known = {}
    for env_id in sorted(gymnasium.registry):  # sorted, so the newest version of a level wins
        if env_id.startswith("BabyAI-"):
            known[env_id.removeprefix("BabyAI-").rsplit("-v", 1)[0].lower()] = env_id
    key = level.lower().removeprefix("babyai-").rsplit("-v", 1)[0]
    if key not in known:
        raise ValueError(f"unknown BabyAI level {level!r}; valid levels: {', '.join(sorted(known))}")
    return known[key]


def describe_view(image: np.ndarray) -> list[str]:
    """The agent's egocentric view (minigrid's `gen_obs()["image"]`) as phrases, nearest first.

    image[i, j] = (object, color, state); the agent is at (size // 2, size - 1) facing decreasing j,
    with i < size // 2 on its left. Every visible object is listed; walls only the nearest one straight
    ahead, to the left and to the right (as BabyAI-Text does), since a wall is a long run of cells.
    """
    from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT, STATE_TO_IDX

    state_names = {index: name for name, index in STATE_TO_IDX.items()}
    size = image.shape[0]
    x0, y0 = size // 2, size - 1
    objects = []
    for i in range(size):
        for j in range(size):
            kind = IDX_TO_OBJECT[int(image[i, j, 0])]
            if (i, j) == (x0, y0) or kind in ("unseen", "empty", "wall"):
                continue  # the agent's own cell shows what it carries, which is said separately
            forward, right = y0 - j, i - x0
            where = [_steps(forward) + " forward"] if forward else []
            where += [_steps(abs(right)) + (" right" if right > 0 else " left")] if right else []
            state = state_names[int(image[i, j, 2])] + " " if kind == "door" else ""
            name = f"a {state}{IDX_TO_COLOR[int(image[i, j, 1])]} {kind}"
            objects.append((forward + abs(right), forward, right, f"{name} {' and '.join(where)}"))
    walls = []
    for direction, (di, dj) in (("forward", (0, -1)), ("left", (-1, 0)), ("right", (1, 0))):
        i, j, distance = x0 + di, y0 + dj, 1
        while 0 <= i < size and 0 <= j < size and IDX_TO_OBJECT[int(image[i, j, 0])] == "empty":
            i, j, distance = i + di, j + dj, distance + 1
        if 0 <= i < size and 0 <= j < size and IDX_TO_OBJECT[int(image[i, j, 0])] == "wall":
            walls.append(f"a wall {_steps(distance)} {direction}")
    return [phrase for *_, phrase in sorted(objects)] + walls


def babyai_goto_distance(game: Any) -> int | None:
    """Fewest actions until the agent faces one of the cells the GoTo mission names; None if it cannot.

    Dijkstra over (cell, heading): a turn costs 1, a step forward 1 onto a cell the agent can stand on
    (floor, an open door; minigrid's `can_overlap`), 2 onto a closed unlocked door (toggle, then step).
    Objects and walls block. Facing a target cell ends the search, as minigrid's GoToInstr succeeds
    after any action that leaves the agent facing one.
    """
    import heapq

    from minigrid.core.constants import DIR_TO_VEC

    targets = {tuple(int(v) for v in pos) for pos in game.instrs.desc.obj_poss}
    start = (*(int(v) for v in game.agent_pos), int(game.agent_dir))
    best, frontier = {start: 0}, [(0, start)]
    while frontier:
        cost, (x, y, heading) = heapq.heappop(frontier)
        if cost > best[(x, y, heading)]:
            continue
        dx, dy = (int(v) for v in DIR_TO_VEC[heading])
        if (x + dx, y + dy) in targets:
            return cost
        moves = [((x, y, (heading + 3) % 4), 1), ((x, y, (heading + 1) % 4), 1)]
        cell = game.grid.get(x + dx, y + dy)
        if cell is None or cell.can_overlap():
            moves.append(((x + dx, y + dy, heading), 1))
        elif cell.type == "door" and not cell.is_locked:
            moves.append(((x + dx, y + dy, heading), 2))
        for state, step in moves:
            if cost + step < best.get(state, cost + step + 1):
                best[state] = cost + step
                heapq.heappush(frontier, (cost + step, state))
    return None


class BabyAIVerifier:
    """minigrid's own verdict: its success reward -> `task`; terminated with reward -> success, without -> failure."""

    def score(self, reward: float, terminated: bool, truncated: bool) -> Outcome:
        if terminated:
            return reward_components(task=reward), "success" if reward > 0 else "failure"
        return reward_components(task=reward), "truncated" if truncated else None


class BabyAITextEnv(GymTextAdapter):
    """A minigrid BabyAI level as text: the mission and the egocentric view in words (BabyAI-Text style)."""

    action_names = list(BABYAI_ACTIONS)  # minigrid's action indices 0..5; `done` (6) is left out

    def __init__(self, level: str = "GoToLocal", max_steps: int | None = None, invalid_penalty: float = -0.1,
                 render_mode: str | None = None, shaping: float = 0.0) -> None:
        super().__init__()
        _check_render_mode(render_mode)
        minigrid = _import_minigrid()
        self.gym_id = babyai_gym_id(level)
        if not shaping >= 0.0:
            raise ValueError(f"shaping must be a weight >= 0, got {shaping!r}")
        goto_ids = {babyai_gym_id(name) for name in BABYAI_GOTO_LEVELS}
        if shaping and self.gym_id not in goto_ids:
            raise ValueError(f"shaping is defined for the GoTo levels only ({', '.join(BABYAI_GOTO_LEVELS)}), "
                             f"not {self.gym_id}")
        level_kwargs = {} if max_steps is None else {"max_steps": max_steps}  # else the level sets it at reset
        self._game = gymnasium.make(self.gym_id, disable_env_checker=True, **level_kwargs).unwrapped
        self.invalid_penalty, self.render_mode, self.shaping = float(invalid_penalty), render_mode, float(shaping)
        self.env_version = f"babyai-1.0+minigrid-{minigrid.__version__}" + (f"-shaped{shaping:g}" if shaping else "")
        self.verifier = BabyAIVerifier()
        self._episode: EpisodeState | None = None

    @property
    def game(self) -> gymnasium.Env:
        """The unwrapped minigrid env, to read (e.g. for minigrid's BabyAIBot); replaced by `restore()`."""
        return self._game

    @property
    def system_prompt(self) -> str:
        return ("You are an agent in a grid world and must carry out the mission. Each turn you are told what "
                "you see, counted in steps forward and to your left or right. Actions: turn left and turn "
                "right turn in place; go forward moves one step; pick up takes the object one step forward; drop "
                "puts what you carry one step forward; toggle opens or closes the door one step forward. To go "
                "to an object, face it from one step away. Completing the mission ends the episode with a "
                "reward of up to 1, less the more steps you take. Reply with exactly one action: turn left, "
                "turn right, go forward, pick up, drop or toggle.")

    def step(self, action: str | int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        episode = self._live_episode()
        index = self.action_index(action)
        game = self._game
        if index is None:
            game.step_count += 1  # a turn passes (minigrid's own clock) but nothing in the world changes
            components = reward_components(format=self.invalid_penalty)
            termination = "truncated" if game.step_count >= game.max_steps else None
            feedback = INVALID_FEEDBACK.format(", ".join(self.action_names))
            episode = replace(episode, invalid_actions=episode.invalid_actions + 1)
        else:
            before, potential_before = self._signature(), self.potential()
            _, reward, terminated, truncated, _ = game.step(index)
            components, termination = self.verifier.score(float(reward), bool(terminated), bool(truncated))
            components["progress"] += self.potential() - potential_before
            feedback = "Nothing happened." if self._signature() == before else None
        self._episode = episode = replace(episode, steps=game.step_count, termination=termination)
        info = _step_info(self.env_version, episode, index, components)
        terminated = termination in ("success", "failure")
        return self._observation(feedback), sum(components.values()), terminated, termination == "truncated", info

    def potential(self) -> float:
        """Φ(s) = -shaping * `babyai_goto_distance` (module docstring); 0 without shaping. Should the mission's
        objects be walled off (not seen on the registered GoTo levels), the distance counts as every (cell,
        heading) pair of the grid, a bound no reachable state exceeds."""
        if not self.shaping:
            return 0.0
        distance = babyai_goto_distance(self._game)
        if distance is None:
            distance = 4 * self._game.width * self._game.height
        return -self.shaping * distance

    def render(self) -> str:
        """minigrid's picture of the whole grid (two characters a cell), for people; the agent sees less."""
        return self._game.pprint_grid()

    def snapshot(self) -> dict[str, Any]:
        self._require_episode()
        return copy.deepcopy({"episode": self._episode, "game": self._game,
                              "np_random": self.np_random.bit_generator.state})

    def restore(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)  # the snapshot stays reusable for other branches
        self._episode, self._game = state["episode"], state["game"]
        self.np_random.bit_generator.state = state["np_random"]

    def _signature(self) -> tuple:
        """Everything an action can change, to tell the agent when one changed nothing."""
        game = self._game
        carrying = None if game.carrying is None else game.carrying.encode()
        return tuple(int(v) for v in game.agent_pos), int(game.agent_dir), carrying, game.grid.encode().tobytes()

    def _task_id(self) -> str:
        game = self._game
        content = f"{game.mission}|{tuple(int(v) for v in game.agent_pos)}|{game.agent_dir}|".encode()
        return f"{self.gym_id}/{hashlib.sha1(content + game.grid.encode().tobytes()).hexdigest()[:10]}"

    def _observation(self, feedback: str | None) -> str:
        game = self._game
        seen = describe_view(game.gen_obs()["image"])
        lines = [f"Step {game.step_count}/{game.max_steps}. Mission: {game.mission}.",
                 f"You see {'; '.join(seen)}." if seen else "You see nothing but the floor."]
        if game.carrying is not None:
            lines[-1] += f" You carry a {game.carrying.color} {game.carrying.type}."
        return "\n".join(([feedback] if feedback else []) + lines)
