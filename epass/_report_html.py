"""The HTML page of a pipeline report: self-contained, every string escaped, built
from the report's JSON document (see :mod:`epass.report`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from epass._page import CSS, bar_chart, node_line
from epass._text import html_text
from epass.linker import owners_text
from epass.pipeline import format_value
from epass.records import state_text

__all__ = ["flatten", "json_value", "render_html"]


def json_value(value: Any) -> Any:
    """``value`` as JSON data: dtypes and operators as their pipeline text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    try:
        return format_value(value)
    except ValueError:
        return repr(value)


def flatten(passes: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Every pass entry of a report, nested ones after their parent, in run order."""
    out: list[Mapping[str, Any]] = []
    for p in passes:
        out.append(p)
        out.extend(flatten(p["children"]))
    return out


def _leaves(passes: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Passes that ran a program step themselves (nested pipelines replaced by their passes)."""
    out: list[Mapping[str, Any]] = []
    for p in passes:
        if p["children"]:
            out.extend(_leaves(p["children"]))
        else:
            out.append(p)
    return out


def _owners_status(owners: Mapping[str, str], changed: bool) -> tuple[str, str]:
    """(css class, text) for whose dicts an output holds: the user's (green), its
    own because it added entries (blue), or its own with changed values (red)."""
    mine = set(owners.values()) != {"user"}
    cls = "diverged" if changed else "own" if mine else "shared"
    return cls, owners_text({"state_dict": "user", "constants": "user", **owners})


def _state_status(p: Mapping[str, Any]) -> tuple[str, str]:
    """(css class, text) for a pass's state column: whose dicts its output holds
    (the counts have columns of their own)."""
    link = p["link"]
    if p["skipped"] or link is None:
        text = state_text(p["skipped"], p["skip_reason"], None)
        return ("skip" if p["skipped"] else "same"), text
    changed = any(link[label]["changed"] for label in ("state_dict", "constants"))
    return _owners_status(link.get("owners", {}), changed)


def _keys(link: Mapping[str, Any] | None, field: str) -> list[str]:
    if link is None:
        return []
    return [f"{label}:{k}" for label in ("state_dict", "constants") for k in link[label][field]]


# The passes table's columns: the notes get room for whole words.
_PASS_COLUMNS = (
    "<colgroup>"
    + "".join(f'<col style="width:{w}%">' for w in (16, 5, 7, 8, 13, 10, 10, 9, 22))
    + "</colgroup>"
)
_STATE_LEGEND = (
    "<strong>whose dicts</strong>: whether the output's <code>state_dict</code> and "
    "<code>constants</code> are the very dicts of the program you gave (user's) or new "
    "dicts the output owns (own); <strong>added</strong>: entries only the output's own "
    "dicts hold; <strong>no longer used</strong>: entries the output no longer reads, "
    "still in your dicts; <strong>changed</strong>: entries whose value the output's own "
    "dict replaced. Your dicts are untouched (only the <code>in_place</code> policy "
    "writes into them)."
)
_OPS_LEGEND = "<strong>delta</strong>: how many calls of each op the pass added (+) or removed (-)."
# Notes a pass reports, in words; the values as reported stay behind the toggle.
_METHOD_WORDS = {
    "incremental": "rewrote only the nodes to decompose",
    "retrace": "retraced the whole program (run_decompositions)",
}


def _notes_words(notes: Mapping[str, Any]) -> str:
    """What a pass's notes say, in a sentence ("" when there is nothing to say)."""
    words = []
    method = notes.get("method")
    if method in _METHOD_WORDS:
        words.append(_METHOD_WORDS[method])
        rewritten = notes.get("rewritten")
        if method == "incremental" and isinstance(rewritten, int):
            words[-1] += f" ({rewritten} node{'' if rewritten == 1 else 's'})"
    if notes.get("fallback"):
        words.append(f"the incremental path was not taken: {notes['fallback']}")
    if notes.get("checked") is True:
        words.append("checked against a retrace")
    return "; ".join(words)


def _notes_html(notes: Mapping[str, Any], notices: Sequence[Mapping[str, str]] = ()) -> str:
    """A pass's notes cell: a badge for each notice (``fell back``, or its kind) with
    its text on hover, then the notes in words, their values one click away; a pass
    with notices and no notes shows the notices' text instead."""
    badges = "".join(
        f'<span class="badge skip" title="{html_text(n["text"])}">'
        f"{'fell back' if n['kind'] == 'fallback' else html_text(n['kind'])}</span> "
        for n in notices
    )
    shown = {k: v for k, v in notes.items() if v is not None}
    if not shown:
        return badges + "; ".join(html_text(n["text"]) for n in notices)
    facts = "".join(
        f"<li><code>{html_text(k)}</code>: {html_text(json_value(v))}</li>"
        for k, v in shown.items()
    )
    return (
        f'{badges}<details class="notes"><summary>{html_text(_notes_words(notes) or "details")}'
        f"</summary><ul>{facts}</ul></details>"
    )


def _notices_html(report: Mapping[str, Any]) -> list[str]:
    """Under the verdict: each notice with its pass, after their count unless the
    verdict's summary says it already."""
    notices = report.get("notices") or []
    if not notices:
        return []
    items = "".join(
        f'<li class="notice {html_text(n["kind"])}"><code>{html_text(n["pass"])}</code>: '
        f"{html_text(n['text'])}</li>"
        for n in notices
    )
    counted = report.get("notice_count") or "notices"
    head = "" if counted in report["verdict"]["summary"] else f"<p>{html_text(counted)}:</p>"
    return [f'{head}<ul class="notices">{items}</ul>']


def _verdict_html(report: Mapping[str, Any]) -> list[str]:
    """The first thing on the page: what happened, where, what fell back, and what
    to run next."""
    v = report.get("verdict")
    if not v:
        return []
    cls = "shared" if v["status"] == "ok" else "diverged"
    out = [
        f'<div class="verdict {cls}"><p><strong>{html_text(v["status"].upper())}</strong>: '
        f"{html_text(v['summary'])}</p>"
    ]
    if v.get("pass"):
        out.append(f"<p>pass <code>{html_text(v['pass'])}</code></p>")
    if v.get("error"):
        out.append(f"<p>error: <code>{html_text(v['error'])}</code></p>")
    if v.get("traceback"):
        out.append("<pre>" + "\n".join(html_text(line) for line in v["traceback"]) + "</pre>")
    if v.get("node"):
        out.append(f"<p>first diverging node: <code>{html_text(v['node'])}</code></p>")
    if v.get("reproducer"):
        out.append(f"<p>reproducer: <code>{html_text(v['reproducer'])}</code></p>")
    out += _notices_html(report)
    if v.get("next"):
        out.append(f"<p>next: <code>{html_text(v['next'])}</code></p>")
    out.append("</div>")
    return out


def render_html(report: Mapping[str, Any]) -> str:
    """One self-contained HTML page (inline CSS and SVG, no scripts, no external assets)."""
    everything = flatten(report["passes"])
    leaves = _leaves(report["passes"])
    title = f"epass report: {report['pipeline'] or 'pipeline'}"
    changed = any(
        p["link"] and (p["link"]["state_dict"]["changed"] or p["link"]["constants"]["changed"])
        for p in everything
    )
    owners_cls, owners_label = _owners_status(report.get("owners", {}), changed)
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html_text(title)}</title><style>{CSS}</style></head><body>",
        "<h1>epass report</h1>",
        *_verdict_html(report),
        f'<p class="meta">pipeline <code>{html_text(report["pipeline"] or "(no text form)")}</code>'
        f" &middot; input <code>{html_text(report['input'] or '-')}</code>"
        f" &middot; output <code>{html_text(report['output'] or '-')}</code>"
        f" &middot; torch {html_text(report['torch_version'])}"
        f" &middot; epass {html_text(report['epass_version'])}"
        f" &middot; {html_text(report['created'])}</p>",
        f"<p>{html_text(report['count'])} in {report['seconds']:.2f} s; nodes "
        f"{report['nodes_before']} &rarr; {report['nodes_after']}; output state "
        f'<span class="badge {owners_cls}">{html_text(owners_label)}</span></p>',
    ]
    numerics = report.get("numerics")
    if numerics:
        cls = "shared" if numerics.get("ok") else "diverged"
        out.append(
            f"<p>numerics: max abs diff {numerics.get('max_abs_diff', float('nan')):.3g} "
            f'<span class="badge {cls}">{"ok" if numerics.get("ok") else "FAILED"}</span></p>'
        )
    out += ["<h2>Time per pass</h2>", bar_chart(leaves)]
    out += ["<h2>Node count across the pipeline</h2>", node_line(leaves, report["nodes_before"])]
    out += [
        "<h2>Passes and state sharing</h2>",
        f'<p class="legend">{_STATE_LEGEND}</p>',
        f"<table>{_PASS_COLUMNS}<thead><tr><th>pass</th><th>step</th><th>seconds</th>"
        "<th>nodes</th><th>whose dicts</th><th>added</th><th>no longer used</th>"
        "<th>changed</th><th>notes</th></tr></thead><tbody>",
    ]
    out += _pass_rows(everything)
    out.append("</tbody></table>")
    out += [
        "<h2>Op delta per pass</h2>",
        f'<p class="legend">{_OPS_LEGEND}</p>',
        "<table><thead><tr><th>pass</th><th>op</th><th>delta</th></tr></thead><tbody>",
    ]
    out += _delta_rows(leaves)
    out.append("</tbody></table>")
    out += ["<h2>What each pass changed</h2>", *_pass_sections(everything)]
    out.append("</body></html>")
    return "\n".join(out)


def _pass_rows(everything: Sequence[Mapping[str, Any]]) -> list[str]:
    """One row per pass of the state-sharing table."""
    out = []
    for i, p in enumerate(everything):
        cls, text = _state_status(p)
        link = f'<a href="#pass-{i}">{html_text(p["spec"] or p["name"])}</a>'
        name = "&nbsp;&nbsp;" * p["depth"] + link
        cells = [
            f'<td class="pass">{name}</td>',
            f'<td class="num">{p["step"]}</td>',
            f'<td class="num">{p["seconds"]:.4f}</td>',
            f'<td class="num">{p["nodes_before"]}&rarr;{p["nodes_after"]}</td>',
            f'<td><span class="badge {cls}">{html_text(text)}</span></td>',
        ]
        for field in ("added", "removed", "changed"):
            keys = _keys(p["link"], field)
            more = " &hellip;" if len(keys) > 8 else ""
            shown = ", ".join(html_text(k) for k in keys[:8]) + more
            cells.append(f'<td title="{len(keys)}">{len(keys) or ""} {shown}</td>')
        notes = _notes_html(p.get("notes") or {}, p.get("notices") or ())
        cells.append(f'<td class="notes">{notes}</td>')
        out.append(f'<tr class="state {cls}">{"".join(cells)}</tr>')
    return out


def _delta_rows(leaves: Sequence[Mapping[str, Any]]) -> list[str]:
    """The op-delta table's rows: each op a pass changed the count of."""
    out = []
    any_delta = False
    for p in leaves:
        for op, delta in sorted(p["op_delta"].items(), key=lambda kv: (kv[1], kv[0])):
            any_delta = True
            sign = "plus" if delta > 0 else "minus"
            out.append(
                f'<tr class="delta"><td>{html_text(p["path"])}</td>'
                f"<td><code>{html_text(op)}</code></td>"
                f'<td class="num {sign}">{delta:+d}</td></tr>'
            )
    if not any_delta:
        out.append('<tr><td colspan="3">no pass changed the op histogram</td></tr>')
    return out


def _pass_sections(everything: Sequence[Mapping[str, Any]]) -> list[str]:
    """One collapsible section per pass: its op delta and the calls it added and
    removed, grouped by op, with the source line each came from."""
    out = []
    for i, p in enumerate(everything):
        delta = ", ".join(f"{op} {d:+d}" for op, d in sorted(p["op_delta"].items()))
        head = f"{html_text(p['path'])} (step {p['step']})"
        summary = f"{head}: {html_text(delta) if delta else 'no op count changed'}"
        if p["skipped"]:
            summary = f"{head}: skipped"
        out.append(f'<details id="pass-{i}" class="pass-diff"><summary>{summary}</summary>')
        diff = p.get("diff")
        if not diff:
            why = "it did not change the program" if not p["modified"] else "not recorded"
            out.append(f"<p>No node diff: {why}.</p></details>")
            continue
        for side, sign in (("added", "+"), ("removed", "-")):
            groups = diff.get(side) or {}
            if not groups:
                continue
            out.append(f"<h3>{side}</h3><ul>")
            for op, nodes in sorted(groups.items()):
                items = "".join(
                    f"<li><code>{sign} {html_text(n['node'])}</code>"
                    + (f' <span class="src">{html_text(n["source"])}</span>' if n["source"] else "")
                    + "</li>"
                    for n in nodes
                )
                out.append(f"<li><code>{html_text(op)}</code> ({len(nodes)})<ul>{items}</ul></li>")
            out.append("</ul>")
        if diff.get("capped"):
            out.append(f'<p class="meta">{diff["capped"]} more nodes not listed (capped).</p>')
        out.append("</details>")
    return out
