"""What ``epass run`` concludes about a run: the numerics verdict (printed, and the
report's ``numerics`` entry), the verdicts of a drift and of a failed pass, and the
note on the reproducer written."""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING, Any

from epass._terminal import Out

if TYPE_CHECKING:
    from epass.errors import PassError
    from epass.instruments import NumericsCheck, Reproducer
    from epass.report import RunLog

__all__ = [
    "drift_verdict",
    "failure_verdict",
    "numerics_entry",
    "reproducer_note",
    "show_numerics",
]


def show_numerics(out: Out, check: NumericsCheck) -> None:
    """The numerics lines under the pass table: the verdict, and where outputs drift."""
    numerics = numerics_entry(check)
    word = "ok" if numerics["ok"] else "FAILED"
    out.line(
        f"numerics: max abs diff {numerics['max_abs_diff']:.3g} "
        f"(atol {check.atol:g}, rtol {check.rtol:g}) {word}"
    )
    if check.first_drift is not None:
        out.line(f"numerics: first drifting pass: {check.first_drift}")
        if check.first_drift.node is not None:
            out.line(f"numerics: first diverging node: {check.first_drift.node}")


def numerics_entry(check: NumericsCheck) -> dict[str, Any]:
    """The report's ``numerics`` entry: the output against the input, and the verdict."""
    final = check.checks[-1] if check.checks else None
    first = check.first_drift
    return {
        "max_abs_diff": final.max_abs if final is not None else 0.0,
        "ok": first is None,
        "atol": check.atol,
        "rtol": check.rtol,
        "first_drift": None if first is None else str(first),
        "first_node": None if first is None or first.node is None else first.node.as_dict(),
        "passes": [
            {"pass": d.path, "max_abs": d.max_abs, "max_rel": d.max_rel, "ok": d.ok}
            for d in check.checks
        ],
    }


def drift_verdict(args: argparse.Namespace, check: NumericsCheck) -> dict[str, Any] | None:
    from epass.report import verdict

    drift = check.first_drift
    if drift is None:
        return None
    return verdict(
        "numerics drift",
        summary=f"outputs drift after pass {drift.path!r}: max_abs {drift.max_abs:.3g}, "
        f"max_rel {drift.max_rel:.3g} (atol {check.atol:g}, rtol {check.rtol:g})",
        pass_path=drift.path,
        node=None if drift.node is None else str(drift.node),
        next_step=f"epass run {args.input} -p {shlex.quote(args.pipeline)} "
        f"--check-numerics --report report.html: its section for {drift.path!r} lists "
        "the nodes that pass added and removed",
    )


def failure_verdict(
    args: argparse.Namespace, exc: PassError, log: RunLog | None, reproducer: Reproducer | None
) -> dict[str, Any]:
    from epass.report import verdict

    failure = (log.failure if log is not None else None) or {}
    written = reproducer.written if reproducer is not None else []
    repro = str(written[-1] / "repro.py") if written else None
    again = f"epass run {args.input} -p {shlex.quote(args.pipeline)} --repro-dir repros"
    return verdict(
        "pass failed",
        summary=f"pass {failure.get('pass', exc.pass_name)!r} failed",
        pass_path=failure.get("pass", exc.pass_name),
        error=failure.get("error", str(exc).splitlines()[0]),
        traceback_lines=failure.get("traceback", ()),
        reproducer=repro,
        next_step=f"python {repro}" if repro else again,
    )


def reproducer_note(reproducer: Reproducer) -> str:
    if reproducer.written:
        return f"epass: reproducer written to {reproducer.written[-1]}"
    if reproducer.write_errors:
        reason = reproducer.write_errors[-1]
        return f"epass: cannot write a reproducer to {reproducer.directory}: {reason}"
    return ""
