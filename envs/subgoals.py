"""Subgoal interfaces: what a planner can ask for in an environment, and how a controller sees it done.

`algorithms/hybrid_planner.py` plans in subgoals and trains a small controller on them. What a subgoal *is*
depends on the environment, so each supported environment gets one class here, all with the same methods:

| method                      | what it returns                                                               |
| --------------------------- | ----------------------------------------------------------------------------- |
| `features(subgoal)`         | the controller's input: the whole grid as one-hot channels + the subgoal      |
| `action_mask(skills)`       | which controller actions are allowed now (primitive actions, then skills)     |
| `env_action(action)`        | the environment action a controller action stands for (skills resolve here)   |
| `candidates(planned)`       | what the next plan step can be, after the subgoals already `planned`          |
| `plan_complete(planned)`    | whether a plan may stop here (GridWorld: at its first goal)                   |
| `reached(subgoal, obs)`     | the subgoal is done: the world agrees and its expected observation appeared   |
| `next_subgoal(plan)`        | pops the plan's next subgoal that can still happen                            |
| `oracle_plan(n)`            | subgoals from a planner that knows the answer (the upper bound)               |
| `planner_observation()`     | the situation in words for the LLM planner (no step counter: cacheable)       |

- `GridWorldSubgoals` (seed 003): collect a resource / go to a goal; one skill, `collect_adjacent`; the oracle
  reads its subgoals off a shortest path (`envs.gridworld.plan`).
- `BabyAISubgoals` (minigrid BabyAI levels through `envs.external.BabyAITextEnv`): go to / pick up / open an
  object, drop; no skills; the oracle is minigrid's own `BabyAIBot`, whose subgoal stack is read after one
  `replan()` on a fresh bot told the whole grid (so it never needs to explore: an upper bound).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from envs.gridworld import ACTIONS, GridWorldEnv, plan


@dataclass
class Subgoal:
    description: str  # what the planner chose, in words
    target: tuple[int, int] | None  # the grid cell it is about (None: "drop")
    expected: str  # the observation that marks it done (the environment's wording)
    expected_steps: int  # the planner's estimate of its duration
    kind: int = 0  # index into the interface's KINDS (its one-hot goes to the controller)


class GridWorldSubgoals:
    """The seed-003 GridWorld and its procedural layouts: subgoals are resources to collect and goals to reach."""

    KINDS = ("collect", "goal")
    action_names = (*ACTIONS, "collect_adjacent")  # the four moves, then the skill library
    num_primitives = len(ACTIONS)
    planner_system = ("You plan for an agent A on a grid. Resources R give +1 each, reaching a goal G gives +3 and "
                      "ends the episode, W is a wall, each step costs 0.05. Plan the order: resources first if there "
                      "is time, then a goal.")

    def __init__(self, env: GridWorldEnv):
        self.env = env

    def layout_state(self):
        """The layout and the episode state, read through the environment's public snapshot()."""
        snap = self.env.snapshot()
        return snap["layout"], snap["state"]

    def features(self, subgoal: Subgoal | None) -> np.ndarray:
        """One-hot channels over the grid: walls, remaining resources, goals, agent, subgoal target; + steps left."""
        layout, state = self.layout_state()
        x = np.zeros((5, len(layout.grid), len(layout.grid[0])), dtype=np.float32)
        remaining, where = set(layout.resources) - state.collected, [state.pos]
        target = [subgoal.target] if subgoal is not None and subgoal.target else []
        for channel, cells in enumerate((layout.walls, remaining, layout.goals, where, target)):
            for r, c in cells:
                x[channel, r, c] = 1
        return np.concatenate([x.ravel(), [1 - state.steps / self.env.max_steps]]).astype(np.float32)

    def adjacent_resource(self) -> int | None:
        """The move that steps onto a remaining resource next to the agent, if any (skill `collect_adjacent`)."""
        layout, state = self.layout_state()
        remaining = set(layout.resources) - state.collected
        for action in range(len(ACTIONS)):
            pos, blocked = layout.move(state.pos, action)
            if blocked is None and pos in remaining:
                return action
        return None

    def action_mask(self, skills: bool) -> np.ndarray:
        """The four moves, and the skill when there is a resource next to the agent."""
        return np.array([True] * len(ACTIONS) + [skills and self.adjacent_resource() is not None], dtype=bool)

    def env_action(self, action: int) -> int:
        return action if action < len(ACTIONS) else self.adjacent_resource()

    def reached(self, subgoal: Subgoal | None, observation: str) -> bool:
        return subgoal is not None and self.layout_state()[1].pos == subgoal.target and subgoal.expected in observation

    def next_subgoal(self, plan_: list[Subgoal]) -> Subgoal | None:
        """Pop the plan's next subgoal that can still happen: a resource picked up early is skipped (seed 003 pit 3)."""
        layout, state = self.layout_state()
        remaining = set(layout.resources) - state.collected
        while plan_:
            subgoal = plan_.pop(0)
            if subgoal.expected != "collected a resource" or subgoal.target in remaining:
                return subgoal
        return None

    def candidates(self, planned: list[Subgoal]) -> list[Subgoal]:
        """A remaining resource or a goal, with its expected observation and duration (Manhattan distance)."""
        layout, state = self.layout_state()
        start = planned[-1].target if planned else state.pos
        manhattan = lambda p: abs(p[0] - start[0]) + abs(p[1] - start[1])  # noqa: E731
        taken = {s.target for s in planned}
        cands = [Subgoal(f"collect the resource at row {r}, column {c}", (r, c), "collected a resource", manhattan((r, c)))
                 for r, c in sorted(set(layout.resources) - state.collected - taken)]
        cands += [Subgoal(f"go to the goal at row {r}, column {c}", (r, c), "reached the goal", manhattan((r, c)), 1)
                  for r, c in sorted(layout.goals)]
        return cands

    def plan_complete(self, planned: list[Subgoal]) -> bool:
        return bool(planned) and planned[-1].expected == "reached the goal"

    def planner_observation(self) -> str:
        # the grid alone (no step counter, no last feedback): the same situation is the same prompt, so it is cached
        layout, state = self.layout_state()
        return f"Resources {len(state.collected)}/{len(layout.resources)}. You are A.\n{self.env.render()}"

    def oracle_plan(self, max_subgoals: int) -> list[Subgoal]:
        """Subgoals read off a shortest-path plan (envs.gridworld.plan): the best a planner could say."""
        layout, state = self.layout_state()
        planned, steps = [], 0
        while state.termination is None and len(planned) < max_subgoals and state.steps < self.env.max_steps:
            _, action = plan(layout, state, self.env.max_steps)
            pos, _ = layout.move(state.pos, action)
            new = pos in set(layout.resources) - state.collected
            state = state.__class__(pos=pos, collected=state.collected | ({pos} if new else set()), steps=state.steps + 1,
                                    termination="success" if pos in layout.goals else None)
            steps += 1
            if new or pos in layout.goals:
                kind = "collect the resource" if new else "go to the goal"
                planned.append(Subgoal(f"{kind} at row {pos[0]}, column {pos[1]}", pos,
                                       "collected a resource" if new else "reached the goal", steps, int(not new)))
                steps = 0
        return planned

    def resources(self) -> int:
        return len(self.layout_state()[1].collected)


class BabyAISubgoals:
    """A minigrid BabyAI level: go to / pick up / open an object, or drop what is carried.

    The controller sees the whole grid (minigrid's `grid.encode()`: object, colour, door state per cell), the agent's
    cell and direction, what it carries, the subgoal's cell and kind, and the mission as a bag of words (the only
    way the controller alone, without a planner, can know what to do). The planner sees the mission and the objects in
    the room, without their positions (so that its answers can be cached within an episode).
    """

    KINDS = ("go to", "pick up", "open", "drop")
    OBJECTS = ("wall", "door", "key", "ball", "box", "goal", "lava")
    COLORS = ("red", "green", "blue", "purple", "yellow", "grey")
    MISSION_WORDS = ("go", "pick", "open", "put", "next", "then", "after", "and", "front", "behind", "left", "right",
                     "door", "key", "ball", "box", *COLORS)
    planner_system = ("You plan for an agent in a grid world. Choose the next step of a plan that carries out the "
                      "mission: go to an object (end up facing it), pick up an object, open a door, or drop what "
                      "you carry.")

    def __init__(self, env):
        from minigrid.core.constants import COLOR_TO_IDX, OBJECT_TO_IDX

        self.env = env
        self.action_names = tuple(env.action_names)  # minigrid's actions 0..5; no skills
        self.num_primitives = len(self.action_names)
        self._type_of = np.full(max(OBJECT_TO_IDX.values()) + 1, -1)
        for i, name in enumerate(self.OBJECTS):
            self._type_of[OBJECT_TO_IDX[name]] = i
        self._color_of = np.array([self.COLORS.index(c) for c, _ in sorted(COLOR_TO_IDX.items(), key=lambda kv: kv[1])])

    @property
    def game(self):
        return self.env.game

    def features(self, subgoal: Subgoal | None) -> np.ndarray:
        game = self.game
        encoded = game.grid.encode()  # (width, height, 3): object index, colour index, state (door: 0 open 1 closed 2 locked)
        width, height = encoded.shape[:2]
        types, present = self._type_of[encoded[..., 0]], self._type_of[encoded[..., 0]] >= 0
        x = np.zeros((len(self.OBJECTS) + len(self.COLORS) + 3 + 2, width, height), dtype=np.float32)
        i, j = np.nonzero(present)
        x[types[i, j], i, j] = 1
        x[len(self.OBJECTS) + self._color_of[encoded[i, j, 1]], i, j] = 1
        door = encoded[..., 0] == self._door_index()
        di, dj = np.nonzero(door)
        x[len(self.OBJECTS) + len(self.COLORS) + encoded[di, dj, 2], di, dj] = 1
        x[-2, game.agent_pos[0], game.agent_pos[1]] = 1
        if subgoal is not None and subgoal.target is not None:
            x[-1, subgoal.target[0], subgoal.target[1]] = 1
        direction, carrying, kind = np.zeros(4), np.zeros(len(self.OBJECTS) + len(self.COLORS)), np.zeros(len(self.KINDS))
        direction[game.agent_dir] = 1
        if game.carrying is not None:
            carrying[self.OBJECTS.index(game.carrying.type)] = carrying[len(self.OBJECTS) + self.COLORS.index(
                game.carrying.color)] = 1
        if subgoal is not None:
            kind[subgoal.kind] = 1
        words = set(game.mission.replace(",", " ").split())
        mission = np.array([w in words for w in self.MISSION_WORDS], dtype=np.float32)
        steps_left = [1 - game.step_count / game.max_steps]
        return np.concatenate([x.ravel(), direction, carrying, kind, self.egocentric(subgoal), mission,
                               steps_left]).astype(np.float32)

    def egocentric(self, subgoal: Subgoal | None) -> np.ndarray:
        """The target in the agent's frame, as BabyAI-Text words it ("2 steps forward and 1 step left": forward,
        right, their signs, facing it), and whether the cells ahead, left and right are blocked. An MLP over
        absolute one-hot cells has to learn this relation for every pair of positions; given it, one policy
        serves every layout."""
        game = self.game
        ego = np.zeros(10, dtype=np.float32)
        for i, vec in enumerate((game.dir_vec, -game.right_vec, game.right_vec)):  # ahead, left, right
            cell = game.grid.get(*(game.agent_pos + vec))
            ego[7 + i] = cell is not None and not cell.can_overlap()
        if subgoal is not None and subgoal.target is not None:
            delta = np.array(subgoal.target) - game.agent_pos
            forward, right = int(delta @ game.dir_vec), int(delta @ game.right_vec)
            size = max(game.width, game.height)
            ego[:7] = forward / size, right / size, forward > 0, forward < 0, right > 0, right < 0, (forward, right) == (1, 0)
        return ego

    def _door_index(self) -> int:
        from minigrid.core.constants import OBJECT_TO_IDX

        return OBJECT_TO_IDX["door"]

    def action_mask(self, skills: bool) -> np.ndarray:
        return np.ones(len(self.action_names), dtype=bool)

    def env_action(self, action: int) -> int:
        return action

    def reached(self, subgoal: Subgoal | None, observation: str) -> bool:
        if subgoal is None:
            return False
        game, kind = self.game, self.KINDS[subgoal.kind]
        if kind == "go to":
            done = tuple(int(v) for v in game.front_pos) == subgoal.target
        elif kind == "pick up":
            done = game.carrying is not None and subgoal.description.endswith(f"{game.carrying.color} {game.carrying.type}")
        elif kind == "open":
            door = game.grid.get(*subgoal.target)
            done = door is not None and door.type == "door" and door.is_open
        else:
            done = game.carrying is None
        return done and says(observation, subgoal.expected)

    def next_subgoal(self, plan_: list[Subgoal]) -> Subgoal | None:
        """Pop the plan's next subgoal that is not done already (e.g. a door someone opened on the way)."""
        observation = self.view()
        while plan_:
            subgoal = plan_.pop(0)
            if not self.reached(subgoal, observation):
                return subgoal
        return None

    def _objects(self) -> dict[tuple[str, str], tuple[int, int]]:
        """Every object on the grid, by (colour, type), at its instance nearest to the agent (BabyAI's missions
        name objects by colour and type; any instance that matches counts)."""
        game, found = self.game, {}
        ax, ay = (int(v) for v in game.agent_pos)
        for x in range(game.grid.width):
            for y in range(game.grid.height):
                obj = game.grid.get(x, y)
                if obj is None or obj.type in ("wall", "goal", "lava", "floor"):
                    continue
                key, d = (obj.color, obj.type), abs(x - ax) + abs(y - ay)
                if key not in found or d < abs(found[key][0] - ax) + abs(found[key][1] - ay):
                    found[key] = (x, y)
        return found

    def _subgoal(self, kind: str, color: str, type_: str, pos, start) -> Subgoal:
        distance = abs(pos[0] - start[0]) + abs(pos[1] - start[1]) if pos is not None else 0
        if kind == "go to":  # the environment's wording once the object is right in front
            return Subgoal(f"go to the {color} {type_}", pos, f"{color} {type_} 1 step forward", distance + 2, 0)
        if kind == "pick up":
            return Subgoal(f"pick up the {color} {type_}", pos, f"You carry a {color} {type_}", 1, 1)
        if kind == "open":
            return Subgoal(f"open the {color} door", pos, f"open {color} door 1 step forward", 1, 2)
        return Subgoal("drop what you carry", None, "", 1, 3)

    def candidates(self, planned: list[Subgoal]) -> list[Subgoal]:
        game = self.game
        start = planned[-1].target if planned and planned[-1].target else tuple(int(v) for v in game.agent_pos)
        taken, cands = {s.description for s in planned}, []
        for (color, type_), pos in sorted(self._objects().items()):
            cands.append(self._subgoal("go to", color, type_, pos, start))
            if type_ in ("key", "ball", "box"):
                cands.append(self._subgoal("pick up", color, type_, pos, start))
            if type_ == "door":
                cands.append(self._subgoal("open", color, type_, pos, start))
        if game.carrying is not None or any(s.kind == 1 for s in planned):
            cands.append(self._subgoal("drop", "", "", None, start))
        return [c for c in cands if c.description not in taken]

    def plan_complete(self, planned: list[Subgoal]) -> bool:
        return False  # a BabyAI plan runs to max_subgoals; the episode ends when the mission is done

    def view(self) -> str:
        """What the agent sees, in the environment's words (BabyAI-Text style); expected observations match it."""
        from envs.external import describe_view

        game = self.game
        seen = describe_view(game.gen_obs()["image"])
        text = f"Mission: {game.mission}.\n" + (f"You see {'; '.join(seen)}." if seen else "You see nothing but the floor.")
        return text + (f" You carry a {game.carrying.color} {game.carrying.type}." if game.carrying is not None else "")

    def planner_observation(self) -> str:
        """The mission and what is in the room (not where, which changes every step): a replan in the same
        situation is the same prompt, so it hits the planner's cache."""
        game = self.game
        objects = ", ".join(f"a {color} {type_}" for color, type_ in sorted(self._objects()))
        carrying = f"a {game.carrying.color} {game.carrying.type}" if game.carrying is not None else "nothing"
        return f"Mission: {game.mission}.\nIn the room: {objects or 'nothing'}. You carry {carrying}."

    def oracle_plan(self, max_subgoals: int) -> list[Subgoal]:
        """minigrid's BabyAIBot: a fresh bot that knows the whole grid (an upper bound, like the controller's view)
        replans once; its subgoal stack, top first, is the plan."""
        from minigrid.core.world_object import WorldObj
        from minigrid.envs.babyai.core.verifier import ObjDesc
        from minigrid.utils.baby_ai_bot import BabyAIBot, DropSubgoal, GoNextToSubgoal, OpenSubgoal, PickupSubgoal

        game = self.game
        bot = BabyAIBot(game)
        bot.vis_mask[:] = True  # seen everything: no exploration subgoals (the bot alone explores what it has not seen)
        bot.replan()  # resolves the top of the stack (pops what is done already, finds the mission's objects)
        planned, last, start = [], None, tuple(int(v) for v in game.agent_pos)
        for step in reversed(bot.stack):
            if isinstance(step, GoNextToSubgoal):
                if isinstance(step.datum, ObjDesc):
                    obj, pos = bot._find_obj_pos(step.datum, step.reason == "PutNext")  # the bot's own target choice
                elif isinstance(step.datum, WorldObj):
                    obj, pos = step.datum, step.datum.cur_pos
                else:  # a cell (exploration, or next to an object to put something down)
                    pos = tuple(step.datum)
                    obj = game.grid.get(*pos)
                if pos is None:
                    break  # the bot would have to explore first; it plans that on its next replan
                pos = tuple(int(v) for v in pos)
                if obj is None or step.reason == "PutNext":  # a free cell: "go to" it means stand facing it
                    sub = Subgoal(f"go to row {pos[1]}, column {pos[0]}", pos, "", abs(pos[0] - start[0])
                                  + abs(pos[1] - start[1]) + 2, 0)
                else:
                    sub = self._subgoal("go to", obj.color, obj.type, pos, start)
                last, start = obj, pos
            elif isinstance(step, (PickupSubgoal, OpenSubgoal)) and last is not None:
                sub = self._subgoal("pick up" if isinstance(step, PickupSubgoal) else "open", last.color, last.type,
                                    start, start)
            elif isinstance(step, DropSubgoal):
                sub = self._subgoal("drop", "", "", None, start)
            else:
                continue  # ExploreSubgoal: already turned into a go-to cell above it on the stack
            planned.append(sub)
            if len(planned) == max_subgoals:
                break
        return planned

    def resources(self) -> int:
        return 0  # BabyAI has no resources to collect


def says(observation: str, phrase: str) -> bool:
    """`phrase` is one whole item of a BabyAI-Text observation ("a red ball 1 step forward", not "... and 1 step
    right"): followed by the end of an item (';' or '.')."""
    return not phrase or re.search(re.escape(phrase) + r"(?=[;.])", observation) is not None


def subgoal_interface(env):
    """The subgoal interface of `env`; a clear error for environments that have none."""
    if isinstance(env, GridWorldEnv):
        return GridWorldSubgoals(env)
    if type(env).__name__ == "BabyAITextEnv":
        return BabyAISubgoals(env)
    raise ValueError(f"no subgoal interface for {type(env).__name__}: the hybrid planner supports GridWorld "
                     "(gridworld, gridworld-procedural) and BabyAI (babyai-<level>)")
