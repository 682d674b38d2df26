"""Ready-made pipelines built from the built-in passes."""

from __future__ import annotations

from epass.manager import PassManager
from epass.passes.constant_fold import ConstantFold
from epass.passes.cse import CSE
from epass.passes.dce import DeadCodeElimination
from epass.passes.decompose import Decompose
from epass.passes.lift_constants import LiftConstants
from epass.passes.remove_assertions import RemoveAssertions

__all__ = ["cleanup", "lower"]


def lower(**options: object) -> PassManager:
    """Preset: decompose, remove-asserts, fold-constants, cse, dce.

    The default lowering pipeline, a manager named ``"lower"``: Decompose ->
    RemoveAssertions -> ConstantFold -> CSE -> DCE. The result is a core-ATen
    program without runtime assertions in which every computation on state alone is
    a pre-computed constant (a chain that only re-views a parameter, such as the
    ``permute`` of each linear weight, stays, as :class:`ConstantFold` leaves it by
    default), duplicates are merged and unused inputs are gone.
    State: the output shares the user's ``state_dict``; when something was folded
    it holds a ``constants`` dict of its own (the user's tensor objects plus the
    folded values), and the user's dicts gain nothing. ``options`` go to
    :class:`~epass.PassManager` (``instruments``, ``linker``, ``verify``...); they
    are Python keywords only, and pipeline text gives a preset no options.

    Example::

        result = presets.lower()(ep)
        print(result.summary())
    """
    passes = [Decompose(), RemoveAssertions(), ConstantFold(), CSE(), DeadCodeElimination()]
    return PassManager(passes, name="lower", **options)  # type: ignore[arg-type]


def cleanup(**options: object) -> PassManager:
    """Preset: clean a program up without lowering it.

    A graph tidy-up after custom rewrites, a manager named ``"cleanup"``:
    LiftConstants -> ConstantFold -> CSE -> DCE, repeated until nothing changes
    (at most 3 rounds). It keeps the program's dialect (no decomposition) and its
    assertions. State: the output shares the user's ``state_dict``; lifted and
    folded constants go into a ``constants`` dict of its own, and the user's
    dicts gain nothing. ``options`` go to :class:`~epass.PassManager`, from
    Python only (pipeline text gives a preset no options).

    Example::

        out = presets.cleanup().run(ep)
    """
    options.setdefault("steps", 3)
    passes = [LiftConstants(), ConstantFold(), CSE(), DeadCodeElimination()]
    return PassManager(passes, name="cleanup", **options)  # type: ignore[arg-type]
