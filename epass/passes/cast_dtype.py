"""CastDtype: convert floating state to bf16 or fp16 and compute in that dtype."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from epass import _graph, _writes
from epass.errors import ArgumentValueError
from epass.options import checked
from epass.protocol import PassResult

__all__ = ["CastDtype"]

_TARGETS = (torch.bfloat16, torch.float16)
_TO_COPY = torch.ops.aten._to_copy.default
_COPY = torch.ops.aten.copy_.default


def _is_cast(node: torch.fx.Node, dtype: torch.dtype) -> bool:
    return node.target is _TO_COPY and node.kwargs.get("dtype") == dtype and len(node.args) == 1


def _castable(value: Any, dtype: torch.dtype) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype


@checked
@attrs.define(eq=False)
class CastDtype:
    """Convert floating parameters, buffers and constants to ``dtype`` (bf16 or
    fp16), so that the program computes in that dtype.

    Graph: every floating dtype argument of an operator (``dtype=torch.float32``,
    also in ``_assert_tensor_metadata``) becomes ``dtype``. With ``keep_io`` (the
    default) floating user inputs are cast on entry and floating user outputs are
    cast back to their original dtype, so callers see the same signature;
    without it the program takes and returns ``dtype``. Fake values are
    recomputed for every node. Buffer mutations write the cast buffer; in-place
    writes to a cast user input (training IR) are copied back into the caller's
    tensor. A second run on a cast program changes nothing (``modified=False``).

    State: the canonical state-changing pass. It **changes** every floating
    entry the signature references (new tensors; parameters stay
    ``nn.Parameter`` with the same ``requires_grad``; tied entries stay tied)
    and adds or removes nothing. With the default policy the user's program,
    dicts and tensors are untouched: the output gets its own dicts in which
    every entry the pass did not cast is still the original object. Integer
    entries (``num_batches_tracked``) are never touched. Works on training-IR
    and decomposed programs; programs with control-flow subgraphs (``torch.cond``)
    are refused with a ValueError.

    Args:
        dtype: ``torch.bfloat16`` (default) or ``torch.float16``.
        keep_io: keep user inputs and outputs in their original dtypes.

    Example::

        out = PassManager([CastDtype(torch.bfloat16)]).run(ep)
        assert out.state_dict is not ep.state_dict
    """

    name: ClassVar[str] = "cast-dtype"
    changes_input: ClassVar[bool] = False
    _takes_lease: ClassVar[bool] = True

    dtype: torch.dtype = attrs.field(
        default=torch.bfloat16, validator=attrs.validators.in_(_TARGETS)
    )
    keep_io: bool = True

    def __call__(self, ep: ExportedProgram) -> PassResult:
        subgraphs = [
            name
            for name, module in ep.graph_module.named_children()
            if isinstance(module, torch.fx.GraphModule)
        ]
        if subgraphs:
            raise ArgumentValueError(
                "cast-dtype does not convert programs with control-flow subgraphs "
                f"(torch.cond, map, while_loop: {', '.join(subgraphs)}); their "
                "operators would keep computing in the old dtype"
            )
        sig = ep.graph_signature
        state = _graph.state_values(ep)
        cast_names = {n for n, v in state.items() if _castable(v, self.dtype)}
        user_inputs = set(sig.user_inputs)
        gm0 = ep.graph_module
        float_inputs = {
            n.name
            for n in _graph.placeholders(gm0)
            if n.name in user_inputs
            and _castable(n.meta.get("val"), self.dtype)
            and not (self.keep_io and self._cast_on_entry(n))
        }
        cast_backs = self._cast_backs(gm0) if self.keep_io else set()
        if not cast_names and not float_inputs and not self._has_dtype_args(gm0, cast_backs):
            return PassResult(ep, False)
        gm = _graph.editable_graph(ep)
        state_dict, constants = self._cast_state(ep, cast_names)
        mode = _graph.fake_mode(gm)
        cast_backs = {n.name for n in cast_backs}
        nodes = list(gm.graph.nodes)
        for node in nodes:
            if node.op == "call_function" and node.name not in cast_backs:
                node.args = torch.fx.node.map_aggregate(node.args, self._dtype_arg)
                node.kwargs = torch.fx.node.map_aggregate(node.kwargs, self._dtype_arg)
        targets = {n: s.target for n, s in _graph.specs_by_name(sig).items()}
        entry_casts: list[tuple[torch.fx.Node, torch.fx.Node]] = []
        for node in list(_graph.placeholders(gm)):
            name = _graph.original_name(node)
            if name in cast_names:
                key = str(targets[name])
                value = state_dict[key] if key in state_dict else constants[key]
                val = _graph.fake_value(gm, value)
                if val is not None:
                    node.meta["val"] = val
            elif name in float_inputs:
                if self.keep_io:
                    entry_casts.append((node, self._cast_after(gm, node, self.dtype)))
                elif mode is not None:
                    with _graph.FAKE_LOCK, mode:
                        node.meta["val"] = node.meta["val"].to(self.dtype)
        if self.keep_io:
            self._write_back(gm, entry_casts)
            self._cast_outputs(gm, sig, cast_backs)
        _graph.fill_meta(gm, force=True)
        program = _graph.build_program(ep, gm, state_dict=state_dict, constants=constants)
        return PassResult(program, True)

    def _cast_on_entry(self, node: torch.fx.Node) -> bool:
        """Whether a user input is already cast on entry (by an earlier run)."""
        users = list(node.users)
        return any(_is_cast(u, self.dtype) for u in users) and all(
            _is_cast(u, self.dtype) or (u.target is _COPY and u.args[0] is node) for u in users
        )

    def _cast_backs(self, gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
        """Output casts from ``dtype`` back to another floating dtype (an earlier run's)."""
        out = set()
        for node in _graph.leaves(gm.graph.output_node().args[0]):
            if not (isinstance(node, torch.fx.Node) and node.target is _TO_COPY):
                continue
            source = node.args[0].meta.get("val") if node.args else None
            target = node.kwargs.get("dtype")
            if (
                isinstance(source, torch.Tensor)
                and source.dtype == self.dtype
                and isinstance(target, torch.dtype)
                and target.is_floating_point
            ):
                out.add(node)
        return out

    def _has_dtype_args(self, gm: torch.fx.GraphModule, skip: set[torch.fx.Node]) -> bool:
        found = False

        def check(value: Any) -> Any:
            nonlocal found
            found |= self._dtype_arg(value) is not value
            return value

        for node in gm.graph.nodes:
            if node.op == "call_function" and node not in skip:
                torch.fx.node.map_aggregate((node.args, node.kwargs), check)
        return found

    def _dtype_arg(self, value: Any) -> Any:
        if isinstance(value, torch.dtype) and value.is_floating_point and value != self.dtype:
            return self.dtype
        return value

    def _cast_state(
        self, ep: ExportedProgram, names: set[str]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        state_dict, constants = dict(ep.state_dict), dict(ep.constants)
        cast: dict[int, torch.Tensor] = {}  # by id(original): tied entries stay tied
        for spec in ep.graph_signature.input_specs:
            if getattr(spec.arg, "name", None) not in names or spec.target is None:
                continue
            store = state_dict if spec.target in state_dict else constants
            old = store[spec.target]
            new = cast.get(id(old))
            if new is None:
                with torch.no_grad():
                    data = old.detach().to(self.dtype)
                if isinstance(old, torch.nn.Parameter):
                    data = torch.nn.Parameter(data, requires_grad=old.requires_grad)
                new = cast[id(old)] = data
            store[spec.target] = new
        return state_dict, constants

    @staticmethod
    def _cast_after(
        gm: torch.fx.GraphModule, node: torch.fx.Node, dtype: torch.dtype
    ) -> torch.fx.Node:
        users = list(node.users)
        first = next(n for n in gm.graph.nodes if n.op != "placeholder")
        with gm.graph.inserting_before(first):
            cast = gm.graph.call_function(_TO_COPY, (node,), {"dtype": dtype})
        for user in users:
            user.replace_input_with(node, cast)
        return cast

    @staticmethod
    def _write_back(
        gm: torch.fx.GraphModule, casts: list[tuple[torch.fx.Node, torch.fx.Node]]
    ) -> None:
        """Copy in-place writes to a cast input back into the caller's tensor (a
        training-IR graph mutates inputs with ``mul_`` and the like, which now land
        on the private cast)."""
        if not casts:
            return
        mutated = _writes.mutated_nodes(gm)
        output = gm.graph.output_node()
        for node, cast in casts:
            if cast in mutated:
                with gm.graph.inserting_before(output):
                    gm.graph.call_function(_COPY, (node, cast))

    def _cast_outputs(self, gm: torch.fx.GraphModule, sig: Any, skip: set[str]) -> None:
        output = gm.graph.output_node()
        outs = list(output.args[0])
        for i, (spec, node) in enumerate(zip(sig.output_specs, outs, strict=True)):
            if spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.USER_INPUT_MUTATION):
                continue
            if isinstance(node, torch.fx.Node) and node.name in skip:
                continue
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if val is None or not _castable(val, self.dtype):
                continue
            with gm.graph.inserting_before(output):
                outs[i] = gm.graph.call_function(_TO_COPY, (node,), {"dtype": val.dtype})
        output.args = (type(output.args[0])(outs),)
