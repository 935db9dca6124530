"""The text grid of a timeline: one row per rank, each action's text in its cells."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipetrain.schedules.actions import Action
from pipetrain.schedules.execution import Event, Timeline
from pipetrain.sim.render.base import rank_chunks

__all__ = ["text_grid"]

_IDLE = "."


def _time_unit(events: Sequence[Event]) -> float:
    """The shortest work duration: one grid column per unit when it fits."""
    return min(e.duration for e in events)


def text_grid(timeline: Timeline, width: int = 120) -> str:
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
    chunks = rank_chunks(timeline)
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
