"""Building pipelines: registered names and pipeline text made into passes, and passes
printed back as text.

Text goes through the grammar (:mod:`epass.pipeline`) into a tree of specs, and the
registry makes each pass (:func:`epass.registry.create`). A group of the text
(``repeat``, ``fixpoint``), or text naming several passes, becomes a :class:`Nested`:
the manager makes it into a nested :class:`~epass.PassManager`, and hands its nested
pipelines back as :class:`Nested` to be printed. The builder never imports the
manager; the arrow points one way.

Example::

    (made,) = build_text("fold-constants(max_growth=2.0)")
    assert made.origin == ("fold-constants", {"max_growth": 2.0})
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from epass import pipeline, registry
from epass.errors import ArgumentTypeError, ArgumentValueError
from epass.pipeline import Group, Item, PassSpec
from epass.protocol import Origin, PassModel

__all__ = ["Made", "Nested", "build", "build_text", "make", "spec_tree", "to_text"]


@attrs.frozen
class Made:
    """One pass made from a registered name.

    Attributes:
        pass_: the pass, labelled with its name (:func:`epass.protocol.label`).
        origin: the registry name and the converted options that make it again.
    """

    pass_: Any
    origin: Origin


@attrs.frozen
class Nested:
    """Passes that run as one nested pipeline.

    Built from text, it is a ``repeat`` or ``fixpoint`` group (named by its kind), or
    text naming several passes (named by the text); the manager makes it a
    :class:`~epass.PassManager`. Handed back to be printed, it is a nested manager.

    Attributes:
        name: the nested pipeline's name; ``"fixpoint"`` prints as a fixpoint group.
        steps: how many rounds it runs at most.
        items: its passes: :class:`Made` and :class:`Nested` when built,
            :class:`~epass.protocol.PassModel` and :class:`Nested` to be printed.
    """

    name: str
    steps: int
    items: tuple[Any, ...]


# --- text to passes ---------------------------------------------------------------------


def build(items: Sequence[Item], text: str) -> tuple[Made | Nested, ...]:
    """The passes of a spec tree parsed from ``text``; errors point into ``text``."""
    out: list[Made | Nested] = []
    for item in items:
        if isinstance(item, Group):
            out.append(Nested(item.kind, item.count, build(item.items, text)))
        else:
            made, options = registry.create(item, text=text)
            out.append(Made(made, (item.name, options)))
    return tuple(out)


def build_text(text: str) -> tuple[Made | Nested, ...]:
    """The passes of pipeline text (:meth:`PassManager.from_text <epass.PassManager.from_text>`)."""
    return build(pipeline.parse(text), text)


def make(spec: str, options: Mapping[str, Any] | None = None) -> Made | Nested:
    """What :func:`~epass.create_pass` makes: the pass a registered name makes with
    ``options``, or the passes of pipeline text (a :class:`Nested` when several).

    Raises:
        ArgumentTypeError: ``spec`` is not a str, or options come both in the text
            and as keywords.
        ArgumentValueError: ``spec`` holds no pass.
    """
    if not isinstance(spec, str):
        raise ArgumentTypeError(
            f"create_pass takes a name or pipeline text, got {type(spec).__name__}"
        )
    name = spec.strip()
    if not name:
        raise ArgumentValueError("create_pass: spec is empty; give a pass name or pipeline text")
    if pipeline.NAME_PATTERN.fullmatch(name):
        made, converted = registry.create(PassSpec(name, tuple((options or {}).items())))
        return Made(made, (name, converted))
    if options:
        raise ArgumentTypeError("pass options either in the text or as keywords, not both")
    built = build_text(spec)
    if not built:
        raise ArgumentValueError(f"create_pass: spec {spec!r} holds no pass")
    return built[0] if len(built) == 1 else Nested(name, 1, built)


# --- passes to text ---------------------------------------------------------------------


def spec_tree(nodes: Iterable[PassModel | Nested]) -> tuple[Item, ...]:
    """The spec tree that makes these passes again; ValueError if one has no name."""
    out: list[Item] = []
    for node in nodes:
        if isinstance(node, Nested):
            kind = "fixpoint" if node.name == "fixpoint" else "repeat"
            out.append(Group(kind, node.steps, spec_tree(node.items)))
            continue
        spec = registry.spec_of(node.pass_, node.name, node.origin)
        if spec is None:
            raise ArgumentValueError(
                f"pass {node.name!r} ({type(node.pass_).__name__}) is not registered, so it "
                "has no textual form; register it with epass.register_pass"
            )
        out.append(spec)
    return tuple(out)


def to_text(nodes: Iterable[PassModel | Nested]) -> str:
    """Passes (their models, nested pipelines as :class:`Nested`) as pipeline text
    that :func:`build_text` reads back.

    Raises:
        ValueError: a pass is not registered, or has an option that pipeline text
            cannot set or write.
    """
    tree = spec_tree(nodes)
    for spec in pipeline.walk(tree):
        declared = registry.declared_options(spec.name)
        for key, value in spec.options:
            if key not in declared:
                raise ArgumentValueError(
                    f"option {key!r} of pass {spec.name!r} is a keyword argument that "
                    "pipeline text cannot set"
                )
            try:
                pipeline.format_value(value)
            except ValueError as exc:
                raise ArgumentValueError(f"option {key!r} of pass {spec.name!r}: {exc}") from None
    return pipeline.format_pipeline(tree)
