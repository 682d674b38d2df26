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
    # The first pass leaves its snapshot valid, so the second pass reuses it.
    ep = _mlp()
    before = fingerprint(ep)
    with pytest.raises(PassError, match="changes_input = False but edited"):
        PassManager([Unchanged(), Unchanged("again"), EditInPlace(edit, changes_input=False)])(ep)
    # The pass broke its promise on the caller's graph; nothing else was touched.
    after = fingerprint(ep)
    assert [before[k] for k in ("state_dict", "constants")] == [
        after[k] for k in ("state_dict", "constants")
    ]


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


def test_an_unchanged_pass_that_edits_silently_does_not_leak_its_edit_into_the_next_check():
    # A pass that edits the shared graph but reports no change leaves a graph that
    # the held snapshot no longer describes: the next pass is judged afresh.
    class Liar:
        changes_input = False
        name = "liar"

        def __call__(self, ep: Any) -> PassResult:
            _edit_meta_value(ep)
            return PassResult(ep, False)

    ep = _mlp()
    result = PassManager([Unchanged(), Liar(), EditInPlace(lambda ep: None, changes_input=False)])(
        ep
    )
    assert [r.modified for r in result.records] == [False, False, False]


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


def test_a_pass_annotated_to_return_a_pass_result_gets_no_snapshot(monkeypatch):
    from epass.passes import presets

    ep = _mlp()
    calls = _count_snapshots(monkeypatch)
    PassManager([Unchanged(), Unchanged("again")])(ep)
    presets.lower()(ep)
    assert calls == []


def test_an_unannotated_pass_still_gets_a_snapshot(monkeypatch):
    calls = _count_snapshots(monkeypatch)
    result = PassManager([EditInPlace(lambda ep: None, changes_input=False)])(_mlp())
    assert len(calls) == 1
    assert not result.records[0].modified


def test_reports_modified_is_read_from_the_return_annotation():
    from epass.protocol import NamedPass, adapt

    def annotated(ep: Any) -> PassResult:
        return PassResult(ep, False)

    def bare(ep: Any) -> Any:
        return ep

    def unresolvable(ep: Any) -> NoSuchResult:  # type: ignore[name-defined]  # noqa: F821
        return ep

    assert adapt(annotated).reports_modified
    assert adapt(Unchanged()).reports_modified  # a method's annotation
    assert adapt(NamedPass("named", annotated)).reports_modified
    assert not adapt(bare).reports_modified
    assert not adapt(unresolvable).reports_modified
    assert not adapt(EditInPlace(lambda ep: None, changes_input=True)).reports_modified


@pytest.mark.parametrize("edit", [*GRAPH_EDITS.values(), None], ids=[*GRAPH_EDITS, "no edit"])
def test_an_annotated_pass_returning_its_view_bare_is_an_error(edit):
    # The pass got no snapshot; an edit it made to its view (or none) is refused,
    # never taken for "unmodified".
    class Annotated:
        changes_input = True
        name = "annotated"

        def __call__(self, ep: Any) -> PassResult:
            if edit is not None:
                edit(ep)
            return ep  # type: ignore[return-value]

    ep = _mlp()
    before = fingerprint(ep)
    with pytest.raises(PassError, match="annotated to return a PassResult"):
        PassManager([Unchanged(), Annotated()])(ep)
    assert fingerprint(ep) == before
