"""Seed 000's productivity co-pilot workspace (mail, calendar, spreadsheet, documents, chat, files):
JSON tool calls, safety rules and curriculum levels L1-L5. Rewards and rules: `envs.workspace.env`.

Modules: `world` (state, seeded generation, formula engine), `tools` (schema, parser, operations),
`tasks` (families per level, oracles, state-based checks), `env` (WorkspaceEnv and its verifier).
"""

from envs.workspace.env import WorkspaceEnv, WorkspaceVerifier
from envs.workspace.tasks import FAMILIES
from envs.workspace.tools import parse_tool_call

__all__ = ["FAMILIES", "WorkspaceEnv", "WorkspaceVerifier", "parse_tool_call"]
