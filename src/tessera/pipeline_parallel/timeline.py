"""Draw a simulated pipeline step: one row per rank, one box per compute action.

The boxes sit at the start and end times :func:`~tessera.pipeline_parallel.simulator.simulate`
gives, so the picture shows the schedule that runs, bubbles included. SVG is written by hand (no
dependency); a path ending in ``.png`` is rendered with matplotlib when it is installed.
"""

from __future__ import annotations

import math
from pathlib import Path
from xml.sax.saxutils import escape

from tessera.pipeline_parallel.schedules import COMPUTE, Op
from tessera.pipeline_parallel.simulator import Timeline

COLOURS = {Op.F: "#2f6db5", Op.B: "#c8324a", Op.I: "#e8a33d", Op.W: "#2e8b57"}
NAMES = {Op.F: "forward", Op.B: "backward", Op.I: "backward: input grad", Op.W: "backward: weight grad"}
ROW, GAP, LEFT, TOP = 26, 6, 64, 44  # pixels: row height, gap between rows, left and top margins
LABEL_PX = 18  # narrowest box that still fits a two-digit micro-batch number


def summary(timeline: Timeline, kind: str = "") -> str:
    """``kind pp=.. vpp=.. microbatches=.. bubble=..``: the picture's default title."""
    pp, vpp, m = _sizes(timeline)
    return f"{kind} pp={pp} vpp={vpp} microbatches={m} bubble={timeline.bubble_fraction:.3f}".strip()


def draw_timeline(timeline: Timeline, path: str | Path, title: str | None = None) -> None:
    """Write the timeline as ``.svg``, or as ``.png`` through matplotlib."""
    path = Path(path)
    title = title if title is not None else summary(timeline)
    if path.suffix == ".png":
        _draw_png(timeline, path, title)
    elif path.suffix == ".svg":
        path.write_text(_svg(timeline, title))
    else:
        raise ValueError(f"cannot draw '{path}': the timeline picture is written as .svg or .png")


def _sizes(timeline: Timeline) -> tuple[int, int, int]:
    """(pp, vpp, micro-batches), read off the actions."""
    actions = [a for rank in timeline.spans for a, _, _ in rank]
    vpp = max((a.chunk for a in actions), default=0) + 1
    return len(timeline.spans), vpp, max((a.microbatch for a in actions), default=-1) + 1


def _fill(op: Op, chunk: int, vpp: int) -> str:
    """The op's colour, lighter for later model chunks (chunk 0 is the darkest)."""
    towards_white = 0.6 * chunk / (vpp - 1) if vpp > 1 else 0.0
    rgb = [int(COLOURS[op][i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * towards_white):02x}" for c in rgb)


def _ink(fill: str) -> str:
    """Black text on light boxes, white on dark ones."""
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "white"


def _tick(span: float) -> float:
    """A round tick interval (1, 2 or 5 times a power of ten) giving at most 20 ticks."""
    base = 10 ** math.floor(math.log10(span / 20))
    return next(base * k for k in (1, 2, 5, 10) if span / (base * k) <= 20)


def _svg(timeline: Timeline, title: str) -> str:
    pp, vpp, _ = _sizes(timeline)
    step = timeline.step_time or 1.0
    durations = [end - start for rank in timeline.spans for _, start, end in rank if end > start]
    # Wide enough to read (900 px) and for every label to fit, but bounded for tiny costs.
    scale = min(max(900 / step, LABEL_PX / min(durations, default=step)), 20000 / step)
    axis_y = TOP + pp * (ROW + GAP)
    width, height = LEFT + step * scale + 24, axis_y + 70
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{LEFT}" y="22" font-size="14">{escape(title)}</text>']

    for r, rank in enumerate(timeline.spans):
        y = TOP + r * (ROW + GAP)
        out.append(f'<text x="{LEFT - 8}" y="{y + ROW / 2 + 4}" text-anchor="end">rank {r}</text>')
        for action, start, end in rank:
            x, w, fill = LEFT + start * scale, (end - start) * scale, _fill(action.op, action.chunk, vpp)
            out.append(f'<rect class="{action.op}" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW}" '
                       f'fill="{fill}" stroke="white"><title>{action} [{start:g}, {end:g}]</title></rect>')
            if w >= LABEL_PX:
                out.append(f'<text class="microbatch" x="{x + w / 2:.2f}" y="{y + ROW / 2 + 4}" '
                           f'text-anchor="middle" fill="{_ink(fill)}">{action.microbatch}</text>')

    tick = _tick(step)
    out.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{LEFT + step * scale:.2f}" y2="{axis_y}" stroke="black"/>')
    for i in range(int(step / tick + 1e-9) + 1):
        x = LEFT + i * tick * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="black"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 16}" text-anchor="middle">{i * tick:g}</text>')
    out.append(f'<text x="{LEFT - 8}" y="{axis_y + 16}" text-anchor="end">time</text>')

    x, y = LEFT, axis_y + 36
    for op in _ops(timeline):
        out.append(f'<rect class="legend" x="{x}" y="{y}" width="14" height="14" fill="{COLOURS[op]}"/>')
        out.append(f'<text x="{x + 18}" y="{y + 11}">{op} {NAMES[op]}</text>')
        x += 40 + 7 * len(NAMES[op])  # about 7 px a character
    if vpp > 1:
        out.append(f'<text x="{x}" y="{y + 11}">lighter shade: later model chunk (0..{vpp - 1})</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _ops(timeline: Timeline) -> list[Op]:
    """The kinds of compute action in the timeline, in F, B, I, W order (the legend's entries)."""
    present = {a.op for rank in timeline.spans for a, _, _ in rank}
    return [op for op in COMPUTE if op in present]


def _draw_png(timeline: Timeline, path: Path, title: str) -> None:
    try:
        from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend
        from matplotlib.patches import Patch
    except ImportError:
        raise ValueError(f"cannot draw '{path}': PNG needs matplotlib; write .svg instead, "
                         "or pip install matplotlib") from None
    pp, vpp, _ = _sizes(timeline)
    # as wide as the busiest rank's actions need (a quarter inch each, 6-60 inches), whatever
    # unit the costs are in
    actions = max((len(rank) for rank in timeline.spans), default=0)
    fig = Figure(figsize=(min(60.0, max(6.0, actions / 4)), 1.2 + 0.45 * pp))
    ax = fig.subplots()
    for r, rank in enumerate(timeline.spans):
        for action, start, end in rank:
            fill = _fill(action.op, action.chunk, vpp)
            ax.barh(r, end - start, left=start, height=0.8, color=fill, edgecolor="white")
            ax.text((start + end) / 2, r, str(action.microbatch), ha="center", va="center", fontsize=7,
                    color=_ink(fill))
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.step_time)
    ax.set_xlabel("time")
    ax.set_title(title, loc="left")
    ops = _ops(timeline)
    ax.legend(handles=[Patch(color=COLOURS[op], label=f"{op} {NAMES[op]}") for op in ops],
              loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)  # right of the rows
    fig.savefig(path, dpi=150, bbox_inches="tight")
