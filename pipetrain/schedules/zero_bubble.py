"""The zero-bubble family (Qi et al., "Zero Bubble Pipeline Parallelism", 2023).

Every schedule here splits each backward into ``I`` (gradient of the stage input, which the
previous stage waits for) and ``W`` (gradient of the weights, which nobody waits for). A
``W`` can therefore slide into what would be a bubble. A micro-batch's activations stay
live from its ``F`` until its ``W``: a pending ``W`` still needs the saved inputs of its
weight-gradient products, so delaying ``W`` trades memory for bubble.

Pictures below are ``grid.format_timeline`` of the replay with unit costs (F = I = W = 1):
one column per time unit, ``.`` for idle.
"""

from __future__ import annotations

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.constraints import check_basic, raise_if
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = ["check_zb_h1", "check_zb_h2", "check_zb_v", "zb_h1", "zb_h2", "zb_v"]


def check_zb_h1(p: int, m: int, v: int = 1) -> str | None:
    basic = check_basic("zb-h1", p, m, v)
    if basic is None and m < p:
        return f"zb-h1 needs --microbatches >= --pp (got m={m}, p={p}): use {p} or more"
    return basic


def check_zb_h2(p: int, m: int, v: int = 1) -> str | None:
    basic = check_basic("zb-h2", p, m, v)
    if basic is None and m < 2 * p - 1:
        return (
            f"zb-h2 needs --microbatches >= 2 x --pp - 1 (got m={m}, p={p}): "
            f"use {2 * p - 1} or more, or zb-h1"
        )
    return basic


def check_zb_v(p: int, m: int, v: int = 2) -> str | None:
    return check_basic("zb-v", p, m, v)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B with the backward split, at 1F1B's peak memory.

    Rank ``r`` warms up with ``p-1-r`` forwards like 1F1B, then alternates ``F`` and ``I``.
    It keeps up to ``r`` ``W`` s pending (the last rank the most) and runs the oldest one
    whenever it holds more, so the backward of a micro-batch travels back up the pipeline
    as a chain of ``I`` s rather than of whole ``B`` s and reaches rank 0 sooner; the held
    ``W`` s run where a rank would otherwise wait, and drain at the end. Per-rank-span
    bubble ``(p-1)(F+I-W)`` (``p-1`` with unit costs, against 1F1B's ``(p-1)(F+B)``); every
    rank holds at most ``p`` micro-batches' activations (``p-r`` between F and I, plus ``r``
    waiting for their W), like rank 0 of 1F1B.

    p = 3, m = 4::

        rank 0 | 0F0 0F1 0F2 .   .   0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
        rank 1 | .   1F0 1F1 .   1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
        rank 2 | .   .   2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3

    Needs ``m >= p``, as 1F1B does.
    """
    raise_if(check_zb_h1(p, m))
    rows = []
    for r in range(p):
        row: list[Action] = []
        forwards = inputs = weights = 0
        for _ in range(p - 1 - r):
            row.append(Action(r, Kind.F, forwards))
            forwards += 1
        while inputs < m:
            if forwards < m:
                row.append(Action(r, Kind.F, forwards))
                forwards += 1
            row.append(Action(r, Kind.I, inputs))
            inputs += 1
            # Hold r W's back: they fill the gaps that the I's of later ranks leave.
            if inputs - weights > r:
                row.append(Action(r, Kind.W, weights))
                weights += 1
        row.extend(Action(r, Kind.W, k) for k in range(weights, m))
        rows.append(row)
    return Schedule.build("zb-h1", Placement.linear(p), m, rows)


def zb_h2(p: int, m: int) -> Schedule:
    """ZB-H2: zero bubble inside each rank's span when F = I = W, at ``2p-1`` activations.

    Rank ``r`` runs ``2(p-1-r)+1`` forwards before its first ``I`` (the extra forwards fill
    the warm-up gap that ZB-H1 leaves), and the tail ``W`` s fill the drain, so that each
    rank's busy span is a parallelogram: rank ``r`` ends with its last ``I`` followed by
    ``2r+1`` ``W`` s. Per-rank-span bubble ``(p-1)(F+I-2W)``. The price: the optimizer step
    has to be validated after the fact (the paper steps, then rolls back on a NaN or a
    clipping decision); a global barrier before the step adds back ``(p-1)F``.

    The order is that of a unit-time list schedule: at each time unit every rank runs, in
    this preference, the ``I`` of its oldest micro-batch if the next rank has sent its
    gradient; else its next ``F`` if that has arrived and the rank holds fewer than
    ``2p-1`` micro-batches; else its oldest pending ``W``; else it idles.

    p = 3, m = 5::

        rank 0 | 0F0 0F1 0F2 0F3 0F4 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4
        rank 1 | .   1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1W0 1I3 1W1 1I4 1W2 1W3 1W4
        rank 2 | .   .   2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2F4 2I4 2W0 2W1 2W2 2W3 2W4

    Needs ``m >= 2p-1`` (fewer micro-batches cannot fill the warm-up; use ZB-H1).
    """
    raise_if(check_zb_h2(p, m))
    limit = 2 * p - 1
    rows: list[list[Action]] = [[] for _ in range(p)]
    forwards = [0] * p
    inputs = [0] * p
    weights = [0] * p
    # Time unit at which each I ends (the previous rank's I waits for it); forwards are
    # looked up the same way.
    input_end: dict[tuple[int, int], int] = {}
    forward_end: dict[tuple[int, int], int] = {}
    t = 0
    while any(w < m for w in weights):
        chosen: list[Action | None] = []
        for r in range(p):
            i, f, w = inputs[r], forwards[r], weights[r]
            if i < f and (r == p - 1 or input_end.get((r + 1, i), t + 1) <= t):
                chosen.append(Action(r, Kind.I, i))
            elif f < m and f - w < limit and (r == 0 or forward_end.get((r - 1, f), t + 1) <= t):
                chosen.append(Action(r, Kind.F, f))
            elif w < i:
                chosen.append(Action(r, Kind.W, w))
            else:
                chosen.append(None)
        for r, action in enumerate(chosen):
            if action is None:
                continue
            rows[r].append(action)
            if action.kind is Kind.F:
                forward_end[(r, forwards[r])] = t + 1
                forwards[r] += 1
            elif action.kind is Kind.I:
                input_end[(r, inputs[r])] = t + 1
                inputs[r] += 1
            else:
                weights[r] += 1
        t += 1
    return Schedule.build("zb-h2", Placement.linear(p), m, rows)


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V: two half-size stages per rank on a V, zero bubble when F = I = W, m >= 2p-1.

    Rank ``r`` holds stage ``r`` (chunk 0, on the way down) and stage ``2p-1-r`` (chunk 1,
    on the way back up); rank 0 holds both the first and the last stage, so a micro-batch's
    forward turns into its backward on the same rank as it starts. Rank ``r`` runs:

    1. ``2(p-r)-1`` forwards of chunk 0;
    2. ``r`` times: ``F`` of chunk 1, ``F`` of chunk 0;
    3. ``p-r`` times: ``F``, ``I``, ``W`` of chunk 1;
    4. steady state, until every forward is done: ``F I W`` of chunk 0 (the ``F`` while
       forwards remain), then ``F I W`` of chunk 1;
    5. ``r`` times: ``I`` of chunk 0, ``I`` of chunk 1; then ``p-r`` times ``I W`` of
       chunk 0; then the pending ``W`` s of chunk 1, then of chunk 0.

    With ``m < 2p-1`` the schedule is built for ``2p-1`` micro-batches and the missing
    ones are dropped, so bubbles remain (p = 4, m = 4: the worst rank idles 6 units inside
    its span). With ``m >= 2p-1`` each rank holds at most ``2p`` chunk activations, which is
    ``p`` activations of a full stage of the linear placement: the simulator counts one
    (stage, micro-batch) as one unit, and here a stage is a half-size chunk.

    p = 2, m = 3 (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2)::

        rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2
        rank 1 | .   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2

    Any ``m >= 1`` fits.
    """
    raise_if(check_zb_v(p, m))
    # The pattern needs 2p-1 micro-batches to fill the V; with fewer, build it for 2p-1
    # and drop the ones that do not exist.
    n = max(m, 2 * p - 1)
    rows = [
        [a for a in _zb_v_rank(p, n, r) if a.microbatch is not None and a.microbatch < m]
        for r in range(p)
    ]
    return Schedule.build("zb-v", Placement.v_shape(p), m, rows)


def _zb_v_rank(p: int, n: int, r: int) -> list[Action]:
    """Rank r's ZB-V program for n >= 2p-1 micro-batches (see ``zb_v``)."""
    down, up = r, 2 * p - 1 - r
    row: list[Action] = []
    # Next micro-batch index per (stage, kind).
    nxt: dict[tuple[int, Kind], int] = {}

    def emit(stage: int, kind: Kind) -> None:
        k = nxt.get((stage, kind), 0)
        nxt[(stage, kind)] = k + 1
        row.append(Action(stage, kind, k))

    def count(stage: int, kind: Kind) -> int:
        return nxt.get((stage, kind), 0)

    for _ in range(2 * (p - r) - 1):
        emit(down, Kind.F)
    for _ in range(r):
        emit(up, Kind.F)
        emit(down, Kind.F)
    for _ in range(p - r):
        for kind in (Kind.F, Kind.I, Kind.W):
            emit(up, kind)
    while count(down, Kind.F) < n or count(up, Kind.F) < count(down, Kind.F):
        if count(down, Kind.F) < n:
            emit(down, Kind.F)
        emit(down, Kind.I)
        emit(down, Kind.W)
        for kind in (Kind.F, Kind.I, Kind.W):
            emit(up, kind)
    for _ in range(r):
        emit(down, Kind.I)
        emit(up, Kind.I)
    for _ in range(p - r):
        emit(down, Kind.I)
        emit(down, Kind.W)
    while count(up, Kind.W) < n:
        emit(up, Kind.W)
    while count(down, Kind.W) < n:
        emit(down, Kind.W)
    return row
