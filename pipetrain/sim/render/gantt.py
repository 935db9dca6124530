"""Gantt charts of timelines with matplotlib (PNG or SVG), imported only when drawing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipetrain.schedules.actions import Kind
from pipetrain.schedules.execution import Timeline
from pipetrain.sim.metrics import bubble
from pipetrain.sim.render.base import RenderError, rank_chunks, unwritable

__all__ = ["KIND_COLOURS", "plot", "plot_compare"]

# Colour by kind; sends and receives share one muted colour, step-level actions another.
KIND_COLOURS: dict[Kind, str] = {
    Kind.F: "#4C78A8",
    Kind.B: "#E45756",
    Kind.I: "#F58518",
    Kind.W: "#54A24B",
    Kind.SEND_F: "#B0B0B0",
    Kind.RECV_F: "#B0B0B0",
    Kind.SEND_B: "#B0B0B0",
    Kind.RECV_B: "#B0B0B0",
    Kind.ALLREDUCE: "#9D755D",
    Kind.STEP: "#B279A2",
}
_LEGEND = (
    ("F", Kind.F),
    ("B", Kind.B),
    ("I", Kind.I),
    ("W", Kind.W),
    ("send/recv", Kind.SEND_F),
    ("all-reduce", Kind.ALLREDUCE),
    ("step", Kind.STEP),
)
_IDLE_COLOUR = "#EFEFEF"
_SUFFIXES = (".png", ".svg")


def _check_path(path: str | Path) -> Path:
    out = Path(path)
    if out.suffix.lower() not in _SUFFIXES:
        raise RenderError(f"plot file {str(out)!r}: use a .png or .svg suffix")
    return out


def _title(tl: Timeline, unit: str, taking_turns: bool) -> str:
    suffix = f" {unit}" if unit else ""
    head = f"{tl.name}    makespan {tl.makespan:g}{suffix}"
    if taking_turns and tl.num_ranks > 1:
        # Idle time between ranks that share one process is waiting for a turn, not bubble.
        return f"{head}    ranks took turns in one process: idle time is not a bubble"
    b = bubble(tl)
    return (
        f"{head}    bubble: {b.idle_fraction:.1%} idle, {b.over_ideal:.1%} over ideal, "
        f"worst rank span idle {b.per_rank_span_time:g}{suffix}"
    )


def _tint(colour: str, amount: float) -> str:
    """``colour`` mixed with white: 0 keeps it, 1 is white."""
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02X}" for c in rgb)


def _draw(
    ax: Any, tl: Timeline, t0: float, makespan: float, px_per_unit: float, title: str
) -> tuple[set[Kind], bool]:
    """Draw one timeline on ``ax``: ranks top to bottom, idle as a light band, a rank's
    later chunks in lighter shades of their kind's colour. All boxes of a panel go into
    one collection: one artist per box makes a large comparison take many seconds."""
    from matplotlib.collections import PolyCollection

    shown: set[Kind] = set()
    chunks = rank_chunks(tl)
    half = 0.4
    boxes: list[list[tuple[float, float]]] = []
    colours: list[str] = []
    edges: list[float] = []
    ticks: list[tuple[float, int, str]] = []
    for e in tl.events:
        y = tl.num_ranks - 1 - e.rank
        kind = e.action.kind
        x = e.start - t0
        if e.duration <= 0:
            # A free optimizer step still matters (a new weight version): a tick.
            if kind in (Kind.STEP, Kind.ALLREDUCE):
                shown.add(kind)
                ticks.append((x, y, KIND_COLOURS[kind]))
            continue
        shown.add(kind)
        index, count = chunks[e.action.stage]
        light = 0.5 * index / (count - 1) if count > 1 else 0.0
        boxes.append(
            [(x, y - half), (x + e.duration, y - half), (x + e.duration, y + half), (x, y + half)]
        )
        colours.append(_tint(KIND_COLOURS[kind], light))
        # White gaps between boxes, but none on slivers, which they would wash out.
        px = e.duration * px_per_unit
        edges.append(0.6 if px >= 6 else 0.25 if px >= 3 else 0.0)
        label = "" if e.action.microbatch is None else str(e.action.microbatch)
        # Numbers only where they fit: about 6 pixels per digit at this font size.
        if label and e.duration * px_per_unit >= 6 * len(label) + 3:
            ax.text(
                x + e.duration / 2,
                y,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="white" if light < 0.3 else "#222222",
            )
    # Idle is the band behind the boxes, up to this timeline's own end.
    bands = [
        [(0.0, y - half), (tl.makespan, y - half), (tl.makespan, y + half), (0.0, y + half)]
        for y in range(tl.num_ranks)
    ]
    ax.add_collection(PolyCollection(bands, facecolors=_IDLE_COLOUR, linewidths=0))
    ax.add_collection(
        PolyCollection(boxes, facecolors=colours, edgecolors="white", linewidths=edges)
    )
    for tick_x, tick_y, colour in ticks:
        ax.vlines(tick_x, tick_y - half, tick_y + half, color=colour, lw=2)
    ax.set_yticks(range(tl.num_ranks))
    ax.set_yticklabels([f"rank {tl.num_ranks - 1 - y}" for y in range(tl.num_ranks)])
    ax.set_ylim(-0.6, tl.num_ranks - 0.4)
    ax.set_xlim(0.0, makespan)
    ax.set_title(title, fontsize=9, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return shown, any(count > 1 for _, count in chunks.values())


def _legend(fig: Any, shown: set[Kind], chunked: bool) -> None:
    from matplotlib.patches import Patch

    comm = {Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B}
    handles = [
        Patch(facecolor=KIND_COLOURS[kind], label=label)
        for label, kind in _LEGEND
        if kind in shown or (kind is Kind.SEND_F and shown & comm)
    ]
    if chunked:
        handles.append(
            Patch(facecolor=_tint(KIND_COLOURS[Kind.F], 0.5), label="a rank's later stage")
        )
    handles.append(Patch(facecolor=_IDLE_COLOUR, edgecolor="#CCCCCC", label="idle"))
    fig.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
    )


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RenderError(
            "drawing a PNG or SVG needs matplotlib: pip install 'pipetrain[plot]'"
        ) from exc
    return Figure(figsize=(width, height))


def _span(timelines: Sequence[Timeline]) -> tuple[list[float], float]:
    starts = [min((e.start for e in tl.events), default=0.0) for tl in timelines]
    longest = max((tl.makespan for tl in timelines), default=0.0)
    return starts, longest if longest > 0 else 1.0


def plot(
    timeline: Timeline, path: str | Path, *, unit: str = "", taking_turns: bool = False
) -> Path:
    """A Gantt chart of ``timeline`` to ``path`` (.png or .svg, chosen by suffix).

    ``unit`` names the timeline's time unit on the axis and in the title (``"s"`` for a
    measured step; a simulation's units have none). ``taking_turns``: every rank ran in
    one process (the runtime's debug mode), so the title gives no bubble.
    """
    return plot_compare([timeline], path, unit=unit, taking_turns=taking_turns)


# Layout in inches, fixed rather than computed by a layout engine, which would render
# every label twice.
_ROW_IN = 0.32  # one rank
_TITLE_IN = 0.45  # a panel's title and the gap above it
_BOTTOM_IN = 0.8  # time axis label and legend
_LEFT_IN, _RIGHT_IN = 0.85, 0.25
_DPI = 120


def plot_compare(
    timelines: Sequence[Timeline], path: str | Path, *, unit: str = "", taking_turns: bool = False
) -> Path:
    """Several timelines stacked on one shared time axis, one panel each (``unit`` and
    ``taking_turns`` as for ``plot``)."""
    out = _check_path(path)
    if not timelines:
        raise RenderError("nothing to plot: give at least one timeline")
    starts, longest = _span(timelines)
    rows = sum(tl.num_ranks for tl in timelines)
    width = min(18.0, max(8.0, 0.12 * longest + 3.0))
    panels_in = _ROW_IN * rows + _TITLE_IN * len(timelines)
    height = panels_in + _BOTTOM_IN
    fig = _figure(width, height)
    axes = fig.subplots(
        len(timelines),
        1,
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [tl.num_ranks for tl in timelines]},
    )[:, 0]
    mean_axes_in = _ROW_IN * rows / len(timelines)
    fig.subplots_adjust(
        left=_LEFT_IN / width,
        right=1 - _RIGHT_IN / width,
        bottom=_BOTTOM_IN / height,
        top=1 - _TITLE_IN / height,
        hspace=_TITLE_IN / mean_axes_in,
    )
    px_per_unit = (width - _LEFT_IN - _RIGHT_IN) * _DPI / longest
    shown: set[Kind] = set()
    chunked = False
    for ax, tl, t0 in zip(axes, timelines, starts, strict=True):
        kinds, multi = _draw(ax, tl, t0, longest, px_per_unit, _title(tl, unit, taking_turns))
        shown |= kinds
        chunked = chunked or multi
    axes[-1].set_xlabel(f"time ({unit})" if unit else "time")
    _legend(fig, shown, chunked)
    try:
        fig.savefig(out, dpi=_DPI)
    except OSError as exc:
        raise unwritable(out, exc) from exc
    return out
