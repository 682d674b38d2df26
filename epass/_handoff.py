"""The one shape of every hand-off to a consumer: run the pipeline, give the consumer
a private program, serve its own ``run_decompositions`` calls through epass (the
switch), check that it wrote nothing into the shared tensors, relink what it hands
back."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
from torch.export import ExportedProgram

from epass import _program, _switch
from epass.errors import StateMutationError
from epass.io import prune
from epass.linker import LinkReport, StateLinker
from epass.manager import PipelineResult, as_pipeline
from epass.watch import StoreWatch

__all__ = ["HandOff", "private_program", "start"]

logger = logging.getLogger("epass")

T = TypeVar("T")


def private_program(program: ExportedProgram) -> ExportedProgram:
    """A program a consumer may edit and keep: its own graph, signature and dicts,
    holding ``program``'s tensor objects, and only the entries its signature
    references (consumers read whole dicts: TVM binds every ``constants`` value in
    order, ExecuTorch rejects a constant without an input spec)."""
    return prune(_program.private_view(program, copy_graph=True))


@attrs.frozen
class HandOff:
    """One hand-off in progress.

    Attributes:
        consumer: the consumer's name, used in errors and link reports.
        programs: per method, the pipeline's output (sharing the user's state), or
            the user's program without a pipeline.
        pipelines: per method, the pipeline's result (empty without a pipeline).
        private: per method, the program the consumer is given
            (:func:`private_program` of ``programs``).
        sources: per method, the user's program; link reports call its dicts the
            user's.
        served: the consumer's ``run_decompositions`` calls, served by epass while
            :meth:`call` runs (None: the caller opted out, and torch's own method
            runs).
    """

    consumer: str
    programs: Mapping[str, ExportedProgram]
    pipelines: Mapping[str, PipelineResult]
    private: Mapping[str, ExportedProgram]
    sources: Mapping[str, ExportedProgram]
    served: _switch.DecompositionLog | None = None

    def call(self, convert: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``convert(*args, **kwargs)``, checked on every exit: a consumer that writes
        into a tensor of the private programs (the user's tensors) is named in a
        :class:`~epass.StateMutationError` chained to whatever it raised, whether it
        returned, raised, called ``sys.exit()`` or was interrupted. A consumer that
        wrote nothing has its ``SystemExit`` or ``KeyboardInterrupt`` re-raised as it
        was. While it runs, its ``run_decompositions`` calls are served by epass
        (unless :attr:`served` is None); a served result of a private program holds
        that program's dicts."""
        watch = StoreWatch.of(self.private.values(), fingerprint=True)
        try:
            with self._serving():
                out = convert(*args, **kwargs)
        except BaseException as exc:
            self._check(watch, exc)
            raise
        self._check(watch, None)
        return out

    def _serving(self) -> contextlib.AbstractContextManager[Any]:
        if self.served is None:
            return contextlib.nullcontext()
        return _switch.switched(private=self.private.values(), log=self.served)

    def _check(self, watch: StoreWatch, cause: BaseException | None) -> None:
        touched = watch.touched()
        if touched:
            raise StateMutationError(
                f"{self.consumer} wrote in place into shared state tensors {touched}; "
                "the user's model holds these tensors",
                keys=touched,
            ) from cause

    def relink(self, name: str, exported: ExportedProgram) -> LinkReport:
        """Point ``exported`` (a program the consumer built or kept) at the dicts and
        tensor objects of ``programs[name]`` wherever it holds the same entries, and
        return the link report (the StateLinker's ``share`` policy: the user's dicts
        never gain an entry)."""
        report = (
            StateLinker()
            .link(self.programs[name], exported, pass_name=self.consumer, user=self.sources[name])
            .report
        )
        logger.debug("%s: %s: %s", self.consumer, name, report.summary())
        return report


def start(
    sources: Mapping[str, ExportedProgram], pipeline: Any, consumer: str, *, serve: bool = True
) -> HandOff:
    """Run ``pipeline`` (see :func:`~epass.manager.as_pipeline`) on every program of
    ``sources`` and build the private programs the consumer gets; ``serve``: serve
    the consumer's ``run_decompositions`` calls through epass."""
    manager = as_pipeline(pipeline)
    pipelines: dict[str, PipelineResult] = {}
    programs: dict[str, ExportedProgram] = {}
    for name, ep in sources.items():
        if manager is not None:
            pipelines[name] = manager(ep)
            programs[name] = pipelines[name].program
        else:
            programs[name] = ep
    private = {name: private_program(p) for name, p in programs.items()}
    served = _switch.DecompositionLog() if serve else None
    return HandOff(consumer, programs, pipelines, private, dict(sources), served)
