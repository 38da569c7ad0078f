"""Environment registry: `envs.make(env_id, **kwargs)` is the one way scripts build environments.

`env_id` is a registered id (`registered_ids()`), or an entry point `"package.module:Factory"`
(gymnasium's convention), so users plug in their own `TextEnv` without touching this package.
Environment modules are imported lazily, only when made.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from envs.base import TERMINATIONS, TextEnv
from envs.external import BABYAI_GOTO_LEVELS, BABYAI_LEVELS, BABYAI_SHAPING_WEIGHT
from envs.gridworld import BLOCKED_PENALTY, SHAPING_WEIGHT

__all__ = ["TERMINATIONS", "TextEnv", "make", "register", "registered_ids"]

Factory = Callable[..., TextEnv]

_REGISTRY: dict[str, Factory | str] = {
    "gridworld": "envs.gridworld:GridWorldEnv",
    "gridworld-procedural": "envs.gridworld:ProceduralGridWorldEnv",
    "arithmetic": "envs.reasoning:ArithmeticEnv",
    "wordproblems": "envs.reasoning:WordProblemEnv",
    "frozenlake": "envs.external:FrozenLakeTextEnv",
    "taxi": "envs.external:TaxiTextEnv",
    "cliffwalking": "envs.external:CliffWalkingTextEnv",
    "workspace": "envs.workspace:WorkspaceEnv",
    "codegen": "envs.codegen:CodegenEnv",
    "codegen-humaneval": "envs.codegen:HumanEvalEnv",
    "textworld": "envs.textworld_games:TextWorldEnv",  # optional: pip install -r requirements-textworld.txt
}


def register(env_id: str, factory: Factory | str) -> None:
    """Add `env_id`, built by `factory` (a callable, or a "package.module:Factory" string)."""
    if env_id in _REGISTRY:
        raise ValueError(f"environment id {env_id!r} is already registered")
    if ":" in env_id:
        raise ValueError(f"environment id {env_id!r} must not contain ':' (that form means an entry point)")
    _REGISTRY[env_id] = factory


def registered_ids() -> list[str]:
    return sorted(_REGISTRY)


def _load_entry_point(entry_point: str) -> Factory:
    module_name, _, attribute = entry_point.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"entry point {entry_point!r} must look like 'package.module:Factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"entry point {entry_point!r}: cannot import {module_name!r} ({error})") from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"entry point {entry_point!r}: module {module_name!r} has no callable {attribute!r}")
    return factory


def _with_defaults(entry_point: str, **defaults: Any) -> Factory:
    """A factory that imports `entry_point` only when called, with `defaults` under the caller's kwargs."""
    return lambda **kwargs: _load_entry_point(entry_point)(**{**defaults, **kwargs})


for _name in ("gridworld", "gridworld-procedural"):  # variants of envs/gridworld.py
    _REGISTRY[f"{_name}-relative"] = _with_defaults(_REGISTRY[_name], observation="relative")  # egocentric encoder
    # potential-based reward shaping (seed 003 §3.2), with either encoder
    _REGISTRY[f"{_name}-shaped"] = _with_defaults(_REGISTRY[_name], shaping=SHAPING_WEIGHT)
    _REGISTRY[f"{_name}-relative-shaped"] = _with_defaults(_REGISTRY[_name], observation="relative", shaping=SHAPING_WEIGHT)
    # ... with visit counts (a loop shows in the text), unshaped and shaped
    _REGISTRY[f"{_name}-relative-visits"] = _with_defaults(_REGISTRY[_name], observation="relative-visits")
    _REGISTRY[f"{_name}-relative-visits-shaped"] = _with_defaults(_REGISTRY[_name], observation="relative-visits",
                                                                  shaping=SHAPING_WEIGHT)
    # ... and a blocked move costs as much as a step away (envs/gridworld.py: why greedy policies bump into walls)
    _REGISTRY[f"{_name}-relative-shaped-blocked"] = _with_defaults(_REGISTRY[_name], observation="relative",
                                                                   shaping=SHAPING_WEIGHT, blocked_penalty=BLOCKED_PENALTY)
for _level in BABYAI_LEVELS:  # babyai-gotolocal, babyai-pickuploc, ... (minigrid is imported on first make)
    _REGISTRY[f"babyai-{_level.lower()}"] = _with_defaults("envs.external:BabyAITextEnv", level=_level)
for _level in BABYAI_GOTO_LEVELS:  # potential-based shaping toward the mission's objects (envs/external.py)
    _REGISTRY[f"babyai-{_level.lower()}-shaped"] = _with_defaults("envs.external:BabyAITextEnv", level=_level,
                                                                  shaping=BABYAI_SHAPING_WEIGHT)


def make(env_id: str, **kwargs: Any) -> TextEnv:
    """Build the environment `env_id` (a registered id or "package.module:Factory") with `kwargs`."""
    if env_id in _REGISTRY:
        factory = _REGISTRY[env_id]
        factory = _load_entry_point(factory) if isinstance(factory, str) else factory
    elif ":" in env_id:
        factory = _load_entry_point(env_id)
    else:
        raise ValueError(
            f"unknown environment id {env_id!r}; valid ids: {', '.join(registered_ids())}, "
            "or an entry point 'package.module:Factory'"
        )
    env = factory(**kwargs)
    if not isinstance(env, TextEnv):
        raise TypeError(f"{env_id!r} built a {type(env).__name__}, not an envs.base.TextEnv")
    return env
