"""Decompose: lower a program to core ATen (or any decomposition table)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.export import ExportedProgram

from epass.protocol import PassResult

__all__ = ["Decompose"]


class Decompose:
    """Run ``ExportedProgram.run_decompositions`` as a pass.

    Graph: retraces the program with the decomposition table. State: none added,
    changed or removed; torch hands back a new ``state_dict`` dict over the same
    tensors, which the linker replaces with the store.

    Args:
        table: ``None`` for torch's default core-ATen table; a mapping for exactly
            that table (``{}`` decomposes nothing but still functionalizes).
        keep: ops to leave undecomposed (removed from the table).

    Example::

        out = PassManager([Decompose(keep=[torch.ops.aten.linear.default])]).run(ep)
    """

    name = "decompose"
    changes_input = False

    def __init__(
        self,
        table: Mapping[torch._ops.OperatorBase, Callable[..., Any]] | None = None,
        keep: Iterable[torch._ops.OperatorBase] = (),
    ) -> None:
        self.table = None if table is None else dict(table)
        self.keep = tuple(keep)
        for op in self.keep:
            if not isinstance(op, torch._ops.OperatorBase):
                raise TypeError(
                    f"Decompose(keep=...) takes ATen overloads such as "
                    f"torch.ops.aten.linear.default, got {op!r}"
                )

    def __repr__(self) -> str:
        keep = f", keep={[str(op) for op in self.keep]}" if self.keep else ""
        table = "" if self.table is None else f"table=<{len(self.table)} ops>"
        return f"Decompose({table}{keep})"

    def decomp_table(self) -> dict[torch._ops.OperatorBase, Callable[..., Any]]:
        """The table handed to ``run_decompositions``."""
        table: Any = (
            torch.export.default_decompositions() if self.table is None else dict(self.table)
        )
        for op in self.keep:
            table.pop(op, None)
        return table  # type: ignore[no-any-return]

    def __call__(self, ep: ExportedProgram) -> PassResult:
        out = ep.run_decompositions(self.decomp_table())
        if out.graph_module.code == ep.graph_module.code and out.dialect == ep.dialect:
            return PassResult(ep, False)
        return PassResult(out, True)
