"""The walk of ``models/model.json`` with torch's schema: every value must be what its
field's type says, every string pass its field's role, all expressions one budget."""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Iterator
from typing import Any

import torch

from epass import _pt2
from epass._screen.expressions import (
    PROGRAM_EXPR_CHARS,
    PROGRAM_MIN_MAX_ARGS,
    PROGRAM_TERMS,
    expression_cost,
)
from epass._screen.refusal import Refusal
from epass._screen.roles import GUARD, INPUT_ROLES, KEY_ROLES, ROLES, SYMBOLIC, Role

__all__ = ["screen_program", "string_positions"]

_FIELDS: dict[type, dict[str, Any]] = {}


def _fields(cls: type) -> dict[str, Any]:
    """A schema dataclass's field types (``Annotated`` stripped, forward refs resolved)."""
    if cls not in _FIELDS:
        _FIELDS[cls] = typing.get_type_hints(cls)
    return _FIELDS[cls]


def string_positions(root: type) -> Iterator[tuple[str, str, str]]:
    """Every place the schema holds a string: (dataclass, field, "value" or "key")."""
    seen: set[type] = set()

    def visit(tp: Any, owner: tuple[str, str]) -> Iterator[tuple[str, str, str]]:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is str:
            yield (*owner, "value")
        elif origin is dict:
            if args[0] is str:
                yield (*owner, "key")
            yield from visit(args[1], owner)
        elif origin in (list, typing.Union, types.UnionType):
            for arg in args:
                yield from visit(arg, owner)
        elif dataclasses.is_dataclass(tp) and isinstance(tp, type) and tp not in seen:
            seen.add(tp)
            for name, field_type in _fields(tp).items():
                yield from visit(field_type, (tp.__name__, name))

    yield from visit(root, ("", ""))


class _ProgramWalk:
    """Checks one model.json against the schema; counts the strings it checked."""

    def __init__(self, member: str) -> None:
        self.member = member
        self.strings = 0
        self.union: type = _pt2.export_schema()[2]
        self.checked: dict[tuple[str, str], str | None] = {}  # (role, text): why
        self.terms = self.min_max = self.expression_chars = 0

    def refuse(self, path: str, why: str) -> Refusal:
        return Refusal(self.member, f"field {path or '<root>'}: {why}")

    def string(self, value: Any, role: Role | None, path: str) -> None:
        if not isinstance(value, str):
            raise self.refuse(path, f"{type(value).__name__} where the schema has a string")
        if role is None:
            raise self.refuse(path, "a string field the screen has no role for")
        self.strings += 1
        key = (role.name, value)
        seen = key in self.checked
        if not seen:  # a program repeats its shape expressions and names
            self.checked[key] = role.check(value)
        why = self.checked[key]
        if why is not None:
            raise self.refuse(path, f"not a valid {role.name} ({why}): {value[:80]!r}")
        if role is SYMBOLIC or role is GUARD:
            self.budget(value, seen, path)

    def budget(self, expression: str, seen: bool, path: str) -> None:
        """Bound the time torch spends on all of the program's expressions together."""
        self.expression_chars += len(expression)
        if not seen:
            terms, min_max = expression_cost(expression)
            self.terms += terms
            self.min_max += min_max
        for total, limit, what in (
            (self.expression_chars, PROGRAM_EXPR_CHARS, "characters"),
            (self.terms, PROGRAM_TERMS, "terms in distinct expressions"),
            (self.min_max, PROGRAM_MIN_MAX_ARGS, "Max/Min arguments in distinct expressions"),
        ):
            if total > limit:
                raise self.refuse(
                    path, f"the program's shape expressions exceed {limit} {what} here"
                )

    def walk(
        self, value: Any, tp: Any, owner: tuple[str, str], path: str, outer: tuple[str, str]
    ) -> None:
        """Check ``value`` against the schema type ``tp``, found in field ``owner`` of a
        dataclass that itself sits in field ``outer``."""
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is str:
            role = INPUT_ROLES.get((outer, owner)) or ROLES.get(owner)
            self.string(value, role if isinstance(role, Role) else None, path)
        elif tp is bool:
            if not isinstance(value, bool):
                raise self.refuse(path, f"{type(value).__name__} where the schema has a bool")
        elif tp is int or (isinstance(tp, type) and issubclass(tp, enum.IntEnum)):
            if type(value) is not int or abs(value) >= 1 << 64:
                raise self.refuse(path, "not a 64-bit integer")
            members: Any = getattr(tp, "_value2member_map_", None)
            if members is not None and value not in members:
                raise self.refuse(path, f"{value} is not a {tp.__name__}")
        elif tp is float:
            if not (type(value) in (int, float) or value in ("Infinity", "-Infinity", "NaN")):
                raise self.refuse(path, f"{type(value).__name__} where the schema has a float")
        elif origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return
            (inner,) = [a for a in args if a is not type(None)]
            self.walk(value, inner, owner, path, outer)
        elif origin is list:
            if not isinstance(value, list):
                raise self.refuse(path, f"{type(value).__name__} where the schema has a list")
            for i, item in enumerate(value):
                self.walk(item, args[0], owner, f"{path}[{i}]", outer)
        elif origin is dict:
            self.mapping(value, args[1], owner, path, outer)
        elif isinstance(tp, type) and issubclass(tp, self.union):
            fields = _fields(tp)
            if not isinstance(value, dict) or len(value) != 1:
                raise self.refuse(path, f"not one {tp.__name__} (an object with one key)")
            ((key, item),) = value.items()
            if key not in fields:
                raise self.refuse(
                    path, f"{str(key)[:60]!r} is not a {tp.__name__} the schema knows"
                )
            self.walk(item, fields[key], (tp.__name__, key), f"{path}.{key}", owner)
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
            fields = _fields(tp)
            if not isinstance(value, dict):
                raise self.refuse(
                    path, f"{type(value).__name__} where the schema has {tp.__name__}"
                )
            for key, item in value.items():
                if key not in fields:
                    raise self.refuse(
                        path, f"{str(key)[:60]!r}, a field {tp.__name__} does not have"
                    )
                where = f"{path}.{key}".lstrip(".")
                self.walk(item, fields[key], (tp.__name__, key), where, owner)
        else:
            raise self.refuse(path, f"a schema type the screen does not know ({tp!r})")

    def mapping(
        self, value: Any, item_type: Any, owner: tuple[str, str], path: str, outer: tuple[str, str]
    ) -> None:
        if not isinstance(value, dict):
            raise self.refuse(path, f"{type(value).__name__} where the schema has a dict")
        roles = ROLES.get(owner)
        for key, item in value.items():
            where = f"{path}[{key[:40]!r}]"
            if isinstance(roles, dict):  # meta: the key decides what the value holds
                if key not in roles:
                    raise self.refuse(where, "a metadata key the screen does not know")
                self.string(item, roles[key], where)
                continue
            self.string(key, KEY_ROLES.get(owner), f"{path} (key {key[:40]!r})")
            self.walk(item, item_type, owner, where, outer)


def _check_version(member: str, program: dict[str, Any]) -> None:
    _, (major, minor), _ = _pt2.export_schema()
    version = program.get("schema_version")
    if not isinstance(version, dict) or set(version) != {"major", "minor"}:
        raise Refusal(member, "no schema_version")
    theirs = (version["major"], version["minor"])
    if not all(type(v) is int for v in theirs) or theirs[0] != major or theirs[1] > minor:
        raise Refusal(
            member,
            f"schema version {theirs[0]}.{theirs[1]}, which torch {torch.__version__} "
            f"(schema {major}.{minor}) does not know: its fields cannot be screened",
        )


def screen_program(member: str, data: bytes) -> int:
    """Check ``models/model.json`` field by field; returns how many strings it checked.

    Raises:
        Refusal: a value the schema does not allow, naming its JSON path and role.
    """
    try:
        program = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise Refusal(member, f"not valid JSON ({exc})") from exc
    if not isinstance(program, dict):
        raise Refusal(member, "not a serialized program")
    _check_version(member, program)
    walk = _ProgramWalk(member)
    try:
        walk.walk(program, _pt2.export_schema()[0], ("", ""), "", ("", ""))
    except RecursionError:
        raise Refusal(member, "a program nested too deeply to screen") from None
    return walk.strings
