"""``epass.watch``: the bytes a store tensor's fingerprint reads, without numpy."""

from __future__ import annotations

import torch

from epass import watch


def test_tensor_bytes_reads_elements_in_row_major_order():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    assert watch.tensor_bytes(t) == bytes([0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0])
    assert watch.tensor_bytes(t.t()) == bytes([0, 0, 3, 0, 1, 0, 4, 0, 2, 0, 5, 0])
    assert watch.tensor_bytes(t[1]) == bytes([3, 0, 4, 0, 5, 0])
    assert watch.tensor_bytes(torch.tensor(True)) == b"\x01"
    assert watch.tensor_bytes(torch.zeros(0)) == b""


def test_tensor_bytes_reads_resolved_values_of_lazy_views():
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    assert watch.tensor_bytes(z.conj()) == watch.tensor_bytes(z.conj().resolve_conj())
    assert watch.tensor_bytes(-z) == watch.tensor_bytes(z._neg_view())
