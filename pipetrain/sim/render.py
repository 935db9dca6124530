"""Pictures of timelines: an ASCII grid, Chrome trace JSON and matplotlib Gantt charts.

All three take any ``Timeline`` (simulated or measured). matplotlib is imported only
inside ``plot`` and ``plot_compare``, so the terminal and trace outputs work without it.

The trace also shows communication, on a "comm" track below each rank's compute track:
the transfers between ranks (``transfers``: a compute-only schedule's are implicit, a
delay on each edge that crosses ranks, so they are recomputed from the placement),
timed all-reduces, and the data-parallel collectives (``LinkSpan``: ``--dp`` all-reduces,
``--shard`` gathers and reduce-scatters). Communication of zero length (the default free network) is left out:
it takes no time, and hundreds of empty slices would hide the work.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.errors import InputError
from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.deps import requirements
from pipetrain.schedules.execution import Event, Timeline
from pipetrain.schedules.placement import Placement
from pipetrain.sim.data_parallel import LinkSpan
from pipetrain.sim.metrics import bubble, live_activations

__all__ = [
    "KIND_COLOURS",
    "RenderError",
    "Transfer",
    "ascii",
    "chrome_trace",
    "plot",
    "plot_compare",
    "transfers",
    "write_chrome_trace",
]


class RenderError(InputError):
    """A picture that cannot be made as asked (unknown file suffix, no matplotlib, a path
    that cannot be written)."""


# ----------------------------------------------------------------------------- ASCII
_IDLE = "."


def _chunks(timeline: Timeline) -> dict[int, tuple[int, int]]:
    """Stage -> (its chunk index on its rank, how many chunks that rank holds)."""
    per_rank: dict[int, set[int]] = {}
    for e in timeline.events:
        per_rank.setdefault(e.rank, set()).add(e.action.stage)
    return {
        stage: (index, len(stages))
        for stages in per_rank.values()
        for index, stage in enumerate(sorted(stages))
    }


def _time_unit(events: Sequence[Event]) -> float:
    """The shortest work duration: one grid column per unit when it fits."""
    return min(e.duration for e in events)


def ascii(timeline: Timeline, width: int = 120) -> str:
    """A time-aligned grid, one row per rank, each action's text in its cells.

    Idle time shows as ``.``; a box is its action text followed by ``-`` up to its end and
    one blank, so adjacent boxes stay apart. When the whole timeline would not fit in
    ``width`` characters, time is squeezed and boxes shrink to ``F3`` or ``F``. Sends,
    receives and zero-length actions are left out: the grid shows where work happens.
    """
    work = [e for e in timeline.events if not e.action.is_comm and e.duration > 0]
    header = f"{timeline.name}: {timeline.num_ranks} ranks, makespan {timeline.makespan:g}"
    if not work:
        return header + "\n(no work)"
    t0 = min(e.start for e in work)
    makespan = max(e.end for e in work) - t0
    unit = _time_unit(work)
    label_width = max(len(str(e.action)) for e in work) + 1
    margin = max(len(f"r{timeline.num_ranks - 1}"), 1)
    room = max(width - margin - 2, 10)
    # Characters per time unit: room for a label in the shortest box, fewer if needed.
    fit = room * unit / makespan
    # Whole characters per unit when squeezed, so equal durations get equal boxes; below
    # two characters that would waste up to half the width, so fractions are kept.
    per_unit = min(float(label_width), float(math.floor(fit)) if fit >= 2 else fit)
    # Squeezed: every box uses the short form, so the grid reads the same everywhere.
    full = per_unit >= label_width
    chunks = _chunks(timeline)
    scale = per_unit / unit
    # Rounded before the ceiling: a squeezed grid's makespan * scale is `room` up to float
    # error, and 116.00000000001 must not become a 117th column past the width.
    columns = max(1, math.ceil(round(makespan * scale, 6)))
    rows = [header, "t".rjust(margin) + "| " + _ruler(makespan, scale, max(columns, room))]
    for rank in range(timeline.num_ranks):
        cells = [_IDLE] * columns
        for e in sorted((e for e in work if e.rank == rank), key=lambda e: e.start):
            lo = round((e.start - t0) * scale)
            hi = max(lo + 1, round((e.end - t0) * scale))
            odd = chunks[e.action.stage][0] % 2 == 1
            cells[lo:hi] = list(_box(e.action, hi - lo, full=full, odd_chunk=odd))
        rows.append(f"r{rank}".rjust(margin) + "| " + "".join(cells[:columns]))
    if not full and any(n > 1 for _, n in chunks.values()):
        rows.append("(squeezed: lower case = odd chunks of a rank, e.g. the way back up a V)")
    return "\n".join(rows)


def _ruler(makespan: float, scale: float, columns: int) -> str:
    """Tick labels at round times, spaced at least 8 characters apart, within ``columns``
    (the room the width leaves: a last label may stand past the grid, not past the width)."""
    least = 8 / scale  # time that 8 characters cover
    decade = 10.0 ** math.floor(math.log10(least))
    step = next(m * decade for m in (1.0, 2.0, 5.0, 10.0) if m * decade >= least)
    line = [" "] * columns
    tick = 0.0
    while tick <= makespan:
        col = round(tick * scale)
        text = f"{tick:g}"
        # A label that would run past the grid is left out, not cut: "20" for 200 misleads.
        if col + len(text) > columns:
            break
        line[col : col + len(text)] = list(text)
        tick += step
    return "".join(line).rstrip()


def _box(action: Action, width: int, *, full: bool, odd_chunk: bool = False) -> str:
    """``width`` characters for one action: its text (or ``F3``, ``f3`` on an odd chunk,
    when squeezed), else its kind letter."""
    mb = "" if action.microbatch is None else str(action.microbatch)
    kind = action.kind.value.lower() if odd_chunk else action.kind.value
    label = str(action) if full else f"{kind}{mb}"
    if len(label) < width:
        return label + "-" * (width - len(label) - 1) + " "
    if len(label) == width:
        return label
    return kind[:width].ljust(width)


# ---------------------------------------------------------------------- Chrome trace
@dataclass(frozen=True)
class Transfer:
    """One message between ranks as the replay times it: it leaves ``src`` when
    ``carries`` ends there and reaches ``dst`` one transfer later, for ``needed_by``."""

    src: int
    dst: int
    start: float
    end: float
    carries: Action
    needed_by: Action


def transfers(timeline: Timeline, placement: Placement, transfer: float) -> tuple[Transfer, ...]:
    """The messages of ``timeline`` that take time (``transfer`` each, ``Costs.transfer()``).

    The same edges the replay delays (``pipetrain.schedules.execution``): every
    requirement that crosses ranks, timed from the end of the action it waits for. None
    when ``transfer`` is 0: free messages are not worth a slice.
    """
    if transfer <= 0:
        return ()
    lowered = any(e.action.is_comm for e in timeline.events)
    # The first run of an action is the one the replay's dependents wait for.
    done: dict[Action, Event] = {}
    for e in timeline.events:
        done.setdefault(e.action, e)
    out: list[Transfer] = []
    for e in timeline.events:
        if e.action.kind is Kind.ALLREDUCE:  # a collective, timed as its own event
            continue
        for req in requirements(e.action, placement, lowered=lowered):
            if not req.transfer:
                continue
            dep = next((done[a] for a in req.alternatives if a in done), None)
            if dep is not None:
                out.append(
                    Transfer(dep.rank, e.rank, dep.end, dep.end + transfer, dep.action, e.action)
                )
    return tuple(out)


def _lanes(spans: list[tuple[float, float]]) -> list[int]:
    """A lane for each span so that spans in one lane never overlap: a track's slices
    must nest, and two messages in flight at once do not."""
    ends: list[float] = []
    lane_of = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        start, end = spans[i]
        lane = next((k for k, last in enumerate(ends) if last <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        else:
            ends[lane] = end
        lane_of[i] = lane
    return lane_of


def _on_comm_track(action: Action) -> bool:
    return action.is_comm or action.kind is Kind.ALLREDUCE


def _thread(pid: int, tid: int, name: str, order: int) -> list[dict[str, Any]]:
    return [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}},
        {
            "name": "thread_sort_index",
            "ph": "M",
            "pid": pid,
            "tid": tid,
            "args": {"sort_index": order},
        },
    ]


def _comm_events(
    pid: int,
    tl: Timeline,
    messages: Sequence[Transfer],
    links: Sequence[LinkSpan],
    us_per_unit: float,
) -> list[dict[str, Any]]:
    """Sends, receives, timed all-reduces and dp collectives on comm tracks, with an
    arrow per message.

    Lane k of rank r is thread ``(k + 1) * num_ranks + r``, so the compute tracks keep
    thread = rank; it sorts right below rank r's compute track.
    """
    # (rank, start, end, name, category, args, flow: (message id, "s" or "f") or None)
    slices: list[tuple[int, float, float, str, str, dict[str, Any], tuple[int, str] | None]] = []
    for i, m in enumerate(messages):
        if m.end <= m.start:
            continue
        what = {"carries": str(m.carries), "for": str(m.needed_by), "from": m.src, "to": m.dst}
        # A lowered schedule's message goes from its SEND to its RECV: they name it.
        send = str(m.carries) if m.carries.is_comm else f"send {m.carries}"
        recv = str(m.needed_by) if m.needed_by.is_comm else f"recv {m.carries}"
        slices.append((m.src, m.start, m.end, send, "send", what, (i, "s")))
        slices.append((m.dst, m.start, m.end, recv, "recv", what, (i, "f")))
    for e in tl.events:
        # A simulated send or receive is a point (its time is in ``messages``); a measured
        # one, or a timed all-reduce, is a slice of its own.
        if _on_comm_track(e.action) and e.duration > 0:
            a = e.action
            args = {"stage": a.stage, "kind": a.kind.value, "microbatch": a.microbatch}
            slices.append((e.rank, e.start, e.end, str(a), _category(a.kind), args, None))
    for span in links:
        if span.end > span.start:
            slices.append((span.rank, span.start, span.end, span.name, "dp", {}, None))
    events: list[dict[str, Any]] = []
    named: set[int] = set()
    for rank in range(tl.num_ranks):
        mine = [s for s in slices if s[0] == rank]
        for (_, start, end, name, cat, args, flow), lane in zip(
            mine, _lanes([(s[1], s[2]) for s in mine]), strict=True
        ):
            tid = (lane + 1) * tl.num_ranks + rank
            if tid not in named:
                named.add(tid)
                label = f"rank {rank} comm" + (f" {lane + 1}" if lane else "")
                events.extend(_thread(pid, tid, label, rank * 1000 + lane + 1))
            ts = start * us_per_unit
            events.append(
                {
                    "name": name,
                    "cat": cat,
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": ts,
                    "dur": (end - start) * us_per_unit,
                    "args": args,
                }
            )
            if flow is not None:
                # An arrow from the send to its receive; "e" binds it to the enclosing slice.
                ident, phase = flow
                events.append(
                    {
                        "name": "message",
                        "cat": "flow",
                        "ph": phase,
                        "id": f"{pid}:{ident}",
                        "bp": "e",
                        "pid": pid,
                        "tid": tid,
                        "ts": ts,
                    }
                )
    return events


def chrome_trace(
    timelines: Timeline | Sequence[Timeline],
    *,
    us_per_unit: float = 1000.0,
    messages: Sequence[Sequence[Transfer]] | None = None,
    links: Sequence[Sequence[LinkSpan]] | None = None,
) -> dict[str, Any]:
    """Chrome trace JSON (Perfetto, chrome://tracing): process = schedule, thread = rank.

    Every event is a complete event named by the action text with its stage, kind and
    micro-batch in ``args``; a counter per rank follows its live activations (in stage x
    micro-batch units). ``us_per_unit`` converts timeline units to microseconds (the
    default shows one simulated unit as one millisecond; measured seconds want 1e6).

    ``messages``, one sequence per timeline (``transfers``), puts each message on a comm
    track of its sender ("send") and of its receiver ("recv"), linked by a flow arrow;
    timed all-reduces go there too, and ``links`` (one sequence per timeline), the dp
    collectives. Communication of zero length is left out (see the module docstring).
    """
    group = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    sent: list[Sequence[Transfer]] = [()] * len(group) if messages is None else list(messages)
    dp: list[Sequence[LinkSpan]] = [()] * len(group) if links is None else list(links)
    if not len(sent) == len(dp) == len(group):
        raise ValueError(
            f"{len(sent)} message and {len(dp)} link lists for {len(group)} timelines: "
            "give one each"
        )
    events: list[dict[str, Any]] = []
    for pid, (tl, tl_messages, tl_links) in enumerate(zip(group, sent, dp, strict=True)):
        events.append(
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": tl.name}}
        )
        for rank in range(tl.num_ranks):
            events.extend(_thread(pid, rank, f"rank {rank}", rank * 1000))
        for e in tl.events:
            a = e.action
            if _on_comm_track(a):
                continue
            events.append(
                {
                    "name": str(a),
                    "cat": _category(a.kind),
                    "ph": "X",
                    "pid": pid,
                    "tid": e.rank,
                    "ts": e.start * us_per_unit,
                    "dur": e.duration * us_per_unit,
                    "args": {"stage": a.stage, "kind": a.kind.value, "microbatch": a.microbatch},
                }
            )
        events.extend(_comm_events(pid, tl, tl_messages, tl_links, us_per_unit))
        # One counter track per rank: live activations over time, beside the actions.
        for rank, curve in enumerate(live_activations(tl)):
            for time, level in curve:
                events.append(
                    {
                        "name": f"activations rank {rank}",
                        "ph": "C",
                        "pid": pid,
                        "ts": time * us_per_unit,
                        "args": {"live": level},
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    timelines: Timeline | Sequence[Timeline],
    path: str | Path,
    *,
    us_per_unit: float = 1000.0,
    messages: Sequence[Sequence[Transfer]] | None = None,
    links: Sequence[Sequence[LinkSpan]] | None = None,
) -> Path:
    """Write ``chrome_trace`` of the same arguments to ``path`` and return the path."""
    out = Path(path)
    trace = chrome_trace(timelines, us_per_unit=us_per_unit, messages=messages, links=links)
    text = json.dumps(trace) + "\n"
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise _unwritable(out, exc) from exc
    return out


def _unwritable(out: Path, exc: OSError) -> RenderError:
    """The one line for a picture or trace that cannot be written where asked."""
    reason = exc.strerror or str(exc)
    return RenderError(f"cannot write {str(out)!r}: {reason}: pick a writable file path")


def _category(kind: Kind) -> str:
    if kind in (Kind.F, Kind.B, Kind.I, Kind.W):
        return "compute"
    if kind in (Kind.ALLREDUCE, Kind.STEP):
        return "step"
    return "comm"


# -------------------------------------------------------------------------- matplotlib
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
    chunks = _chunks(tl)
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
        raise _unwritable(out, exc) from exc
    return out
