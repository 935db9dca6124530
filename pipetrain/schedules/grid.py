"""Text pictures of a schedule: the grid of each rank's program, and a timeline.

The grid is one line per rank of action texts, with chosen steps marked.

Errors attach it so that a user sees where a schedule goes wrong::

    rank 0 | 0F0 0F1 0B0 0B1
    rank 1 | 1F0 [>1B1<] 1F1 1B0

A marked cell reads ``[>TEXT<]``. Columns are aligned by position in the rank's program,
not by time (the simulator draws time).
"""

from __future__ import annotations

from collections.abc import Collection

from pipetrain.schedules.events import Timeline
from pipetrain.schedules.schedule import Schedule

__all__ = ["format_grid", "format_timeline"]


def format_grid(
    schedule: Schedule,
    marks: Collection[tuple[int, int]] = (),
    *,
    context: int | None = None,
) -> str:
    """One line per rank; ``marks`` holds ``(rank, position)`` cells to highlight.

    With ``context`` set and some marks given, only the positions from ``context`` before
    the first mark to ``context`` after the last are shown, with ``...`` for the rest, so
    that an error on a long schedule stays readable.
    """
    marked = set(marks)
    rows = [
        ["[>" + str(a) + "<]" if (r, i) in marked else str(a) for i, a in enumerate(row)]
        for r, row in enumerate(schedule.actions)
    ]
    length = max((len(row) for row in rows), default=0)
    first, last = 0, length
    if context is not None and marked:
        first = max(0, min(pos for _, pos in marked) - context)
        last = min(length, max(pos for _, pos in marked) + context + 1)
    widths = [
        max((len(row[i]) for row in rows if i < len(row)), default=0) for i in range(first, last)
    ]
    label_width = len(f"rank {len(rows) - 1}")
    lines = []
    for r, row in enumerate(rows):
        cells = [
            row[i].ljust(w) for i, w in zip(range(first, last), widths, strict=True) if i < len(row)
        ]
        if first > 0:
            cells.insert(0, "...")
        if last < len(row):
            cells.append("...")
        lines.append(f"{f'rank {r}'.ljust(label_width)} | {' '.join(cells)}".rstrip())
    return "\n".join(lines)


def format_timeline(timeline: Timeline, unit: float = 1.0) -> str:
    """The timeline as text: one line per rank, one column per ``unit`` of time.

    An action fills one column per unit it lasts, each showing its text; ``.`` is idle
    time. Zero-length events (sends, receives) are not drawn. With the default unit costs
    (F = I = W = 1, B = 2) this is the picture in each generator's docstring::

        rank 0 | 0F0 0F1 .   .   0B0 0B0 0B1 0B1
        rank 1 | .   1F0 1F1 1B0 1B0 1B1 1B1
    """
    drawn = [e for e in timeline.events if e.end > e.start]
    width = max((len(str(e.action)) for e in drawn), default=1)
    label_width = len(f"rank {timeline.num_ranks - 1}")
    lines = []
    for rank in range(timeline.num_ranks):
        slots: dict[int, str] = {}
        for event in (e for e in drawn if e.rank == rank):
            first = round(event.start / unit)
            for slot in range(first, max(first, round(event.end / unit))):
                slots[slot] = str(event.action)
        cells = [slots.get(i, ".").ljust(width) for i in range(max(slots, default=-1) + 1)]
        lines.append(f"{f'rank {rank}'.ljust(label_width)} | {' '.join(cells)}".rstrip())
    return "\n".join(lines)
