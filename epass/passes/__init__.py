"""Built-in passes, one per module, and ready-made pipelines in ``presets``."""

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
