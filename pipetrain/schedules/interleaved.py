"""Schedules with v stages per rank on a looped placement (stage s on rank s mod p).

- Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): micro-batches move depth first,
  in groups, through chunk 0, then chunk 1, ...; a 1F1B steady phase follows a longer
  warm-up. Bubble ``(p-1)(F+B)/v``.
- Looped BFS (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism"): breadth first, all
  m micro-batches through chunk 0, then chunk 1, ...; then the backwards, last chunk first.
  The same bubble as interleaved, with GPipe's memory: every rank holds all ``m v`` chunk
  activations at its peak.
"""

from __future__ import annotations

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.constraints import check_basic, raise_if
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = [
    "check_interleaved_1f1b",
    "check_looped_bfs",
    "interleaved_1f1b",
    "looped_bfs",
]


def _group_size(p: int, m: int) -> int:
    """Micro-batches per depth-first group: p when m is a multiple of p (Megatron), else
    m split into ``max(1, m // p)`` equal groups (PyTorch's relaxation)."""
    return m // max(1, m // p)


def _splits(p: int, m: int) -> bool:
    return m % max(1, m // p) == 0


def check_interleaved_1f1b(p: int, m: int, v: int = 2) -> str | None:
    basic = check_basic("interleaved-1f1b", p, m, v)
    if basic is not None:
        return basic
    if not _splits(p, m):
        lower = next(k for k in range(m - 1, 0, -1) if _splits(p, k))
        upper = next(k for k in range(m + 1, m + p + 1) if _splits(p, k))
        return (
            f"interleaved-1f1b splits --microbatches into max(1, m // p) equal groups (got "
            f"m={m}, p={p}): use --microbatches {lower} or {upper}, or a multiple of --pp"
        )
    return None


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B on ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank.

    With group size ``g`` (``p`` when ``p`` divides ``m``), rank r's k-th forward is chunk
    ``(k // g) mod v`` of micro-batch ``(k // (g v)) g + k mod g``; its backwards visit the
    chunks in reverse. Rank r warms up with ``min(2(p-1-r) + (v-1) g, m v)`` forwards, then
    alternates one forward and one backward, then drains. Megatron requires ``m mod p == 0``;
    like PyTorch this accepts any m that splits into ``max(1, m // p)`` equal groups. With
    unit costs every ``m >= p`` keeps the bubble at ``(p-1)`` chunk ``F+B`` (e.g. p = 4,
    m = 6: groups of 6); ``m < p`` leaves ranks waiting for the wrap-around.

    p = 2, m = 4, v = 2 (stages 0, 2 on rank 0; 1, 3 on rank 1; unit costs F = 1, B = 2)::

        rank 0 | 0F0 0F1 2F0 2F1 0F2 .   2B0 2B0 0F3 2B1 2B1 2F2 0B0 0B0 2F3 0B1 0B1 .   2B2 2B2 .   2B3 2B3 0B2 0B2 0B3 0B3
        rank 1 | .   1F0 1F1 3F0 3B0 3B0 3F1 3B1 3B1 1F2 1B0 1B0 1F3 1B1 1B1 3F2 3B2 3B2 3F3 3B3 3B3 1B2 1B2 1B3 1B3
    """
    raise_if(check_interleaved_1f1b(p, m, v))
    group = _group_size(p, m)
    rows = [_interleaved_rank(p, m, v, group, r) for r in range(p)]
    return Schedule.build(
        "interleaved-1f1b", Placement.looped(p, v), m, rows, params={"v": v, "group": group}
    )


def _interleaved_rank(p: int, m: int, v: int, group: int, r: int) -> list[Action]:
    def nth(kind: Kind, k: int) -> Action:
        """Rank r's k-th action of ``kind``: forwards go up the chunks, backwards down."""
        step = (k // group) % v
        chunk = step if kind is Kind.F else v - 1 - step
        return Action(chunk * p + r, kind, (k // (group * v)) * group + k % group)

    total = m * v
    warmup = min(2 * (p - 1 - r) + (v - 1) * group, total)
    row = [nth(Kind.F, k) for k in range(warmup)]
    for k in range(total - warmup):
        row += [nth(Kind.F, warmup + k), nth(Kind.B, k)]
    row += [nth(Kind.B, k) for k in range(total - warmup, total)]
    return row


def check_looped_bfs(p: int, m: int, v: int = 2) -> str | None:
    return check_basic("looped-bfs", p, m, v)


def looped_bfs(p: int, m: int, v: int = 2) -> Schedule:
    """Looped BFS on ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank.

    Rank r runs the forward of every micro-batch through its chunk 0 (stage r), then chunk
    1 (stage p + r), ...; then the backwards, chunk v-1 first, micro-batches in order.

    p = 2, m = 4, v = 2 (unit costs F = 1, B = 2)::

        rank 0 | 0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 .   .   .   2B0 2B0 2B1 2B1 2B2 2B2 2B3 2B3 0B0 0B0 0B1 0B1 0B2 0B2 0B3 0B3
        rank 1 | .   1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B0 3B0 3B1 3B1 3B2 3B2 3B3 3B3 1B0 1B0 1B1 1B1 1B2 1B2 1B3 1B3
    """
    raise_if(check_looped_bfs(p, m, v))
    rows = []
    for r in range(p):
        chunks = [c * p + r for c in range(v)]
        row = [Action(s, Kind.F, k) for s in chunks for k in range(m)]
        row += [Action(s, Kind.B, k) for s in reversed(chunks) for k in range(m)]
        rows.append(row)
    return Schedule.build("looped-bfs", Placement.looped(p, v), m, rows, params={"v": v})
