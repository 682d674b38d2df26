"""FuseConvBN: fold eval-mode BatchNorm into the preceding convolution."""

from __future__ import annotations

import operator
from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec

from epass import _graph, _operators, _writes
from epass.options import checked
from epass.protocol import PassResult, RewriteCounter

__all__ = ["FuseConvBN", "FuseConvBNResult"]

aten = torch.ops.aten
_CONVS = frozenset({"aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution"})


@attrs.frozen
class _Match:
    conv: str  # node names
    bn: str
    weight: str  # placeholder names (bias/bn entries may be None)
    bias: str | None
    gamma: str | None
    beta: str | None
    mean: str
    var: str
    eps: float


def _schema_name(node: torch.fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    schema = _operators.op_schema(node.target)
    return None if schema is None else str(schema.name)


def _arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def _bn_inputs(bn: torch.fx.Node) -> tuple[Any, ...] | None:
    """(input, weight, bias, mean, var, eps) of an eval-mode BatchNorm node, else None."""
    name = _schema_name(bn)
    if name == "aten::batch_norm":
        if _arg(bn, 5, "training") is not False:
            return None
        return (*bn.args[:5], _arg(bn, 7, "eps"))
    if name == "aten::_native_batch_norm_legit_no_training":
        # Only the normalized output (item 0) may be used.
        if any(u.target is not operator.getitem or u.args[1] != 0 for u in bn.users):
            return None
        return (*bn.args[:5], _arg(bn, 6, "eps"))
    return None


@attrs.frozen
class FuseConvBNResult(PassResult):
    """A :class:`PassResult` with the fusion count in ``notes``
    (:class:`~epass.protocol.RewriteCounter`)."""

    notes: dict[str, Any] = attrs.field(factory=dict)


@checked
@attrs.define(eq=False)
class FuseConvBN:
    """Fold eval-mode BatchNorm into the convolution that feeds it.

    Matches ``conv1d/2d/3d -> batch_norm(training=False)`` (training IR) and
    ``convolution -> _native_batch_norm_legit_no_training -> getitem 0``
    (decomposed), when the convolution's only user is the BatchNorm, it is not
    transposed, and its weight and bias and the BatchNorm's weight, bias and
    running statistics are all parameters, buffers or constants the program does
    not mutate. The new weight is ``w * g / sqrt(var + eps)`` per output channel
    and the new bias ``(b - mean) * g / sqrt(var + eps) + beta``, computed in
    float32 (float64 for a float64 weight) and stored in the weight's dtype.

    Graph: the BatchNorm (and its ``getitem``) disappears; the convolution reads
    two new constant inputs. State: **adds** two ``constants`` entries per fused
    pair (plain tensors, like every value derived from state), named after the
    convolution's weight (``conv1.weight_fused``, ``conv1.bias_fused``); the conv
    and BatchNorm entries that lost their last user **leave the signature** and
    the output's dicts (the user's dicts keep them, listed as removed in the link
    report). No parameter is added or changed, so the output's ``state_dict`` is
    the user's; its ``constants`` is a dict of its own holding the user's
    constants and the fused values. Works on training-IR and decomposed programs.

    Each fused pair is one rewrite (:class:`~epass.protocol.RewriteCounter`, named
    by its BatchNorm node): ``max_rewrites`` fuses only the first N, in graph order.

    Example::

        out = PassManager([FuseConvBN()]).run(ep)
    """

    name: ClassVar[str] = "fuse-conv-bn"
    changes_input: ClassVar[bool] = False
    _takes_lease: ClassVar[bool] = True

    max_rewrites: int | None = None

    def with_max_rewrites(self, limit: int | None) -> FuseConvBN:
        """This pass, fusing only the first ``limit`` pairs it would fuse."""
        return attrs.evolve(self, max_rewrites=limit)

    def __call__(self, ep: ExportedProgram) -> FuseConvBNResult:
        counter = RewriteCounter(self.max_rewrites)
        targets = {n.name: n.target for n in ep.graph.nodes}
        matches = [m for m in self._matches(ep) if counter.allow(targets[m.bn], m.bn)]
        if not matches:
            return FuseConvBNResult(ep, False, notes=counter.notes)
        gm = _graph.editable_graph(ep)
        nodes = {n.name: n for n in gm.graph.nodes}
        state = _graph.state_values(ep)
        kinds = _graph.input_kinds(ep)
        targets = {n: s.target for n, s in _graph.specs_by_name(ep.graph_signature).items()}
        constants = dict(ep.constants)
        new_specs: dict[str, InputSpec] = {}
        involved: set[str] = set()
        for m in matches:
            weight, bias = _fuse(m, state)
            base = str(targets[m.weight])
            prefix = base[: -len("weight")] if base.endswith("weight") else base + "_"
            params = []
            for stem, value in (("weight", weight), ("bias", bias)):
                key = _graph.unique_key(f"{prefix}{stem}_fused", ep.state_dict, constants)
                ph = _graph.new_state_placeholder(
                    gm, kinds, "c_" + key.replace(".", "_"), value, InputKind.CONSTANT_TENSOR
                )
                constants[key] = value
                new_specs[ph.name] = _graph.constant_spec(ph.name, key)
                params.append(ph)
            conv, bn = nodes[m.conv], nodes[m.bn]
            args = list(conv.args)
            args[1] = params[0]
            if len(args) > 2:
                args[2] = params[1]
            else:
                args.append(params[1])
            conv.args = tuple(args)
            conv.kwargs = {k: v for k, v in conv.kwargs.items() if k != "bias"}
            for user in list(bn.users):
                if user.target is operator.getitem:
                    user.replace_all_uses_with(conv)
                    gm.graph.erase_node(user)
            bn.replace_all_uses_with(conv)
            gm.graph.erase_node(bn)
            involved.update(
                n for n in (m.weight, m.bias, m.gamma, m.beta, m.mean, m.var) if n is not None
            )
        _graph.remove_unused_state_placeholders(gm, ep.graph_signature, only=involved)
        program = _graph.build_program(ep, gm, new_specs=new_specs, constants=constants)
        return FuseConvBNResult(program, True, notes=counter.notes)

    @staticmethod
    def _matches(ep: ExportedProgram) -> list[_Match]:
        state = _graph.state_values(ep)
        mutated = _writes.mutated_nodes(ep.graph_module, ep.graph_signature)

        def entry(value: Any, optional: bool) -> str | bool | None:
            """Placeholder name of an unmutated state tensor; None if absent and
            allowed; False when it does not qualify."""
            if value is None:
                return None if optional else False
            if not isinstance(value, torch.fx.Node) or value in mutated:
                return False
            return value.name if isinstance(state.get(value.name), torch.Tensor) else False

        matches = []
        for bn in ep.graph.nodes:
            inputs = _bn_inputs(bn)
            if inputs is None:
                continue
            conv, gamma, beta, mean, var, eps = inputs
            if not isinstance(conv, torch.fx.Node) or _schema_name(conv) not in _CONVS:
                continue
            if len(conv.users) != 1:
                continue
            if _schema_name(conv) == "aten::convolution" and _arg(conv, 6, "transposed"):
                continue
            names = (
                entry(_arg(conv, 1, "weight"), False),
                entry(_arg(conv, 2, "bias"), True),
                entry(gamma, True),
                entry(beta, True),
                entry(mean, False),
                entry(var, False),
            )
            if any(n is False for n in names):
                continue
            w, b, g, bt, mu, v = names
            matches.append(_Match(conv.name, bn.name, w, b, g, bt, mu, v, float(eps)))  # type: ignore[arg-type]
        return matches


def _fuse(m: _Match, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        weight = state[m.weight].detach()
        # float32 at least (bf16/fp16 weights), float64 kept for float64 models
        dtype = torch.promote_types(weight.dtype, torch.float32)
        var = state[m.var].detach().to(dtype)
        mean = state[m.mean].detach().to(dtype)
        out = weight.shape[0]
        ones, zeros = torch.ones(out, dtype=dtype), torch.zeros(out, dtype=dtype)
        gamma = state[m.gamma].detach().to(dtype) if m.gamma else ones
        beta = state[m.beta].detach().to(dtype) if m.beta else zeros
        bias = state[m.bias].detach().to(dtype) if m.bias else zeros
        scale = gamma * torch.rsqrt(var + m.eps)
        new_weight = weight.to(dtype) * scale.reshape(-1, *([1] * (weight.dim() - 1)))
        new_bias = (bias - mean) * scale + beta
        return new_weight.to(weight.dtype), new_bias.to(weight.dtype)
