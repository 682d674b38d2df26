"""The HTML page of a pipeline report: self-contained, every string escaped, built
from the report's JSON document (see :mod:`epass.report`)."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from epass._text import printable
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


_CSS = """.verdict{border:2px solid #ccc;border-radius:6px;padding:4px 12px;margin:8px 0}
.verdict.shared{border-color:#2a7}.verdict.diverged{border-color:#c33}

body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;
max-width:1100px;color:#1d2330;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:2em;
border-bottom:1px solid #dde;padding-bottom:.2em}
code{background:#f2f3f7;padding:1px 4px;border-radius:3px}
table{border-collapse:collapse;width:100%;margin-top:.5em;table-layout:fixed}
td{overflow-wrap:break-word;hyphens:manual}.legend{color:#555;font-size:.9em}
details.notes ul{margin:.2em 0;padding-left:1.2em}details.notes summary{cursor:pointer}
.axis{font-size:11px}.src{color:#666;font-size:.9em}
details.pass-diff{margin:.3em 0}details.pass-diff summary{cursor:pointer}
th,td{border-bottom:1px solid #e4e6ee;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f7fb}td.num{text-align:right;font-variant-numeric:tabular-nums}
.meta{color:#555}.badge{display:inline-block;padding:0 6px;border-radius:8px;font-size:.9em}
.shared{background:#dff3e4;color:#176a2c}.diverged{background:#fde2e1;color:#9b1c1c}
.own{background:#e1ecfd;color:#1c4b9b}.same{background:#eef0f5;color:#444}.skip{background:#fff4d6;color:#7a5a00}
.plus{color:#176a2c}.minus{color:#9b1c1c}
svg text{font:12px system-ui,sans-serif;fill:#1d2330}
rect.bar{fill:#4a72d8}rect.bar.modified-false{fill:#a9b7dc}
polyline.nodes{fill:none;stroke:#d8614a;stroke-width:2}circle.node{fill:#d8614a}
"""


def _esc(value: Any) -> str:
    """Text for the page: every unprintable character escaped (the one rule of
    :mod:`epass._text`, as on the terminal), then HTML's own escaping."""
    return html.escape(printable(str(value)), quote=True)


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


def _notes_html(notes: Mapping[str, Any]) -> str:
    shown = {k: v for k, v in notes.items() if v is not None}
    if not shown:
        return ""
    facts = "".join(
        f"<li><code>{_esc(k)}</code>: {_esc(json_value(v))}</li>" for k, v in shown.items()
    )
    return (
        f'<details class="notes"><summary>{_esc(_notes_words(notes) or "details")}</summary>'
        f"<ul>{facts}</ul></details>"
    )


def _bar_chart(leaves: Sequence[Mapping[str, Any]]) -> str:
    row, label_w, chart_w = 22, 240, 560
    top = max((p["seconds"] for p in leaves), default=0.0) or 1.0
    height = row * len(leaves) + 10
    parts = [
        f'<svg class="chart time" width="{label_w + chart_w + 90}" height="{height}" '
        f'role="img" aria-label="time per pass">'
    ]
    for i, p in enumerate(leaves):
        y = i * row + 4
        width = max(1.0, chart_w * p["seconds"] / top)
        name = _esc(p["path"])
        modified = "true" if p["modified"] else "false"
        parts.append(
            f'<text x="{label_w - 6}" y="{y + 14}" text-anchor="end">{name}</text>'
            f'<rect class="bar modified-{modified}" data-pass="{name}" x="{label_w}" y="{y}" '
            f'width="{width:.1f}" height="{row - 6}"><title>{name}: {p["seconds"]:.4f}s'
            f"</title></rect>"
            f'<text x="{label_w + width + 6:.1f}" y="{y + 14}">{p["seconds"] * 1000:.1f} ms</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _node_line(leaves: Sequence[Mapping[str, Any]], start: int) -> str:
    values = [start, *[p["nodes_after"] for p in leaves]]
    labels = ["input", *[p["path"] for p in leaves]]
    w, h, pad = 860, 220, 50
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1
    step = (w - 2 * pad) / max(1, len(values) - 1)

    def xy(i: int, v: int) -> tuple[float, float]:
        return pad + i * step, h - pad - (v - lo) * (h - 2 * pad) / span

    points = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in enumerate(values)))
    parts = [
        f'<svg class="chart nodes" width="{w}" height="{h + 90}" role="img" '
        f'aria-label="node count across the pipeline">',
        f'<text x="4" y="{pad - 20}">{hi} nodes</text><text x="4" y="{h - pad + 16}">{lo}</text>',
        f'<polyline class="nodes" points="{points}"/>',
    ]
    for i, (v, label) in enumerate(zip(values, labels, strict=True)):
        x, y = xy(i, v)
        parts.append(
            f'<circle class="node" cx="{x:.1f}" cy="{y:.1f}" r="3.5">'
            f"<title>{_esc(label)}: {v} nodes</title></circle>"
            f'<text class="axis" x="{x:.1f}" y="{h - pad + 14}" text-anchor="end" '
            f'transform="rotate(-35 {x:.1f} {h - pad + 14})">{_esc(label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _verdict_html(v: Mapping[str, Any] | None) -> list[str]:
    """The first thing on the page: what happened, where, and what to run next."""
    if not v:
        return []
    cls = "shared" if v["status"] == "ok" else "diverged"
    out = [
        f'<div class="verdict {cls}"><p><strong>{_esc(v["status"].upper())}</strong>: '
        f"{_esc(v['summary'])}</p>"
    ]
    if v.get("pass"):
        out.append(f"<p>pass <code>{_esc(v['pass'])}</code></p>")
    if v.get("node"):
        out.append(f"<p>first diverging node: <code>{_esc(v['node'])}</code></p>")
    if v.get("error"):
        out.append(f"<p>error: <code>{_esc(v['error'])}</code></p>")
    if v.get("traceback"):
        out.append("<pre>" + "\n".join(_esc(line) for line in v["traceback"]) + "</pre>")
    if v.get("reproducer"):
        out.append(f"<p>reproducer: <code>{_esc(v['reproducer'])}</code></p>")
    if v.get("next"):
        out.append(f"<p>next: <code>{_esc(v['next'])}</code></p>")
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
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
        "<h1>epass report</h1>",
        *_verdict_html(report.get("verdict")),
        f'<p class="meta">pipeline <code>{_esc(report["pipeline"] or "(no text form)")}</code>'
        f" &middot; input <code>{_esc(report['input'] or '-')}</code>"
        f" &middot; output <code>{_esc(report['output'] or '-')}</code>"
        f" &middot; torch {_esc(report['torch_version'])}"
        f" &middot; epass {_esc(report['epass_version'])} &middot; {_esc(report['created'])}</p>",
        f"<p>{_esc(report['count'])} in {report['seconds']:.2f} s; nodes "
        f"{report['nodes_before']} &rarr; {report['nodes_after']}; output state "
        f'<span class="badge {owners_cls}">{_esc(owners_label)}</span></p>',
    ]
    numerics = report.get("numerics")
    if numerics:
        cls = "shared" if numerics.get("ok") else "diverged"
        out.append(
            f"<p>numerics: max abs diff {numerics.get('max_abs_diff', float('nan')):.3g} "
            f'<span class="badge {cls}">{"ok" if numerics.get("ok") else "FAILED"}</span></p>'
        )
    out += ["<h2>Time per pass</h2>", _bar_chart(leaves)]
    out += ["<h2>Node count across the pipeline</h2>", _node_line(leaves, report["nodes_before"])]
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
        name = (
            "&nbsp;&nbsp;" * p["depth"] + f'<a href="#pass-{i}">{_esc(p["spec"] or p["name"])}</a>'
        )
        cells = [
            f'<td class="pass">{name}</td>',
            f'<td class="num">{p["step"]}</td>',
            f'<td class="num">{p["seconds"]:.4f}</td>',
            f'<td class="num">{p["nodes_before"]}&rarr;{p["nodes_after"]}</td>',
            f'<td><span class="badge {cls}">{_esc(text)}</span></td>',
        ]
        for field in ("added", "removed", "changed"):
            keys = _keys(p["link"], field)
            shown = ", ".join(_esc(k) for k in keys[:8]) + (" &hellip;" if len(keys) > 8 else "")
            cells.append(f'<td title="{len(keys)}">{len(keys) or ""} {shown}</td>')
        cells.append(f'<td class="notes">{_notes_html(p.get("notes") or {})}</td>')
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
                f'<tr class="delta"><td>{_esc(p["path"])}</td><td><code>{_esc(op)}</code></td>'
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
        head = f"{_esc(p['path'])} (step {p['step']})"
        summary = f"{head}: {_esc(delta) if delta else 'no op count changed'}"
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
                    f"<li><code>{sign} {_esc(n['node'])}</code>"
                    + (f' <span class="src">{_esc(n["source"])}</span>' if n["source"] else "")
                    + "</li>"
                    for n in nodes
                )
                out.append(f"<li><code>{_esc(op)}</code> ({len(nodes)})<ul>{items}</ul></li>")
            out.append("</ul>")
        if diff.get("capped"):
            out.append(f'<p class="meta">{diff["capped"]} more nodes not listed (capped).</p>')
        out.append("</details>")
    return out
