"""Built-in passes, one per module, and ready-made pipelines in ``presets``.

:data:`BUILTINS` is the one place a built-in is registered: its registry name and its
factory. The pass itself declares the rest once: its ``name``, its options (its attrs
fields or keyword parameters) and its docs (the docstring's first paragraph is its
line in ``epass passes``). ``python -m epass.passes`` writes what the registry reads
of them before torch loads (``epass/_catalog.json``); a test fails while it is stale.
"""

from collections.abc import Callable
from typing import Any

from epass.passes import presets
from epass.passes.cast_dtype import CastDtype
from epass.passes.constant_fold import ConstantFold, ConstantFoldResult
from epass.passes.cse import CSE
from epass.passes.dce import DeadCodeElimination
from epass.passes.decompose import Decompose
from epass.passes.fuse_conv_bn import FuseConvBN
from epass.passes.lift_constants import LiftConstants, lift_constants
from epass.passes.remove_assertions import RemoveAssertions, RemoveAssertionsResult
from epass.passes.replace_ops import ReplaceOps

__all__ = [
    "BUILTINS",
    "CSE",
    "CastDtype",
    "ConstantFold",
    "ConstantFoldResult",
    "DeadCodeElimination",
    "Decompose",
    "FuseConvBN",
    "LiftConstants",
    "RemoveAssertions",
    "RemoveAssertionsResult",
    "ReplaceOps",
    "lift_constants",
    "presets",
]

# Registry name -> factory (a class, or a function making a pass or a manager).
BUILTINS: dict[str, Callable[..., Any]] = {
    "decompose": Decompose,
    "lift-constants": LiftConstants,
    "fold-constants": ConstantFold,
    "dce": DeadCodeElimination,
    "cse": CSE,
    "remove-asserts": RemoveAssertions,
    "replace-ops": ReplaceOps,
    "cast-dtype": CastDtype,
    "fuse-conv-bn": FuseConvBN,
    "lower": presets.lower,
    "cleanup": presets.cleanup,
}
