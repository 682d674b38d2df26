"""The signature the retrace gives a program: its inputs in the order and under the
names ``run_decompositions`` gives them, computed from the program without retracing.

The retrace runs ``ep.module()``, whose module tree is built from the lifted inputs'
targets in input order (a module the first time one of its names is seen). It
registers every lifted constant as a buffer of its module, appended after the
module's own buffers, and lifts again: parameters, module by module in pre-order,
then buffers (with those constants), module by module; then the user inputs. The
placeholders are named again in that order by torch's own naming rules.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    CustomObjArgument,
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputSpec,
    SymIntArgument,
    TensorArgument,
)

from epass import _tensors
from epass._decomp.safety import Fallback
from epass._torch import programs

__all__ = ["retrace_inputs", "retrace_signature"]

_LIFTED = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
Module = tuple[str, ...]


def retrace_inputs(ep: ExportedProgram) -> list[tuple[InputSpec, InputSpec]]:
    """The program's input specs in the retrace's order, each with a copy under the
    placeholder name the retrace gives it."""
    specs = ep.graph_signature.input_specs
    if any(s.kind not in (*_LIFTED, InputKind.USER_INPUT) for s in specs):
        raise Fallback("an input that is neither a tensor, a parameter, a buffer nor a constant")
    tree = _module_tree(specs)
    params: dict[Module, list[InputSpec]] = {m: [] for m in tree}
    buffers: dict[Module, list[InputSpec]] = {m: [] for m in tree}
    constants: dict[Module, list[InputSpec]] = {m: [] for m in tree}
    kept = set(ep.state_dict) | set(ep.graph_signature.non_persistent_buffers)
    for spec in specs:
        if spec.kind not in _LIFTED:
            continue
        module = _owner(spec)
        if spec.kind == InputKind.PARAMETER:
            params[module].append(spec)
        elif spec.kind == InputKind.BUFFER or spec.target in kept:
            buffers[module].append(spec)
        else:  # a lifted constant, registered again as a buffer of its module
            constants[module].append(spec)
    order = list(_preorder(tree))
    ordered = [s for m in order for s in params[m]]
    ordered += [s for m in order for s in buffers[m] + constants[m]]
    ordered += [s for s in specs if s.kind not in _LIFTED]
    return list(zip(ordered, _named(ordered), strict=True))


def _owner(spec: InputSpec) -> Module:
    assert spec.target is not None
    return tuple(spec.target.split(".")[:-1])


def _module_tree(specs: list[InputSpec]) -> dict[Module, list[Module]]:
    """Each module's children, in the order the lifted inputs first name them."""
    children: dict[Module, list[Module]] = {(): []}
    for spec in specs:
        if spec.kind not in _LIFTED:
            continue
        path: Module = ()
        for atom in _owner(spec):
            child = (*path, atom)
            if child not in children:
                children[child] = []
                children[path].append(child)
            path = child
    return children


def _preorder(tree: dict[Module, list[Module]], module: Module = ()) -> Any:
    yield module
    for child in tree[module]:
        yield from _preorder(tree, child)


def _named(ordered: list[InputSpec]) -> list[InputSpec]:
    """Copies of ``ordered`` under the names torch's placeholder naming gives them:
    user inputs claim their names first, then each lifted input its prefix and target
    (``p_``, ``b_``, ``c_``), suffixed where a name is taken."""
    from collections import defaultdict

    names: dict[str, str] = {}
    find_available: defaultdict[str, int] = defaultdict(int)
    used: set[str] = set()
    for spec in ordered:
        if spec.kind == InputKind.USER_INPUT:
            programs.rename_without_collisions(
                names, find_available, used, spec.arg.name, spec.arg.name
            )
    for spec in ordered:
        if spec.kind == InputKind.USER_INPUT:
            continue
        assert spec.target is not None
        base = re.sub(r"[^a-zA-Z0-9]", "_", _strip(spec.target).lower())
        prefix = programs.placeholder_prefixes()[spec.kind]
        programs.rename_without_collisions(
            names, find_available, used, spec.arg.name, prefix + base
        )
    renamed = []
    for spec in ordered:
        new = copy.deepcopy(spec)
        new.arg.name = names[spec.arg.name]
        renamed.append(new)
    return renamed


def _strip(name: str) -> str:
    for prefix in ("L__self___", "self_"):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def retrace_signature(
    inputs: list[InputSpec], old: ExportGraphSignature, gm: torch.fx.GraphModule
) -> ExportGraphSignature:
    """The signature of the rewritten graph ``gm``: ``inputs`` (see
    :func:`retrace_inputs`) and ``old``'s outputs, named after ``gm``'s output nodes."""
    outputs = _tensors.tree_leaves(gm.graph.output_node().args[0])
    new_outputs = []
    for spec, node in zip(old.output_specs, outputs, strict=True):
        arg = spec.arg
        if isinstance(arg, TensorArgument):
            arg = TensorArgument(name=node.name)
        elif isinstance(arg, SymIntArgument):
            arg = SymIntArgument(name=node.name)
        elif not isinstance(arg, (ConstantArgument, CustomObjArgument)):
            raise Fallback(f"an output of kind {type(arg).__name__}")
        new_outputs.append(OutputSpec(spec.kind, arg, spec.target))
    return ExportGraphSignature(input_specs=inputs, output_specs=new_outputs)
