"""Decompose: lower a program to core ATen (or any decomposition table)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram

from epass import _program
from epass.protocol import PassResult

__all__ = ["Decompose"]


def _table(value: Mapping[Any, Any] | None) -> dict[Any, Any] | None:
    return None if value is None else dict(value)


def _ops(value: Iterable[Any]) -> tuple[Any, ...]:
    ops = tuple(value)
    for op in ops:
        if not _program.is_operator(op):
            raise TypeError(
                "Decompose(keep=...) takes ATen operators such as "
                f"torch.ops.aten.linear.default, got {op!r}"
            )
    return ops


@attrs.define(eq=False)
class Decompose:
    """Run ``ExportedProgram.run_decompositions`` as a pass.

    Graph: retraces the program with the decomposition table. State: nothing is
    added, changed or removed; torch hands back a new ``state_dict`` dict over the
    same tensors, and the linker puts the store back in its place.

    Args:
        table: ``None`` for torch's default core-ATen table; a mapping for exactly
            that table (``{}`` decomposes nothing but still functionalizes).
        keep: ops to leave undecomposed (removed from the table).

    Example::

        out = PassManager([Decompose(keep=[torch.ops.aten.linear.default])]).run(ep)
    """

    name: ClassVar[str] = "decompose"
    changes_input: ClassVar[bool] = False

    table: dict[Any, Callable[..., Any]] | None = attrs.field(default=None, converter=_table)
    keep: tuple[Any, ...] = attrs.field(default=(), converter=_ops)

    def decomp_table(self) -> dict[Any, Callable[..., Any]]:
        """The table handed to ``run_decompositions``."""
        table: Any
        table = torch.export.default_decompositions() if self.table is None else dict(self.table)
        for op in self.keep:
            table.pop(op, None)
        return table  # type: ignore[no-any-return]

    def __call__(self, ep: ExportedProgram) -> PassResult:
        out = ep.run_decompositions(self.decomp_table())
        if out.graph_module.code == ep.graph_module.code and out.dialect == ep.dialect:
            return PassResult(ep, False)
        return PassResult(out, True)
