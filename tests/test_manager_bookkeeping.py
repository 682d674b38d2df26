"""The manager's per-pass bookkeeping: the before/after snapshot held across passes,
lazy op deltas, PassInfo.previous, and the order of instrument hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import models
import pytest
import torch
from fingerprint import fingerprint

import epass
import epass.records
from epass import PassError, PassManager, PassResult
from epass.records import OpDelta

aten = torch.ops.aten


class Unchanged:
    """Leaves the program alone and says so: the snapshot it was given is held over."""

    changes_input = False

    def __init__(self, name: str = "unchanged") -> None:
        self.name = name

    def __call__(self, ep: Any) -> PassResult:
        return PassResult(ep, False)


def _first_call(ep: Any) -> torch.fx.Node:
    return next(n for n in ep.graph.nodes if n.op == "call_function")


def _edit_meta_value(ep: Any) -> None:
    _first_call(ep).meta["stack_trace"] = "edited in place"


def _edit_nested_meta(ep: Any) -> None:
    stack = next(n.meta["nn_module_stack"] for n in ep.graph.nodes if n.meta.get("nn_module_stack"))
    key = next(iter(stack))
    stack[key] = ("edited", stack[key][1])


def _edit_args(ep: Any) -> None:
    node = next(n for n in ep.graph.nodes if n.target is aten.relu.default)
    node.args = (node.args[0].args[0], *node.args[1:])  # skip the node feeding relu


GRAPH_EDITS: dict[str, Callable[[Any], None]] = {
    "meta value": _edit_meta_value,
    "nested meta": _edit_nested_meta,
    "node args": _edit_args,
}


def _edit_signature(ep: Any) -> None:
    spec = next(s for s in ep.graph_signature.input_specs if s.kind.name == "PARAMETER")
    spec.persistent = False


def _edit_state(ep: Any) -> None:
    key = next(iter(ep.state_dict))
    ep.state_dict[key] = torch.nn.Parameter(ep.state_dict[key].detach() * 2)


class EditInPlace:
    def __init__(self, edit: Callable[[Any], None], *, changes_input: bool) -> None:
        self.edit = edit
        self.changes_input = changes_input
        self.name = "edit"

    def __call__(self, ep: Any) -> Any:
        self.edit(ep)
        return ep


def _mlp() -> Any:
    return models.export("mlp")[1]


@pytest.mark.parametrize("edit", GRAPH_EDITS.values(), ids=GRAPH_EDITS.keys())
def test_in_place_graph_edit_after_an_unchanged_pass_is_caught(edit):
    # The pass broke its promise on a private copy: it fails, and the caller's
    # program never saw the edit.
    ep = _mlp()
    before = fingerprint(ep)
    with pytest.raises(PassError, match="changes_input = False but changed") as caught:
        PassManager([Unchanged(), Unchanged("again"), EditInPlace(edit, changes_input=False)])(ep)
    assert caught.value.pass_name == "edit"
    assert fingerprint(ep) == before


@pytest.mark.parametrize("edit", GRAPH_EDITS.values(), ids=GRAPH_EDITS.keys())
def test_in_place_graph_edit_on_a_private_copy_after_an_unchanged_pass_counts(edit):
    ep = _mlp()
    before = fingerprint(ep)
    result = PassManager([Unchanged(), EditInPlace(edit, changes_input=True)])(ep)
    assert [r.modified for r in result.records] == [False, True]
    assert fingerprint(ep) == before


@pytest.mark.parametrize(
    ("edit", "changes_input"),
    [(_edit_signature, True), (_edit_state, True), (_edit_state, False)],
    ids=["graph signature", "state entry", "state entry, changes_input=False"],
)
def test_in_place_program_edit_after_an_unchanged_pass_counts(edit, changes_input):
    # (A signature is the graph's: a pass that edits it declares changes_input.)
    ep = _mlp()
    before = fingerprint(ep)
    result = PassManager([Unchanged(), EditInPlace(edit, changes_input=changes_input)])(ep)
    assert [r.modified for r in result.records] == [False, True]
    assert fingerprint(ep) == before


def test_a_pass_returning_its_view_unedited_after_an_unchanged_pass_is_unmodified():
    ep = _mlp()
    result = PassManager([Unchanged(), EditInPlace(lambda ep: None, changes_input=False)])(ep)
    assert [r.modified for r in result.records] == [False, False]
    assert result.program is ep


def test_a_pass_that_edits_silently_under_changes_input_false_fails_and_leaves_the_caller_intact():
    # Its declaration and its flag are both checked against a snapshot of its copy.
    class Liar:
        changes_input = False
        name = "liar"

        def __call__(self, ep: Any) -> PassResult:
            _edit_meta_value(ep)
            return PassResult(ep, False)

    ep = _mlp()
    before = fingerprint(ep)
    with pytest.raises(PassError, match="changes_input = False but changed the meta") as caught:
        PassManager([Unchanged(), Liar(), EditInPlace(lambda ep: None, changes_input=False)])(ep)
    assert caught.value.pass_name == "liar"
    assert fingerprint(ep) == before


def test_an_edit_under_modified_false_is_kept_and_said():
    class Liar:
        name = "liar"

        def __call__(self, ep: Any) -> PassResult:
            _edit_args(ep)
            return PassResult(ep, False)

    ep = _mlp()
    before = fingerprint(ep)
    result = PassManager([Liar()])(ep)
    (record,) = result.records
    assert record.modified
    assert [n.kind for n in record.notices] == ["declaration"]
    assert "modified=False" in record.notices[0].text
    assert fingerprint(ep) == before
    assert fingerprint(result.program) != before


def test_op_delta_is_named_only_when_first_read(monkeypatch):
    ep = models.export("mlp")[1]
    named: list[Any] = []
    real = epass.records.op_name
    monkeypatch.setattr(epass.records, "op_name", lambda t: named.append(t) or real(t))

    def relu_to_gelu(ep: Any) -> PassResult:
        for node in ep.graph.nodes:
            if node.target is aten.relu.default:
                node.target = aten.gelu.default
        ep.graph_module.recompile()
        return PassResult(ep, True)

    relu_to_gelu.changes_input = True  # type: ignore[attr-defined]
    record = PassManager([relu_to_gelu])(ep).records[0]
    assert named == []
    assert isinstance(record.op_delta, OpDelta)
    relus = sum(1 for n in ep.graph.nodes if n.target is aten.relu.default)
    assert dict(record.op_delta) == {"aten.gelu.default": relus, "aten.relu.default": -relus}
    assert named != []
    assert record.as_dict()["op_delta"] == dict(record.op_delta)


def test_pass_info_carries_the_passes_that_ran_before_it_in_its_step():
    seen: list[tuple[str, tuple[str, ...]]] = []

    class Spy:
        def before_pass(self, info: Any, program: Any) -> None:
            seen.append((info.name, info.previous))

    PassManager([Unchanged("a"), Unchanged("b"), Unchanged("c")], instruments=[Spy()])(_mlp())
    assert seen == [("a", ()), ("b", ("a",)), ("c", ("a", "b"))]


def test_pass_info_location_names_the_pass_in_errors():
    class Boom:
        name = "boom"

        def __call__(self, ep: Any) -> Any:
            raise RuntimeError("kaboom")

    with pytest.raises(PassError) as caught:
        PassManager([Unchanged("a"), Boom()])(_mlp())
    error = caught.value
    assert (error.pass_name, error.index, error.previous) == ("boom", 1, ("a",))


class Log:
    def __init__(self, tag: str, log: list[str]) -> None:
        self.tag, self.log = tag, log

    def before_pipeline(self, manager: Any, program: Any) -> None:
        self.log.append(f"{self.tag}.before_pipeline")

    def before_pass(self, info: Any, program: Any) -> None:
        self.log.append(f"{self.tag}.before_pass")

    def after_pass(self, info: Any, program: Any, record: Any) -> None:
        self.log.append(f"{self.tag}.after_pass")

    def pass_failed(self, info: Any, program: Any, error: Any) -> None:
        self.log.append(f"{self.tag}.pass_failed")

    def after_pipeline(self, manager: Any, result: Any) -> None:
        self.log.append(f"{self.tag}.after_pipeline")


def test_after_hooks_run_in_reverse_registration_order():
    log: list[str] = []
    PassManager([Unchanged()], instruments=[Log("A", log), Log("B", log)])(_mlp())
    assert log == [
        "A.before_pipeline",
        "B.before_pipeline",
        "A.before_pass",
        "B.before_pass",
        "B.after_pass",
        "A.after_pass",
        "B.after_pipeline",
        "A.after_pipeline",
    ]


def test_failure_hooks_run_in_reverse_registration_order():
    log: list[str] = []

    def boom(ep: Any) -> Any:
        raise RuntimeError("kaboom")

    with pytest.raises(PassError):
        PassManager([boom], instruments=[Log("A", log), Log("B", log)])(_mlp())
    assert log[-2:] == ["B.pass_failed", "A.pass_failed"]


def test_nested_pipelines_unwind_inner_instruments_first():
    log: list[str] = []
    inner = PassManager([Unchanged()], instruments=[Log("inner", log)], name="inner")
    PassManager([inner], instruments=[Log("outer", log)])(_mlp())
    passes = [entry for entry in log if "pass" in entry and "pipeline" not in entry]
    # outer wraps the nested pipeline; inside it, outer's hooks run around inner's.
    assert passes == [
        "outer.before_pass",
        "outer.before_pass",
        "inner.before_pass",
        "inner.after_pass",
        "outer.after_pass",
        "outer.after_pass",
    ]


# --- one validate() per built program ---------------------------------------------


def _count_validations(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    real = torch.export.ExportedProgram.validate

    def counting(self: Any) -> None:
        calls.append(self)
        real(self)

    monkeypatch.setattr(torch.export.ExportedProgram, "validate", counting)
    return calls


def test_a_program_a_built_in_pass_built_is_validated_once(monkeypatch):
    from epass.passes import CastDtype

    ep = models.export("mlp")[1]
    calls = _count_validations(monkeypatch)
    result = PassManager([CastDtype()])(ep)
    assert result.records[0].modified
    assert len(calls) == 1  # by the constructor; verification saw nothing changed since


def _cast_then(edit: Callable[[Any], None]) -> Any:
    from epass.passes import CastDtype

    def cast_and_edit(ep: Any) -> Any:
        out = CastDtype()(ep).program
        edit(out)
        return out

    return cast_and_edit


def _drop_a_val(ep: Any) -> None:
    del _first_call(ep).meta["val"]


def _rename_an_output(ep: Any) -> None:
    ep.graph_signature.output_specs[0].arg.name = "nowhere"


@pytest.mark.parametrize("edit", [_drop_a_val, _rename_an_output], ids=["meta val", "signature"])
def test_a_built_program_edited_after_construction_is_validated_again(edit):
    ep = models.export("mlp")[1]
    with pytest.raises(epass.VerificationError, match="does not verify"):
        PassManager([_cast_then(edit)])(ep)


def test_a_built_program_edited_harmlessly_is_validated_again(monkeypatch):
    def retarget(ep: Any) -> None:
        node = next(n for n in ep.graph.nodes if n.target is aten.relu.default)
        node.target = aten.gelu.default

    ep = models.export("mlp")[1]
    calls = _count_validations(monkeypatch)
    PassManager([_cast_then(retarget)])(ep)
    assert len(calls) == 2  # the constructor's, and verification's after the edit


# --- no before-snapshot for a pass that reports its own flag --------------------------


def _count_snapshots(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    import epass._snapshot

    calls: list[Any] = []
    real = epass._snapshot.ProgramSnapshot.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(self)
        real(self, *args, **kwargs)

    monkeypatch.setattr(epass._snapshot.ProgramSnapshot, "__init__", counting)
    return calls


def test_epass_passes_get_no_snapshot_and_any_other_pass_does(monkeypatch):
    from epass.passes import presets

    ep = _mlp()
    calls = _count_snapshots(monkeypatch)
    presets.lower()(ep)
    assert calls == []
    PassManager([Unchanged(), Unchanged("again")])(ep)  # annotated: checked all the same
    assert len(calls) == 2


def test_an_unannotated_pass_still_gets_a_snapshot(monkeypatch):
    calls = _count_snapshots(monkeypatch)
    result = PassManager([EditInPlace(lambda ep: None, changes_input=False)])(_mlp())
    assert len(calls) == 1
    assert not result.records[0].modified


def test_a_look_alike_of_an_epass_pass_gets_no_lease():
    from epass.passes import DeadCodeElimination
    from epass.protocol import adapt, epass_defined

    class LookAlike(DeadCodeElimination):
        pass

    class Claims:
        _takes_lease = True

        def __call__(self, ep: Any) -> Any:
            return ep

    assert adapt(DeadCodeElimination()).takes_lease
    assert epass_defined(DeadCodeElimination()) and not epass_defined(LookAlike())
    assert not adapt(LookAlike()).takes_lease
    assert not adapt(Claims()).takes_lease


@pytest.mark.parametrize("edit", [*GRAPH_EDITS.values(), None], ids=[*GRAPH_EDITS, "no edit"])
def test_an_annotated_pass_returning_its_view_bare_is_judged_by_its_snapshot(edit):
    # Its annotation says nothing the manager believes: its copy shows what it did.
    class Annotated:
        changes_input = True
        name = "annotated"

        def __call__(self, ep: Any) -> PassResult:
            if edit is not None:
                edit(ep)
            return ep  # type: ignore[return-value]

    ep = _mlp()
    before = fingerprint(ep)
    result = PassManager([Unchanged(), Annotated()])(ep)
    assert [r.modified for r in result.records] == [False, edit is not None]
    assert fingerprint(ep) == before


def test_an_fx_pass_edit_under_modified_false_is_kept_and_said():
    from torch.fx.passes.infra.pass_base import PassResult as FxResult

    from epass import FxPass

    def liar(gm: torch.fx.GraphModule) -> FxResult:
        for node in gm.graph.nodes:
            if node.target is aten.relu.default:
                node.target = aten.sigmoid.default
        gm.recompile()
        return FxResult(gm, False)

    ep = _mlp()
    before = fingerprint(ep)
    (record,) = PassManager([FxPass(liar)])(ep).records
    assert record.modified
    assert [n.kind for n in record.notices] == ["declaration"]
    assert fingerprint(ep) == before
