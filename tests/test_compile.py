"""AOTInductor and torch.compile take epass's output as it is: recipes of
docs/backends.md, with numerics and the user's program and state untouched."""

from __future__ import annotations

from pathlib import Path

import consumer_models as cm
import pytest
import torch

import epass
from epass.passes import presets


@pytest.mark.parametrize("pipeline", ["raw", "lower"])
def test_torch_compile_of_the_output_module_matches_eager(pipeline: str) -> None:
    s = cm.subject("mlp_buffer")
    manager = cm.PIPELINES[pipeline]()
    out = manager.run(s.ep) if manager is not None else s.ep
    compiled = torch.compile(out.module())
    with torch.no_grad():
        torch.testing.assert_close(compiled(*s.args), s.expected, atol=1e-5, rtol=1e-5)
    assert out.state_dict is s.ep.state_dict
    s.check_untouched()


@pytest.mark.slow
def test_aot_inductor_package_of_the_output_matches_eager(tmp_path: Path) -> None:
    s = cm.subject("mlp_buffer")
    out = epass.PassManager([presets.lower()]).run(s.ep)
    path = torch._inductor.aoti_compile_and_package(out, package_path=str(tmp_path / "m.pt2"))
    s.check_untouched()
    assert out.state_dict is s.ep.state_dict
    runner = torch._inductor.aoti_load_package(path)
    torch.testing.assert_close(runner(*s.args), s.expected, atol=1e-5, rtol=1e-5)
    s.check_untouched()
