"""``epass._screen.roles``: every string field of torch's schema has a role, and each
role's check lets through what torch writes and refuses code, quotes and imports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import screen_helpers as h

import epass
from epass import _pt2
from epass._screen import roles, schema
from epass.errors import UnsafeArchiveError


def test_every_string_field_of_torchs_schema_has_a_role() -> None:
    root = _pt2.export_schema()[0]
    positions = set(schema.string_positions(root))
    missing = {
        (cls, field, where)
        for cls, field, where in positions
        if (
            (cls, field) not in roles.KEY_ROLES
            if where == "key"
            else (cls, field) not in roles.ROLES
        )
        and not (where == "key" and isinstance(roles.ROLES.get((cls, field)), dict))
    }
    assert not missing, f"string fields without a role: {sorted(missing)}"
    fields = {(cls, field) for cls, field, _ in positions}
    stale = (set(roles.ROLES) | set(roles.KEY_ROLES)) - fields
    assert not stale, f"roles for fields the schema no longer has: {sorted(stale)}"
    assert {inner for _, inner in roles.INPUT_ROLES} <= fields


def test_a_string_field_without_a_role_is_refused(
    small: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(roles.ROLES, ("ExportedProgram", "torch_version"))
    with pytest.raises(UnsafeArchiveError, match="no role for") as info:
        epass.load(h.write(small, tmp_path / "a.pt2"))
    assert "field torch_version" in str(info.value)


def test_pytree_spec_naming_a_module_is_refused(
    small: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch imports the module an enum key of a pytree spec names while it loads."""
    marker = tmp_path / "imported"
    (tmp_path / "epass_screen_marker_module.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    program = h.program_of(small)
    signature = program["graph_module"]["module_call_graph"][0]["signature"]
    protocol, spec = json.loads(signature["in_spec"])
    key = {"__enum__": True, "fqn": "epass_screen_marker_module:E", "name": "A"}
    spec["children_spec"][1]["context"] = json.dumps([key])
    signature["in_spec"] = json.dumps([protocol, spec])
    evil = h.write(small, tmp_path / "enum.pt2", program)
    h.assert_torch_runs_it(evil, marker, "torch no longer imports modules named by pytree specs")
    sys.modules.pop("epass_screen_marker_module", None)
    with pytest.raises(UnsafeArchiveError, match="pytree spec"):
        epass.load(evil)
    assert not marker.exists()


def test_operator_targets_must_resolve_to_operators() -> None:
    check = roles.OPERATOR.check
    for good in ("torch.ops.aten.add.Tensor", "torch.ops.aten.__and__.Tensor",
                 "torch.ops.higher_order.cond", "_operator.getitem", "torch.sym_max"):  # fmt: skip
        assert check(good) is None, good
    for bad in ("torch.hub.load", "torch.ops.load_library", "torch.ops.import_module.x.y",
                "torch.ops.aten.add", "builtins.eval", "os.system",
                "torch.ops.aten.add.__call__"):  # fmt: skip
        assert check(bad) is not None, bad
    # not registered here: left to torch, which refuses it and names it
    assert check("torch.ops.epass_not_registered_ns.op.default") is None


def test_identifiers_refuse_code_keywords_and_folded_unicode() -> None:
    check = roles.IDENTIFIER.check
    assert check("p_layers_0_weight") is None and check("größe") is None
    for bad in ("x=1", "a b", "for", "__class__", "\uff58", "", "x\n"):
        assert check(bad) is not None, bad
    for name in ("layers.0.weight", "blocks.conv-1.bias", "__main__.Point"):
        assert roles.FQN.check(name) is None, name
    for name in ("layers..weight", "a.b c", 'a."b', "a.\uff58"):
        assert roles.FQN.check(name) is not None, name
    assert roles.FQN.check("layers.0.weight')") is not None


def test_node_metadata_values_are_checked_by_their_key(
    small: dict[str, bytes], tmp_path: Path
) -> None:
    meta = roles.NODE_METADATA
    assert meta["source_fn_stack"].check("linear,torch.nn.modules.linear.Linear") is None
    assert meta["source_fn_stack"].check("x,__import__('os').system") is not None
    assert meta["nn_module_stack"].check("L__self__,,m.M;L__self__lin,lin,torch.nn.Linear") is None
    assert meta["nn_module_stack"].check("k,lin\"),__import__('os')#,T") is not None
    assert meta["custom"].check('{"tag": ["a", 1]}') is None
    assert meta["custom"].check('{"tag": "a\\rb"}') is not None
    assert meta["custom"].check("not json") is not None
    assert meta["stack_trace"].check('File "a.py", line 1, in f\n    x = 1') is None
    assert meta["stack_trace"].check("line\rprint(1)") is not None
    program = h.program_of(small)
    node = program["graph_module"]["graph"]["nodes"][0]
    node["metadata"]["custom"] = json.dumps({"tag": "kept"})
    loaded = epass.load(h.write(small, tmp_path / "custom.pt2", program))
    assert any(n.meta.get("custom") == {"tag": "kept"} for n in loaded.graph.nodes)
    node["metadata"]["custom"] = json.dumps({"tag": "\x1b]0;title\x07"})
    with pytest.raises(UnsafeArchiveError, match=r"metadata\['custom'\].*JSON data"):
        epass.load(h.write(small, tmp_path / "escape.pt2", program))
