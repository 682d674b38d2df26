"""The screen of untrusted ``.pt2`` archives, which :func:`epass.io.load` runs before
torch reads a file: what the rest of epass uses of it, one concern a module below."""

# The modules, each importing only from those listed after it (pyproject.toml's
# contract "the screen's modules"): members (screen: every member by its kind) ->
# read_once (the view torch and the screen share) and schema (the walk of
# models/model.json) -> archive (zip structure, ALLOWLIST, the readers agreeing) and
# roles (the role of every string field) -> expressions (the bounds on shape and
# guard expressions) -> refusal and text.

from __future__ import annotations

from epass._screen.archive import ALLOWLIST, TRUST_ONLY, private_copy, readers_agree
from epass._screen.members import screen
from epass._screen.read_once import ReadOnce
from epass._screen.refusal import first_line
from epass._screen.roles import INPUT_ROLES, KEY_ROLES, ROLES, Role
from epass._screen.schema import screen_program

__all__ = [
    "ALLOWLIST",
    "INPUT_ROLES",
    "KEY_ROLES",
    "ROLES",
    "TRUST_ONLY",
    "ReadOnce",
    "Role",
    "first_line",
    "private_copy",
    "readers_agree",
    "screen",
    "screen_program",
]
