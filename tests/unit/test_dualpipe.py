"""DualPipeV: the exact programs of a small case, the published bubble and memory, and the
structural properties for many sizes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedules import Action, Kind, Schedule, ScheduleError
from pipetrain.schedules.dualpipe import (
    check_dualpipe_v,
    dualpipe_v,
    dualpipe_v_lowered,
    overlapped_pairs,
)
from pipetrain.schedules.execution import Costs, replay
from pipetrain.schedules.grid import format_timeline
from pipetrain.schedules.validate import validate
from pipetrain.sim.metrics import peak_activations, rank_times

UNIT = Costs()
# Costs where every term of the formulas shows (F&B = F + B: no overlap gain).
HEAVY = Costs(forward=2.0, backward=3.0, backward_input=2.0, backward_weight=1.0)
LIGHT_W = Costs(forward=1.0, backward=1.5, backward_input=1.0, backward_weight=0.5)
SIZES = [(p, m) for p in (2, 4, 8) for m in (2 * p, 4 * p)]


def span_bubble(schedule: Schedule, costs: Costs) -> float:
    """Per-rank-span bubble, worst rank (DualPipe's definition)."""
    return max(rank_times(replay(schedule, costs)).span_idle)


def texts(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in row) for row in schedule.actions]


def test_golden_p2_m4() -> None:
    """The programs drawn in the docstring, pairs in brackets."""
    s = dualpipe_v(2, 4)
    pairs = overlapped_pairs(2, 4)
    bracketed = []
    for rank, row in enumerate(s.actions):
        cells = []
        for i, a in enumerate(row):
            if i in pairs[rank]:
                cells.append(f"[{a}")
            elif i - 1 in pairs[rank]:
                cells.append(f"{a}]")
            else:
                cells.append(str(a))
        bracketed.append(" ".join(cells))
    assert bracketed == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 [0F3 3B1] [3F2 0B0] 3B2 [3F3 0B1] 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 [2F2 1B0] [1F3 2B1] [2F3 1B1] 2B2 1B2 2I3 1I3 2W3 1W3",
    ]
    doc = dualpipe_v.__doc__
    assert doc is not None
    for rank, line in enumerate(bracketed):
        assert f"rank {rank} | {line}\n" in doc


def test_docstring_picture_is_the_replayed_timeline() -> None:
    doc = dualpipe_v.__doc__
    assert doc is not None
    for line in format_timeline(replay(dualpipe_v(2, 4))).splitlines():
        assert "        " + line + "\n" in doc


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_published_bubble_with_pairs_as_blocks(p: int, m: int) -> None:
    """(p_s/2 - 1)(F&B + B - 3W) with p_s = 2p stages (DualPipe's rank count, which the V
    folds onto p ranks) and F&B = F + B, when each pair receives both inputs before it and
    sends both outputs after it."""
    s = dualpipe_v_lowered(p, m)
    validate(s)
    for c in (UNIT, HEAVY, LIGHT_W):
        f, b, w = (c.compute(kind, 0) for kind in (Kind.F, Kind.B, Kind.W))
        p_s = 2 * p
        assert span_bubble(s, c) == (p_s / 2 - 1) * ((f + b) + b - 3 * w)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_compute_only_bubble_when_forward_output_leaves_early(p: int, m: int) -> None:
    """Replayed without the pairs' message placement, a pair's forward output leaves at
    the end of the forward, which saves I on every hop: (p-1)(F + B - 2W)."""
    s = dualpipe_v(p, m)
    for c in (UNIT, HEAVY, LIGHT_W):
        f, b, w = (c.compute(kind, 0) for kind in (Kind.F, Kind.B, Kind.W))
        assert span_bubble(s, c) == (p - 1) * (f + b - 2 * w)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_peak_activations(p: int, m: int) -> None:
    """p_s + 1 = 2p + 1 chunk activations on every rank, both replays."""
    assert peak_activations(replay(dualpipe_v(p, m))) == (2 * p + 1,) * p
    assert peak_activations(replay(dualpipe_v_lowered(p, m))) == (2 * p + 1,) * p


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_pairs_join_a_forward_and_a_backward_of_the_other_chunk(p: int, m: int) -> None:
    s = dualpipe_v(p, m)
    for rank, starts in enumerate(overlapped_pairs(p, m)):
        row = s.actions[rank]
        # Phases 4 and 5: 2(m-2p+r+1) + (p-1-r) pairs, one fewer on the last rank.
        expected = 2 * (m - 2 * p + rank + 1) + (p - 1 - rank) - (rank == p - 1)
        assert len(starts) == expected
        for i in starts:
            forward, backward = row[i], row[i + 1]
            assert forward.kind is Kind.F
            assert backward.kind in (Kind.B, Kind.I)
            assert forward.stage != backward.stage
            assert forward.microbatch != backward.microbatch


def test_lowered_keeps_the_compute_order() -> None:
    lowered = dualpipe_v_lowered(4, 8)
    assert lowered.is_lowered
    assert lowered.compute_only() == dualpipe_v(4, 8)


@pytest.mark.parametrize(("p", "m"), [(2, 3), (4, 4), (4, 7), (8, 8)])
def test_too_few_microbatches(p: int, m: int) -> None:
    with pytest.raises(ScheduleError) as err:
        dualpipe_v(p, m)
    assert str(err.value) == (
        f"dualpipe-v needs --microbatches >= 2 x --pp (got m={m}, p={p}): use {2 * p} or more"
    )
    with pytest.raises(ScheduleError):
        dualpipe_v_lowered(p, m)


def test_no_ranks() -> None:
    with pytest.raises(ScheduleError) as err:
        dualpipe_v(0, 4)
    assert str(err.value) == "dualpipe-v needs --pp >= 1 (got 0): use 1 or more pipeline ranks"
    assert check_dualpipe_v(0, 4) == str(err.value)
    assert check_dualpipe_v(4, 8) is None


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 8), st.integers(0, 20))
def test_every_schedule_is_complete_and_runs(p: int, extra: int) -> None:
    """Each (stage, micro-batch) gets one F and either one B or one I and one W, on the
    stage's rank; both forms validate (which replays them to the end)."""
    m = 2 * p + extra
    s = dualpipe_v(p, m)
    placement = s.placement
    seen: Counter[Action] = Counter()
    for rank, _, a in s.enumerate_actions():
        assert placement.rank_of(a.stage) == rank
        seen[a] += 1
    assert set(seen.values()) == {1}
    for stage in range(2 * p):
        for k in range(m):
            assert Action(stage, Kind.F, k) in seen
            whole = Action(stage, Kind.B, k) in seen
            split = Action(stage, Kind.I, k) in seen, Action(stage, Kind.W, k) in seen
            assert split == (not whole, not whole)
    assert s.splits_backward
    validate(s)
    validate(dualpipe_v_lowered(p, m))
