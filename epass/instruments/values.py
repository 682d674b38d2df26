"""Values of runs: how far outputs or a node's values are from the expected ones,
and running a program without touching its state (the user's tensors)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram

from epass import _program, _tensors
from epass.errors import ArgumentValueError, ProgramError

__all__ = [
    "Drift",
    "NodeDrift",
    "check_untouched",
    "clone",
    "compare_outputs",
    "private_copy",
    "run_program",
    "state_versions",
    "state_view",
]


@attrs.frozen
class NodeDrift:
    """The first node of a pass's input whose value differs in the pass's output.

    Attributes:
        node: its name in the program before the pass (for an item of a multi-output
            op, the op's node: ``item`` says which).
        op: its operator (``aten.add.Tensor``).
        source: the line of the model it was traced from (``file:line in fn: code``),
            or "" when the node carries no stack trace.
        max_abs / max_rel: how far the value of ``compared`` is from its value.
        compared: the node of the pass's output whose value was compared with it.
        became: the nodes of the pass's output that came from it, as ``name (op)``.
        item: which output of a multi-output op (``native_layer_norm[0]``), or None.
    """

    node: str
    op: str
    source: str
    max_abs: float
    max_rel: float
    compared: str
    became: tuple[str, ...]
    item: int | None = None

    def __str__(self) -> str:
        where = self.node if self.item is None else f"{self.node}[{self.item}]"
        text = f"{where} ({self.op}) max_abs={self.max_abs:.3g} max_rel={self.max_rel:.3g}"
        if self.source:
            text += f" at {self.source}"
        return f"{text}; became {', '.join(self.became) or 'nothing'}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {**attrs.asdict(self), "became": list(self.became)}


@attrs.frozen
class Drift:
    """How far one program's outputs are from the expected ones.

    Attributes:
        path: the pass whose output was compared (``"<input>"`` for the baseline).
        step: the fixed-point round.
        max_abs: the largest absolute difference over all outputs.
        max_rel: the largest ``|a - b| / |b|`` over all outputs.
        ok: whether every output is within ``atol + rtol * |expected|``.
        detail: why it is not ok, when the difference is not just numerical
            (shape, dtype or structure mismatch, or the program raised).
        node: for the first drifting pass, the first node whose values part
            (:class:`NodeDrift`), when
            ``NumericsCheck(localize=True)`` found one.
    """

    path: str
    step: int
    max_abs: float
    max_rel: float
    ok: bool
    detail: str = ""
    node: NodeDrift | None = None

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "DRIFT"
        text = f"{self.path}: {verdict} max_abs={self.max_abs:.3g} max_rel={self.max_rel:.3g}"
        return f"{text} ({self.detail})" if self.detail else text


def clone(value: Any) -> Any:
    """Detached copies of the tensors in nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        items = [clone(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [clone(v) for v in value]
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    return value


def _leaves(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """(path, leaf) pairs of nested tuples, lists and dicts, in order."""
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{path}[{k!r}]")]
    return [(path or "output", value)]


def _has_mutating_ops(program: ExportedProgram) -> bool:
    return any(
        n.op == "call_function" and n.is_impure(impure_random=False) for n in program.graph.nodes
    )


def run_program(
    program: ExportedProgram,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    clone_state: str = "auto",
) -> Any:
    """Run ``program`` on copies of the inputs without touching its state tensors.

    Buffers the program mutates are cloned first; with ``clone_state="auto"``
    every state tensor is cloned when the graph holds an in-place or otherwise
    side-effecting op (training-IR programs mutate buffers in place), and
    ``"all"`` always clones. The program's own dicts and tensors stay as they were.
    """
    view = state_view(program, clone_state)
    before = state_versions(program)
    args, kwargs = clone(tuple(args)), clone(dict(kwargs or {}))
    with torch.no_grad():
        out = view.module()(*args, **kwargs)
    check_untouched(program, before)
    return clone(out)


def state_view(program: ExportedProgram, clone_state: str = "auto") -> ExportedProgram:
    """A view of ``program`` (its graph, private dicts) whose state a run may write:
    the buffers it mutates cloned, and every state tensor with ``"all"``, or with
    ``"auto"`` when the graph holds an in-place or side-effecting op."""
    if clone_state not in ("auto", "all"):
        raise ArgumentValueError(f"clone_state must be 'auto' or 'all', got {clone_state!r}")
    view = _program.private_view(program, copy_graph=False)
    clone_all = clone_state == "all" or _has_mutating_ops(program)
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    for d in (view.state_dict, view.constants):
        for key, value in d.items():
            if isinstance(value, torch.Tensor) and (clone_all or key in mutated):
                d[key] = (
                    torch.nn.Parameter(clone(value), requires_grad=value.requires_grad)
                    if isinstance(value, torch.nn.Parameter)
                    else clone(value)
                )
    return view


def private_copy(program: ExportedProgram) -> ExportedProgram:
    """A copy of ``program`` that owns its graph, dicts, state tensors and example
    inputs: whatever a pass or a run does to it, in place, through ``.data`` or by
    editing the graph, reaches nothing of ``program``. Entries that share storage in
    ``program`` (tied weights) share it in the copy, so passes see the same aliasing.

    For the tools that run the user's passes many times (``reduce``, ``bisect``, a
    pass run again to localize a drift): the price is one copy of the state.
    """
    view = _program.private_view(program, copy_graph=True)
    storages: dict[Any, Any] = {}
    with torch.no_grad():
        for d in (view.state_dict, view.constants):
            for key, value in d.items():
                if isinstance(value, torch.Tensor):
                    d[key] = _own_tensor(value, storages)
    if program.example_inputs is not None:
        args, kwargs = program.example_inputs
        view.example_inputs = (clone(tuple(args)), clone(dict(kwargs)))
    return view


def _own_tensor(value: torch.Tensor, storages: dict[Any, Any]) -> torch.Tensor:
    """A copy of ``value`` over a copy of its storage, made once per storage."""
    plain = type(value) in (torch.Tensor, torch.nn.Parameter) and not value.is_quantized
    if not plain or value.layout != torch.strided or value.untyped_storage().data_ptr() == 0:
        copied = clone(value)  # a subclass, a sparse layout, no data: a clone of its own
    else:
        storage = value.untyped_storage()
        key = (storage.data_ptr(), str(value.device))
        if key not in storages:
            storages[key] = storage.clone()
        copied = torch.empty(0, dtype=value.dtype, device=value.device).set_(
            storages[key], value.storage_offset(), value.size(), value.stride()
        )
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(copied, requires_grad=value.requires_grad)
    return copied.requires_grad_(value.requires_grad) if value.requires_grad else copied


def state_versions(program: ExportedProgram) -> dict[tuple[int, str], int | None]:
    return {
        (i, k): _tensors.tensor_version(v)
        for i, d in enumerate((program.state_dict, program.constants))
        for k, v in d.items()
    }


def check_untouched(program: ExportedProgram, before: dict[tuple[int, str], int | None]) -> None:
    """Raise ProgramError when a run wrote into ``program``'s own state tensors
    (their write counters moved since ``before``); a safety net behind
    :func:`state_view`, whose cloning should make it unreachable."""
    touched = [key for key, v in state_versions(program).items() if before.get(key) != v]
    if touched:
        names = [k for _, k in touched]
        raise ProgramError(f"running the program wrote into its state tensors {names}")


def compare_outputs(
    actual: Any, expected: Any, *, rtol: float, atol: float, path: str = "", step: int = 0
) -> Drift:
    """Compare two outputs (tensors in nested tuples, lists, dicts) leaf by leaf."""
    a_leaves, e_leaves = _leaves(actual), _leaves(expected)
    if [p for p, _ in a_leaves] != [p for p, _ in e_leaves]:
        return Drift(path, step, math.inf, math.inf, False, "output structure differs")
    max_abs = max_rel = 0.0
    ok = True
    for (where, a), (_, e) in zip(a_leaves, e_leaves, strict=True):
        if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)):
            if a != e:
                return Drift(path, step, math.inf, math.inf, False, f"{where}: {a!r} != {e!r}")
            continue
        if a.shape != e.shape:
            detail = f"{where}: shape {tuple(a.shape)} != {tuple(e.shape)}"
            return Drift(path, step, math.inf, math.inf, False, detail)
        if a.numel() == 0:
            continue
        a64, e64 = a.detach().to(torch.float64), e.detach().to(torch.float64)
        diff = (a64 - e64).abs()
        both_nan = a64.isnan() & e64.isnan()
        diff = torch.where(both_nan, torch.zeros_like(diff), diff)
        diff = torch.where(diff.isnan(), torch.full_like(diff, math.inf), diff)
        max_abs = max(max_abs, float(diff.max()))
        rel = diff / e64.abs().clamp_min(torch.finfo(torch.float64).tiny)
        max_rel = max(max_rel, float(rel.max()))
        ok &= bool(torch.isclose(a64, e64, rtol=rtol, atol=atol, equal_nan=True).all())
    return Drift(path, step, max_abs, max_rel, ok)
