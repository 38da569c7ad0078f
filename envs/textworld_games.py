"""TextWorld text adventures (Côté et al. 2018) as agentrl text environments: env id `textworld`.

TextWorld generates interactive-fiction games from a seed: rooms, containers and objects, and a quest
("open the fridge, take the teapot, put it on the pan") whose completion the game scores. It is the
setting the seeds call ALFWorld-like: long-horizon household tasks in text. Optional: it compiles games
with Inform 7 and pulls spaCy, so it is installed apart from the rest,

    pip install -r requirements-textworld.txt

and everything else in agentrl works without it (`envs.make("textworld")` then fails with that line).

Games. A game is generated offline (`textworld.make`, what `tw-make custom` does) the first time it is
needed and cached as `{cache_dir}/{name}.z8` (+ `.json`); a file lock makes concurrent environments (a
batch, or torchrun ranks) generate each game once. An episode seed picks one of `num_games` games
(`seed % num_games`); the train split uses game seeds 0..num_games-1, the test split game seeds from
1,000,000 on, so held-out games never share a layout or quest with training games. Generating a game
takes ~5 s of CPU, so the first episodes of a run are slower.

Interaction (free mode): the agent writes one command. It is valid when it names one of the game's
admissible commands (`info["admissible_commands"]`, also listed in the observation unless
`show_commands=False`): the exact command, or the longest admissible command contained in the text.
Anything else is invalid: an error observation, `format` = `invalid_penalty`, counted, and the game is
not stepped (its parser would only answer "That's not a verb I recognise."). A turn passes either way.

Reward (the verifier reads the game's own score, won and lost flags after each step): `task` = score
gained / the game's maximum score, so a finished quest sums to 1; termination `success` when the game is
won, `failure` when lost, `truncated` after `max_steps` steps. `optimal_action()` is the first command of
TextWorld's walkthrough from the current state (its `policy_commands`), for oracles and tests.
Snapshots record the commands since reset and `restore` replays them (games are deterministic).
"""

from __future__ import annotations

import copy
import fcntl
import os
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from envs.base import TextEnv, reward_components

INSTALL_HINT = "pip install -r requirements-textworld.txt"
TEST_SEED_OFFSET = 1_000_000  # test-split games are generated from seeds >= this, train games from seeds below
DEFAULT_CACHE = Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl")) / "textworld"


class MissingDependency(ImportError, ValueError):
    """An optional package is not installed. A ValueError too, so scripts' `--env-id` checks report it."""


def _import_textworld() -> Any:
    try:
        import textworld
    except ImportError as error:
        raise MissingDependency(f"the `textworld` environment needs the textworld package: {INSTALL_HINT} "
                                f"({error})") from error
    return textworld


def clean_feedback(text: str) -> str:
    """The game's text without its command prompt, status bar and title banner."""
    text = text.split("\n>")[0]  # what follows the prompt is the status bar ("-= Room =-0/1")
    text = text.split("*** The End ***")[0]  # then the interpreter's "RESTART, RESTORE, QUIT or UNDO" menu
    lines = [line.rstrip() for line in text.splitlines() if "$$" not in line and "________" not in line]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


@dataclass(frozen=True)
class GameSpec:
    """What `tw-make custom` is given: world size, objects, quest length; plus the game seed."""

    world_size: int
    nb_objects: int
    quest_length: int
    seed: int

    @property
    def name(self) -> str:
        return f"tw-w{self.world_size}-o{self.nb_objects}-q{self.quest_length}-s{self.seed}"


def generate_game(spec: GameSpec, cache_dir: str | Path) -> Path:
    """The compiled game for `spec` in `cache_dir`, generated (once, under a file lock) if missing."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{spec.name}.z8"
    with open(cache_dir / f"{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be generating this very game
        if path.exists() and path.with_suffix(".json").exists():
            return path
        textworld = _import_textworld()
        options = textworld.GameOptions()
        options.seeds = spec.seed
        options.nb_rooms, options.nb_objects = spec.world_size, spec.nb_objects
        options.chaining.min_length = options.chaining.max_length = spec.quest_length  # as tw-make custom does
        options.chaining.max_depth = spec.quest_length
        options.path, options.file_ext, options.force_recompile = str(path), ".z8", True
        textworld.make(options)
    return path


class TextWorldVerifier:
    """Scores a step from the game's own state: score gained (normalised) and won / lost."""

    def score(self, score_before: float, state: Any) -> tuple[dict[str, float], str | None]:
        gained = (float(state.score) - score_before) / max(float(state.max_score), 1.0)
        termination = "success" if state.won else "failure" if state.lost else None
        return reward_components(task=gained), termination


@dataclass(frozen=True)
class EpisodeState:
    task_id: str
    game: str
    commands: tuple[str, ...] = ()  # valid commands sent to the game since reset (snapshots replay them)
    steps: int = 0
    invalid_actions: int = 0
    termination: str | None = None


class TextWorldEnv(TextEnv):
    """A TextWorld game per episode seed, played by typed commands; see the module docstring."""

    def __init__(self, split: str = "train", num_games: int = 16, world_size: int = 3, nb_objects: int = 5,
                 quest_length: int = 3, max_steps: int = 30, invalid_penalty: float = -0.1,
                 show_commands: bool = True, cache_dir: str | Path = DEFAULT_CACHE) -> None:
        super().__init__()
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        for name, value in (("num_games", num_games), ("world_size", world_size), ("nb_objects", nb_objects),
                            ("quest_length", quest_length), ("max_steps", max_steps)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        textworld = _import_textworld()  # fail at construction, with the install line, if it is missing
        # Jericho warns that it cannot list valid actions for TextWorld's games; TextWorld lists them itself.
        warnings.filterwarnings("ignore", message="Unable to find valid actions in an unsupported game")
        self.split, self.num_games, self.max_steps = split, num_games, max_steps
        self.world_size, self.nb_objects, self.quest_length = world_size, nb_objects, quest_length
        self.invalid_penalty, self.show_commands, self.cache_dir = float(invalid_penalty), show_commands, Path(cache_dir)
        self.env_version = f"textworld-1.0+textworld-{textworld.__version__}"
        self.verifier = TextWorldVerifier()
        self._infos = textworld.EnvInfos(admissible_commands=True, policy_commands=True, max_score=True, score=True,
                                         won=True, lost=True, objective=True, description=True)
        self._games: dict[str, Any] = {}  # game path -> started TextWorld env (one per game this instance played)
        self._episode: EpisodeState | None = None
        self._state: Any = None  # TextWorld's GameState after the last valid command

    @property
    def system_prompt(self) -> str:
        return ("You are playing a text adventure. Each turn you read what happened and the commands you can use; "
                "reply with exactly one command, copied from that list (for example: open fridge). Completing "
                "the quest in the objective earns a reward of 1 and ends the game.")

    def game_spec(self, seed: int) -> GameSpec:
        offset = TEST_SEED_OFFSET if self.split == "test" else 0
        return GameSpec(self.world_size, self.nb_objects, self.quest_length, offset + seed % self.num_games)

    def _game(self, path: str) -> Any:
        if path not in self._games:
            self._games[path] = _import_textworld().start(path, request_infos=self._infos)
        return self._games[path]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        seed = int(self.np_random.integers(2**31)) if seed is None else seed
        path = str(generate_game(self.game_spec(seed), self.cache_dir))
        self._state = self._game(path).reset()
        self._episode = EpisodeState(task_id=Path(path).stem, game=path)
        text = f"{self._state.objective.strip()}\n\n{clean_feedback(self._state.description)}"
        return self._observation(text), self._info(None, None)

    def step(self, action: str | int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        episode = self._episode
        if episode is None:
            raise RuntimeError("call reset() first")
        if episode.termination is not None:
            raise RuntimeError("episode is over; call reset()")  # a caller bug, not an agent error
        command = self.parse_action(action)
        if command is None:
            components, termination = reward_components(format=self.invalid_penalty), None
            feedback = "That is not one of the commands you can use now."
            episode = replace(episode, invalid_actions=episode.invalid_actions + 1)
        else:
            score_before = float(self._state.score)
            self._state, _, _ = self._game(episode.game).step(command)
            components, termination = self.verifier.score(score_before, self._state)
            feedback = clean_feedback(self._state.feedback)
            episode = replace(episode, commands=episode.commands + (command,))
        episode = replace(episode, steps=episode.steps + 1)
        if termination is None and episode.steps >= self.max_steps:
            termination = "truncated"
        self._episode = replace(episode, termination=termination)
        terminated = termination in ("success", "failure")
        observation = self._observation(feedback)
        return observation, sum(components.values()), terminated, termination == "truncated", self._info(command, components)

    def parse_action(self, text: object) -> str | None:
        """The admissible command `text` names (exactly, or the longest one it contains), else None."""
        if not isinstance(text, str) or self._state is None:
            return None
        admissible = {command.lower(): command for command in self._state.admissible_commands or []}
        lines = [line for line in text.strip().splitlines() if line.strip()]
        first = lines[0].strip().strip("`'\".>").strip().lower() if lines else ""
        if first in admissible:
            return admissible[first]
        lowered = text.lower()
        for command in sorted(admissible, key=len, reverse=True):
            if re.search(rf"(?<!\w){re.escape(command)}(?!\w)", lowered):
                return admissible[command]
        return None

    def optimal_action(self) -> str | None:
        """The next command of TextWorld's walkthrough from here; None once the episode is over."""
        if self._episode is None or self._episode.termination is not None:
            return None
        plan = self._state.policy_commands or []
        return plan[0] if plan else None

    def _observation(self, text: str) -> str:
        state, episode = self._state, self._episode
        lines = [text, f"Score {state.score}/{state.max_score}. Step {episode.steps}/{self.max_steps}."]
        if self.show_commands and episode.termination is None:
            lines.append("Commands: " + ", ".join(state.admissible_commands or []) + ".")
        return "\n".join(lines)

    def _info(self, command: str | None, components: dict[str, float] | None) -> dict[str, Any]:
        episode = self._episode
        info: dict[str, Any] = {"env_version": self.env_version, "task_id": episode.task_id,
                                "admissible_commands": list(self._state.admissible_commands or []),
                                "score": float(self._state.score), "max_score": float(self._state.max_score)}
        if components is not None:
            info.update(invalid_actions=episode.invalid_actions, action_valid=command is not None,
                        command=command, reward_components=components)
        if episode.termination is not None:
            info["termination"] = episode.termination
        return info

    def snapshot(self) -> dict[str, Any]:
        if self._episode is None:
            raise RuntimeError("call reset() first")
        return {"episode": self._episode, "np_random": copy.deepcopy(self.np_random.bit_generator.state)}

    def restore(self, state: dict[str, Any]) -> None:
        """Replay the snapshot's commands from the game's start (games are deterministic)."""
        episode = state["episode"]
        self._state = self._game(episode.game).reset()
        for command in episode.commands:
            self._state, _, _ = self._game(episode.game).step(command)
        self._episode = episode
        self.np_random.bit_generator.state = copy.deepcopy(state["np_random"])

    def render(self) -> str:
        return clean_feedback(self._state.feedback) if self._state is not None else ""

    def close(self) -> None:
        for game in self._games.values():
            game.close()
        self._games.clear()
