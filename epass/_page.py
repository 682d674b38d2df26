"""The parts of the HTML report page that hold nothing of a run's logic: its style
sheet and its two SVG charts (time per pass, node
count across the pipeline)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epass._text import html_text

__all__ = ["CSS", "bar_chart", "node_line"]

CSS = """.verdict{border:2px solid #ccc;border-radius:6px;padding:4px 12px;margin:8px 0}
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


def bar_chart(leaves: Sequence[Mapping[str, Any]]) -> str:
    """The time each pass took, one bar a pass (a modified pass's bar darker)."""
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
        name = html_text(p["path"])
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


def node_line(leaves: Sequence[Mapping[str, Any]], start: int) -> str:
    """The node count from the input (``start``) through each pass, passes named on
    the axis."""
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
            f"<title>{html_text(label)}: {v} nodes</title></circle>"
            f'<text class="axis" x="{x:.1f}" y="{h - pad + 14}" text-anchor="end" '
            f'transform="rotate(-35 {x:.1f} {h - pad + 14})">{html_text(label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)
