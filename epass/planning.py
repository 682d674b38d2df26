"""A pipeline's plan: the passes given to a manager resolved once into pass models,
adjacent passes merged and their order checked; and the models printed back as text.

Names and pipeline text are built into passes by :mod:`epass.building`. A group of
passes (:class:`~epass.building.Nested`) becomes a nested pipeline of the class the
manager hands in as ``pipeline``, and a nested pipeline goes back to the builder as a
:class:`~epass.building.Nested` to be printed: this module sits below the manager
and never imports it.

Example::

    models = plan(["decompose", "dce"], PassManager)
    assert to_text(models, PassManager) == "decompose, dce"
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from epass import building
from epass.protocol import PassModel, adapt, check_ordering

__all__ = ["Pipeline", "coalesce", "made", "model", "plan", "to_text"]

logger = logging.getLogger("epass")


class Pipeline(Protocol):
    """What a group of passes is made into and printed from: the manager's class
    (:class:`~epass.PassManager`), handed in by the manager."""

    name: str
    steps: int

    def __init__(self, passes: Iterable[Any], *, steps: int = ..., name: str = ...) -> None: ...


def model(p: Any, pipeline: type[Pipeline], position: int | None = None) -> PassModel:
    """The model of ``p``; a registered name or pipeline text is built first, and what
    the builder made (:mod:`epass.building`) is made into a pass."""
    if isinstance(p, str):
        p = building.make(p)
    if isinstance(p, building.Made):
        return adapt(p.pass_, position=position, origin=p.origin)
    return adapt(made(p, pipeline), position=position)


def made(p: Any, pipeline: type[Pipeline]) -> Any:
    """``p``, with a :class:`~epass.building.Nested` made into a nested ``pipeline``."""
    if isinstance(p, building.Nested):
        return pipeline(p.items, steps=p.steps, name=p.name)
    if isinstance(p, building.Made):
        return p.pass_
    return p


def plan(passes: Iterable[Any], pipeline: type[Pipeline]) -> tuple[PassModel, ...]:
    """The models of ``passes`` in order, adjacent ones merged (:func:`coalesce`).

    Raises:
        OrderingError: the order breaks a constraint a pass declares.
    """
    models = tuple(coalesce([model(p, pipeline, i) for i, p in enumerate(passes)], pipeline))
    check_ordering(models)
    return models


def coalesce(models: Sequence[PassModel], pipeline: type[Pipeline]) -> list[PassModel]:
    """Merge adjacent passes that offer it, left to right.

    A pass with a ``merge(next_pass)`` method returns one pass doing the work of both,
    or None to keep them apart; each pass decides (and documents) when that is exact.
    """
    out: list[PassModel] = []
    for m in models:
        last = out[-1] if out else None
        merged = last.merge(m.pass_) if last is not None and last.merge is not None else None
        if merged is None:
            out.append(m)
        else:
            logger.debug("coalesced %s into %s", m.name, out[-1].name)
            out[-1] = model(merged, pipeline)
    return out


def _printable(
    models: Iterable[PassModel], pipeline: type[Pipeline]
) -> Iterator[PassModel | building.Nested]:
    """The models as the builder prints them: a nested pipeline that was not made
    from a registered name (such as a preset) as a :class:`~epass.building.Nested`."""
    for m in models:
        p = m.pass_
        if isinstance(p, pipeline) and m.origin is None:
            yield building.Nested(p.name, p.steps, tuple(_printable(m.children, pipeline)))
        else:
            yield m


def to_text(passes: Iterable[Any], pipeline: type[Pipeline]) -> str:
    """Pass objects (or their models) as pipeline text that
    :meth:`PassManager.from_text <epass.PassManager.from_text>` reads back
    (:func:`epass.building.to_text`).

    Raises:
        ValueError: a pass is not registered, or has an option that pipeline text
            cannot set or write.
    """
    models = (p if isinstance(p, PassModel) else adapt(p) for p in passes)
    return building.to_text(_printable(models, pipeline))
