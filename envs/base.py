"""The text-environment protocol every agentrl environment follows.

A `TextEnv` is a `gymnasium.Env` whose observations are strings and whose actions are strings
(free mode: the environment parses what the model wrote) or, for discrete environments, indices
into `action_names` (choice mode: the policy scores each action name). Beyond gymnasium it promises
(the design's "Environment contract"):

- determinism given the seed;
- `info` of `reset` carries `env_version` and `task_id`; `info` of every `step` also carries
  `invalid_actions` (count so far this episode), `action_valid` (this step) and `reward_components`
  (this step's `format`, `progress`, `task`, `cost`, `safety`, summing to the step reward); the
  final step (terminated or truncated) adds `termination`, one of `TERMINATIONS`;
- an invalid or unparsable action never raises: it yields an error observation, is counted, and
  follows the environment's one documented rule (a penalty, or the end of the episode);
- `snapshot()` / `restore(state)` so tree search can branch from any state.

Optionally `legal_actions()` lists the action indices that are legal in the current state, for invalid-action
masking (choice mode with the rollout engine's `mask_illegal_actions`, which refuses an environment whose
`legal_actions()` is the default None).

Optionally `parallel_step = True` says that `step` waits on a subprocess and is safe to run for several
instances at once (the rollout engine then steps a batch in threads).
"""

from __future__ import annotations

import abc
import re
import string
from typing import Any

import gymnasium
import numpy as np

TERMINATIONS = ("success", "failure", "truncated", "invalid_action", "error")
REWARD_COMPONENTS = ("format", "progress", "task", "cost", "safety")


def reward_components(**values: float) -> dict[str, float]:
    """A components dict with every key of `REWARD_COMPONENTS` (missing ones 0.0)."""
    unknown = set(values) - set(REWARD_COMPONENTS)
    if unknown:
        raise ValueError(f"unknown reward components {sorted(unknown)}; valid: {REWARD_COMPONENTS}")
    return {name: float(values.get(name, 0.0)) for name in REWARD_COMPONENTS}


class TextEnv(gymnasium.Env, abc.ABC):
    """Base class: text observations, text (or index) actions, snapshot/restore."""

    metadata = {"render_modes": ["ansi"]}
    env_version: str = "unversioned"
    # None for free-text environments; discrete ones list their actions (index = position), as a class
    # attribute or set before TextEnv.__init__, which derives action_space from it.
    action_names: list[str] | None = None
    # Longest observation/action text the spaces admit; generous, they are descriptive only.
    max_text_length: int = 4096
    # True when `step` mostly waits on another process (codegen's sandbox): the rollout engine then steps
    # a batch's instances concurrently in threads. Such a `step` must not share mutable state between
    # instances (each instance may run in its own thread).
    parallel_step: bool = False

    def __init__(self) -> None:
        self.observation_space = gymnasium.spaces.Text(self.max_text_length, min_length=0, charset=string.printable)
        if self.action_names is None:
            self.action_space = gymnasium.spaces.Text(self.max_text_length, min_length=0, charset=string.printable)
        else:
            self.action_space = gymnasium.spaces.Discrete(len(self.action_names))

    @property
    @abc.abstractmethod
    def system_prompt(self) -> str:
        """Task instructions, shown once to the agent as the chat system message."""

    @abc.abstractmethod
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode. Subclasses call `super().reset(seed=seed)` first: it seeds `self.np_random`."""
        super().reset(seed=seed, options=options)

    @abc.abstractmethod
    def step(self, action: str | int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        ...

    @abc.abstractmethod
    def snapshot(self) -> object:
        """An independent copy of the full environment state (mutating the env never changes it)."""

    @abc.abstractmethod
    def restore(self, state: object) -> None:
        """Return to a state produced by `snapshot()`; the snapshot stays reusable."""

    def legal_actions(self) -> list[int] | None:
        """Indices of the actions legal in the current state; None (the default): the environment does not say.

        Invalid-action masking (Huang & Ontañón 2022, "A Closer Look at Invalid Action Masking in Policy Gradient
        Algorithms") samples and trains only over these. An environment overrides it only with what its
        observation already tells the agent, so a masked policy learns from the same information.
        """
        return None

    def parse_action(self, text: str) -> int | None:
        """Index of the first action name that appears as a whole word in `text` (case-insensitive).

        "I move right." -> index of "right"; no action name -> None. Free-text environments
        override this with their own parser.
        """
        if self.action_names is None:
            raise NotImplementedError(f"{type(self).__name__} has no action_names; override parse_action")
        if not isinstance(text, str):
            return None
        match = self._action_pattern().search(text)
        return None if match is None else self._lower_names().index(match.group(1).lower())

    def action_index(self, action: object) -> int | None:
        """Coerce an agent action (index or text) into a valid index, or None if it is invalid.

        Never raises: out-of-range ints, bools, None and other types are simply invalid.
        """
        if isinstance(action, (bool, np.bool_)):
            return None
        if isinstance(action, (int, np.integer)):
            return int(action) if 0 <= action < len(self.action_names or ()) else None
        if isinstance(action, str):
            return self.parse_action(action)
        return None

    def _lower_names(self) -> list[str]:
        return [name.lower() for name in self.action_names or ()]

    def _action_pattern(self) -> re.Pattern[str]:
        # Longest names first so a multi-word name wins over a name it contains.
        names = sorted(self._lower_names(), key=len, reverse=True)
        alternatives = "|".join(re.escape(name) for name in names)
        return re.compile(rf"(?<!\w)({alternatives})(?!\w)", re.IGNORECASE)
