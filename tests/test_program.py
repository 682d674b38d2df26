"""Each torch internal that epass/_program.py leans on, pinned so a torch change fails here."""

from __future__ import annotations

import torch

from epass import _program

aten = torch.ops.aten


# --- decomposition oracle (used by Decompose.skip_reason and Decompose.merge) -------


def test_core_aten_post_autograd_ops_is_a_subset_of_the_default_table():
    ops = _program.core_aten_post_autograd_ops()
    assert aten.addcmul.default in ops
    assert aten.linear.default not in ops  # a CIA op, handled separately
    assert ops <= set(torch.export.default_decompositions().keys())


def test_preserved_aten_cia_ops_are_cia_and_only_python_decomposed():
    preserved = _program.preserved_aten_cia_ops()
    assert preserved
    table = torch.export.default_decompositions()
    python_decomposed = _program.core_aten_post_autograd_ops()
    for op in preserved:
        assert _program.is_cia_op(op)
        assert (op in table) == (op in python_decomposed)
    assert any(op not in table for op in preserved)


def test_cia_predicates():
    assert _program.is_cia_op(aten.linear.default)
    assert _program.is_preservable_cia_op(aten.linear.default)
    assert _program.is_cia_op(aten.reshape.default)
    assert not _program.is_preservable_cia_op(aten.reshape.default)  # may alias
    assert not _program.is_cia_op(aten.add.Tensor)


def test_op_overload_and_mutability():
    assert _program.is_op_overload(aten.add.Tensor)
    assert not _program.is_op_overload(aten.add)
    assert not _program.is_op_overload(torch.ops.higher_order.cond)
    assert _program.is_mutable_op(aten.add_.Tensor)
    assert not _program.is_mutable_op(aten.add.Tensor)
