"""Real CNN (and hybrid) architectures from torchvision and timm, as exported programs.

Random weights (nothing is downloaded), eval mode, small inputs; each architecture is
exported static and with a dynamic batch dimension. ``programs()`` yields
``(label, build)`` pairs, ``build()`` exporting the program when called, so that a
caller decides what to pay for::

    for label, build in vision_models.programs():
        ep = build()

torchvision wheels built for CUDA cannot load their C++ ops beside a CPU torch, and
then ``import torchvision`` fails (``operator torchvision::nms does not exist``): its
fake-kernel registrations need the ``nms`` and ``qnms`` schemas. :func:`torchvision`
defines those two schemas first when they are missing (no kernel: the corpus never
calls them), and timm, which imports torchvision, is imported through it as well.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import torch
from torch import nn
from torch.export import Dim, ExportedProgram

__all__ = [
    "BATCH",
    "CORPUS",
    "VisionCase",
    "available",
    "build",
    "export",
    "inputs",
    "make_torchvision_importable",
    "programs",
    "timed_export",
    "timm",
    "torchvision",
]

# The batch of the example input, and the dynamic batch dimension's range.
BATCH = 2
BATCH_DIM = Dim("batch", min=1, max=64)

# Schemas torchvision's _meta_registrations.py registers fake kernels for with
# torch.library.register_fake, which fails when the operator is not defined. The
# other ops it registers (roi_align, ...) go through its own helper, which skips them
# when its C++ extension did not load.
_TORCHVISION_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARIES: list[Any] = []  # kept alive: a Library's definitions go with it


def _has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _load_torchvision_extension() -> None:
    """Load torchvision's C++ ops as its own import would, without importing the
    package (whose import is what fails); a library that cannot load is left alone."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    # _C_stable: torchvision 0.29 and later, built on torch's stable ABI.
    for folder in spec.submodule_search_locations:
        for name in ("_C", "_C_stable"):
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                path = Path(folder) / f"{name}{suffix}"
                if path.is_file():
                    with contextlib.suppress(OSError):
                        torch.ops.load_library(str(path))
                    return


def make_torchvision_importable() -> None:
    """Make ``import torchvision`` work (and so transformers' and timm's imports of it)
    where its C++ extension does not load beside this torch: define the two schemas
    its fake kernels need. Nothing when torchvision is not installed."""
    if importlib.util.find_spec("torchvision") is None:
        return
    if all(_has_op("torchvision", name) for name in _TORCHVISION_SCHEMAS):
        return
    _load_torchvision_extension()  # where it loads, it defines the ops itself
    missing = [name for name in _TORCHVISION_SCHEMAS if not _has_op("torchvision", name)]
    if missing:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            lib.define(_TORCHVISION_SCHEMAS[name])
        _LIBRARIES.append(lib)


def torchvision() -> ModuleType:
    """``torchvision``, imported even where its C++ extension does not load."""
    make_torchvision_importable()
    import torchvision as tv

    return tv


def timm() -> ModuleType:
    """``timm`` (which imports torchvision), imported the same way."""
    make_torchvision_importable()
    import timm as t

    return t


@attrs.frozen
class VisionCase:
    """One architecture: its library, how to build it, and its input size."""

    library: str  # "torchvision" or "timm"
    make: Callable[[], nn.Module]
    size: int = 64  # the input is BATCH x 3 x size x size
    # Run the module once before exporting it, as a user checking its output would:
    # timm's LeViT then holds its attention biases in a cache attribute, which export
    # lifts as constants (without the warm-up it has none).
    warm: bool = False


def _tv(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        tv = torchvision()
        return tv.models.get_model(name, weights=None, **kwargs)  # type: ignore[no-any-return]

    return make


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        return timm().create_model(name, pretrained=False, **kwargs)  # type: ignore[no-any-return]

    return make


CORPUS: dict[str, VisionCase] = {
    # torchvision classification
    "tv_resnet18": VisionCase("torchvision", _tv("resnet18")),
    "tv_resnet50": VisionCase("torchvision", _tv("resnet50")),
    "tv_mobilenet_v2": VisionCase("torchvision", _tv("mobilenet_v2")),
    "tv_mobilenet_v3_small": VisionCase("torchvision", _tv("mobilenet_v3_small")),
    "tv_efficientnet_b0": VisionCase("torchvision", _tv("efficientnet_b0")),
    "tv_convnext_tiny": VisionCase("torchvision", _tv("convnext_tiny")),
    "tv_regnet_x_400mf": VisionCase("torchvision", _tv("regnet_x_400mf")),
    "tv_squeezenet1_0": VisionCase("torchvision", _tv("squeezenet1_0")),
    "tv_densenet121": VisionCase("torchvision", _tv("densenet121")),
    "tv_shufflenet_v2_x0_5": VisionCase("torchvision", _tv("shufflenet_v2_x0_5")),
    "tv_googlenet": VisionCase("torchvision", _tv("googlenet", aux_logits=False)),
    "tv_mnasnet0_5": VisionCase("torchvision", _tv("mnasnet0_5")),
    "tv_swin_t": VisionCase("torchvision", _tv("swin_t")),
    "tv_swin_v2_t": VisionCase("torchvision", _tv("swin_v2_t")),
    # torchvision segmentation (the output is a dict {"out": ...})
    "tv_deeplabv3_mobilenet_v3_large": VisionCase(
        "torchvision", _tv("deeplabv3_mobilenet_v3_large", weights_backbone=None)
    ),
    "tv_lraspp_mobilenet_v3_large": VisionCase(
        "torchvision", _tv("lraspp_mobilenet_v3_large", weights_backbone=None)
    ),
    "tv_fcn_resnet50": VisionCase("torchvision", _tv("fcn_resnet50", weights_backbone=None)),
    # timm
    "timm_resnet18": VisionCase("timm", _timm("resnet18")),
    "timm_efficientnet_b0": VisionCase("timm", _timm("efficientnet_b0")),
    "timm_efficientnet_lite0": VisionCase("timm", _timm("efficientnet_lite0")),
    "timm_mobilevit_xxs": VisionCase("timm", _timm("mobilevit_xxs")),
    "timm_coatnet_nano_rw_224": VisionCase("timm", _timm("coatnet_nano_rw_224", img_size=64)),
    "timm_regnetx_002": VisionCase("timm", _timm("regnetx_002")),
    "timm_ghostnet_100": VisionCase("timm", _timm("ghostnet_100")),
    "timm_mixnet_s": VisionCase("timm", _timm("mixnet_s")),
    "timm_gcresnet33ts": VisionCase("timm", _timm("gcresnet33ts")),
    "timm_skresnet18": VisionCase("timm", _timm("skresnet18")),
    # autocast turned off around its attention: a region the retrace inlines
    "timm_efficientvit_b0": VisionCase("timm", _timm("efficientvit_b0")),
    "timm_swin_tiny": VisionCase(
        "timm", _timm("swin_tiny_patch4_window7_224", img_size=112), size=112
    ),
    "timm_levit_128s": VisionCase("timm", _timm("levit_128s", img_size=64)),
    "timm_levit_128s_warm": VisionCase("timm", _timm("levit_128s", img_size=64), warm=True),
}


def available(name: str) -> bool:
    """Whether the library ``name`` needs is installed."""
    return importlib.util.find_spec(CORPUS[name].library) is not None


def build(name: str, seed: int = 0) -> nn.Module:
    """The architecture with seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    return CORPUS[name].make().eval()


def inputs(name: str, batch: int = BATCH, seed: int = 0) -> tuple[torch.Tensor]:
    size = CORPUS[name].size
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, size, size, generator=generator),)


def _ready(name: str, seed: int) -> tuple[nn.Module, tuple[torch.Tensor]]:
    module = build(name, seed)
    args = inputs(name)
    if CORPUS[name].warm:
        with torch.no_grad():
            module(*args)
    return module, args


def export(
    name: str, *, dynamic: bool = False, seed: int = 0
) -> tuple[nn.Module, ExportedProgram, tuple[torch.Tensor]]:
    """Export a corpus entry (with a dynamic batch when asked); returns module,
    program and the example inputs."""
    module, args = _ready(name, seed)
    shapes = ({0: BATCH_DIM},) if dynamic else None
    ep = torch.export.export(module, args, dynamic_shapes=shapes)
    return module, ep, args


def timed_export(name: str, *, dynamic: bool = False) -> tuple[ExportedProgram, float]:
    """The program and the seconds ``torch.export.export`` took (building the module,
    its random weights and a warm-up call not counted)."""
    module, args = _ready(name, 0)
    shapes = ({0: BATCH_DIM},) if dynamic else None
    began = time.perf_counter()
    ep = torch.export.export(module, args, dynamic_shapes=shapes)
    return ep, time.perf_counter() - began


def label(name: str, dynamic: bool) -> str:
    return f"{name}-{'dynamic' if dynamic else 'static'}"


def programs(
    names: Any = None, dynamic: tuple[bool, ...] = (False, True)
) -> Iterator[tuple[str, Callable[[], ExportedProgram]]]:
    """``(label, build)`` for each corpus entry (installed libraries only) and each
    of ``dynamic``; ``build()`` exports the program."""
    for name in CORPUS if names is None else names:
        if not available(name):
            continue
        for dyn in dynamic:

            def make(name: str = name, dyn: bool = dyn) -> ExportedProgram:
                return export(name, dynamic=dyn)[1]

            yield label(name, dyn), make
