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


# --- same_view (the linker's per-entry check) -----------------------------------------


def test_same_view_relinks_new_objects_over_the_same_memory():
    base = torch.zeros(16)
    assert _program.same_view(base, base.detach())
    assert _program.same_view(torch.zeros(0), torch.zeros(0))
    p = torch.nn.Parameter(torch.zeros(3))
    assert _program.same_view(p, torch.nn.Parameter(p.detach()))


def test_same_view_rejects_any_other_geometry_dtype_or_kind():
    base = torch.zeros(16)
    assert not _program.same_view(base, base.view(torch.int32))
    assert not _program.same_view(base, base[1:])
    assert not _program.same_view(base, base.view(4, 4))
    assert not _program.same_view(base.view(4, 4), base.view(4, 4).t())
    assert not _program.same_view(base, torch.zeros(16))
    p = torch.nn.Parameter(torch.zeros(3))
    assert not _program.same_view(p, p.detach())
    meta = torch.empty(3, device="meta")
    assert not _program.same_view(meta, meta.detach())
    sparse = torch.eye(3).to_sparse()
    assert not _program.same_view(sparse, sparse.detach())
    assert not _program.same_view(1, 1.0)


# --- tensor_bytes (fingerprints without numpy) -----------------------------------------


def test_tensor_bytes_reads_elements_in_row_major_order():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    assert _program.tensor_bytes(t) == bytes([0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0])
    assert _program.tensor_bytes(t.t()) == bytes([0, 0, 3, 0, 1, 0, 4, 0, 2, 0, 5, 0])
    assert _program.tensor_bytes(t[1]) == bytes([3, 0, 4, 0, 5, 0])
    assert _program.tensor_bytes(torch.tensor(True)) == b"\x01"
    assert _program.tensor_bytes(torch.zeros(0)) == b""
