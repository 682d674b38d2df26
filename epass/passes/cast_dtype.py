"""CastDtype: convert floating state to bf16 or fp16 and compute in that dtype."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from epass.passes import _graph
from epass.protocol import PassResult

__all__ = ["CastDtype"]

_TARGETS = (torch.bfloat16, torch.float16)
_TO_COPY = torch.ops.aten._to_copy.default


def _castable(value: Any, dtype: torch.dtype) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype


@attrs.define(eq=False)
class CastDtype:
    """Convert floating parameters, buffers and constants to ``dtype`` (bf16 or
    fp16), so that the program computes in that dtype.

    Graph: every floating dtype argument of an operator (``dtype=torch.float32``,
    also in ``_assert_tensor_metadata``) becomes ``dtype``. With ``keep_io`` (the
    default) floating user inputs are cast on entry and floating user outputs are
    cast back to their original dtype, so callers see the same signature;
    without it the program takes and returns ``dtype``. Fake values are
    recomputed for every node. Buffer mutations write the cast buffer.

    State: the canonical state-changing pass. It **changes** every floating
    entry the signature references (new tensors; parameters stay
    ``nn.Parameter`` with the same ``requires_grad``; tied entries stay tied)
    and adds or removes nothing. With the default policy the user's program,
    dicts and tensors are untouched: the output gets its own dicts in which
    every entry the pass did not cast is still the original object. Integer
    entries (``num_batches_tracked``) are never touched. Works on training-IR
    and decomposed programs.

    Args:
        dtype: ``torch.bfloat16`` (default) or ``torch.float16``.
        keep_io: keep user inputs and outputs in their original dtypes.

    Example::

        out = PassManager([CastDtype(torch.bfloat16)]).run(ep)
        assert out.state_dict is not ep.state_dict
    """

    name: ClassVar[str] = "cast-dtype"
    changes_input: ClassVar[bool] = False

    dtype: torch.dtype = attrs.field(
        default=torch.bfloat16, validator=attrs.validators.in_(_TARGETS)
    )
    keep_io: bool = True

    def __call__(self, ep: ExportedProgram) -> PassResult:
        sig = ep.graph_signature
        state = _graph.state_values(ep)
        cast_names = {n for n, v in state.items() if _castable(v, self.dtype)}
        user_inputs = set(sig.user_inputs)
        gm0 = ep.graph_module
        float_inputs = {
            n.name
            for n in _graph.placeholders(gm0)
            if n.name in user_inputs and _castable(n.meta.get("val"), self.dtype)
        }
        if not cast_names and not float_inputs:
            return PassResult(ep, False)
        gm = _graph.copy_graph(ep)
        state_dict, constants = self._cast_state(ep, cast_names)
        mode = _graph.fake_mode(gm)
        nodes = list(gm.graph.nodes)
        for node in nodes:
            if node.op == "call_function":
                node.args = torch.fx.node.map_aggregate(node.args, self._dtype_arg)
                node.kwargs = torch.fx.node.map_aggregate(node.kwargs, self._dtype_arg)
        targets = {n: s.target for n, s in _graph.specs_by_name(sig).items()}
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
                    self._cast_after(gm, node, self.dtype)
                elif mode is not None:
                    with mode:
                        node.meta["val"] = node.meta["val"].to(self.dtype)
        if self.keep_io:
            self._cast_outputs(gm, sig)
        _graph.fill_meta(gm, force=True)
        program = _graph.build_program(ep, gm, state_dict=state_dict, constants=constants)
        return PassResult(program, True)

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
    def _cast_after(gm: torch.fx.GraphModule, node: torch.fx.Node, dtype: torch.dtype) -> None:
        users = list(node.users)
        first = next(n for n in gm.graph.nodes if n.op != "placeholder")
        with gm.graph.inserting_before(first):
            cast = gm.graph.call_function(_TO_COPY, (node,), {"dtype": dtype})
        for user in users:
            user.replace_input_with(node, cast)

    def _cast_outputs(self, gm: torch.fx.GraphModule, sig: Any) -> None:
        output = gm.graph.output_node()
        outs = list(output.args[0])
        for i, (spec, node) in enumerate(zip(sig.output_specs, outs, strict=True)):
            if spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.USER_INPUT_MUTATION):
                continue
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if val is None or not _castable(val, self.dtype):
                continue
            with gm.graph.inserting_before(output):
                outs[i] = gm.graph.call_function(_TO_COPY, (node,), {"dtype": val.dtype})
        output.args = (type(output.args[0])(outs),)
