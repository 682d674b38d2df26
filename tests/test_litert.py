"""LiteRT takes the output's module (docs/backends.md's recipe). Optional: litert-torch
is not in the tested install (1 GB, and it breaks TVM's typing_extensions)."""

from __future__ import annotations

import consumer_models as cm
import pytest
import torch
from fingerprint import fingerprint, without_versions

from epass.passes import presets

litert_torch = pytest.importorskip("litert_torch", reason="litert-torch is not installed")


@pytest.mark.slow
def test_litert_converts_the_output_module() -> None:
    s = cm.subject("mlp_buffer")
    out = presets.lower().run(s.ep)
    edge_model = litert_torch.convert(out.module(), s.args)
    actual = torch.as_tensor(edge_model(*s.args))
    torch.testing.assert_close(actual, s.expected, atol=1e-4, rtol=1e-4)
    # LiteRT bumps the version counters of the state tensors it is given; the
    # user's program and the bytes of its tensors stay as they were.
    assert without_versions(fingerprint(s.ep)) == without_versions(s.pristine)
