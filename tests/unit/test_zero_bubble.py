"""ZB-H1, ZB-H2 and ZB-V: exact programs for small cases, the published bubbles and memory,
and the structural properties for many sizes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedules import Kind, Schedule, ScheduleError
from pipetrain.schedules.execution import Costs, replay
from pipetrain.schedules.grid import format_timeline
from pipetrain.schedules.validate import validate
from pipetrain.schedules.zero_bubble import check_zb_h1, check_zb_h2, check_zb_v, zb_h1, zb_h2, zb_v
from pipetrain.sim.metrics import peak_activations, rank_times

UNIT = Costs()
# F + I > 2W, so every term of the formulas shows: (p-1)(F+I-W) = 3(p-1), (p-1)(F+I-2W) = 2(p-1).
HEAVY = Costs(forward=2.0, backward=3.0, backward_input=2.0, backward_weight=1.0)


def span_bubble(schedule: Schedule, costs: Costs = UNIT) -> float:
    """Per-rank-span bubble, worst rank (Zero Bubble's definition)."""
    return max(rank_times(replay(schedule, costs)).span_idle)


def texts(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in row) for row in schedule.actions]


def assert_split_backward_complete(schedule: Schedule) -> None:
    """Every (stage, micro-batch) has exactly one F, one I and one W, on the stage's rank,
    and nothing else."""
    pl = schedule.placement
    seen: Counter[tuple[int, Kind, int | None]] = Counter()
    for rank, _, a in schedule.enumerate_actions():
        assert pl.rank_of(a.stage) == rank, f"{a} on rank {rank}"
        seen[(a.stage, a.kind, a.microbatch)] += 1
    expected = {
        (s, kind, k): 1
        for s in range(pl.num_stages)
        for kind in (Kind.F, Kind.I, Kind.W)
        for k in range(schedule.microbatches)
    }
    assert dict(seen) == expected


# ------------------------------------------------------------------------- golden
def test_zb_h1_golden() -> None:
    assert texts(zb_h1(3, 4)) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
    ]


def test_zb_h2_golden() -> None:
    assert texts(zb_h2(3, 5)) == [
        "0F0 0F1 0F2 0F3 0F4 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4",
        "1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1W0 1I3 1W1 1I4 1W2 1W3 1W4",
        "2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2F4 2I4 2W0 2W1 2W2 2W3 2W4",
    ]


def test_zb_v_golden() -> None:
    assert texts(zb_v(2, 3)) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2",
    ]


def test_zb_v_golden_p3() -> None:
    assert texts(zb_v(3, 5)) == [
        "0F0 0F1 0F2 0F3 0F4 5F0 5I0 5W0 5F1 5I1 5W1 5F2 5I2 5W2 0I0 0W0 5F3 5I3 5W3 "
        "0I1 0W1 5F4 5I4 5W4 0I2 0W2 0I3 0W3 0I4 0W4",
        "1F0 1F1 1F2 4F0 1F3 4F1 4I0 4W0 4F2 4I1 4W1 1F4 1I0 1W0 4F3 4I2 4W2 1I1 1W1 "
        "4F4 4I3 4W3 1I2 4I4 1I3 1W2 1I4 1W3 4W4 1W4",
        "2F0 3F0 2F1 3F1 2F2 3F2 3I0 3W0 2F3 2I0 2W0 3F3 3I1 3W1 2F4 2I1 2W1 3F4 3I2 "
        "3W2 2I2 3I3 2I3 3I4 2I4 2W2 3W3 3W4 2W3 2W4",
    ]


@pytest.mark.parametrize(
    ("make", "p", "m"), [(zb_h1, 3, 4), (zb_h2, 3, 5), (zb_v, 2, 3)], ids=["h1", "h2", "v"]
)
def test_docstring_picture_is_the_replayed_timeline(
    make: Callable[[int, int], Schedule], p: int, m: int
) -> None:
    doc = make.__doc__
    assert doc is not None
    for line in format_timeline(replay(make(p, m))).splitlines():
        assert "        " + line + "\n" in doc


# ------------------------------------------------------------------------ formulas
SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zb_h1_bubble_and_memory(p: int, m: int) -> None:
    s = zb_h1(p, m)
    assert span_bubble(s, UNIT) == (p - 1) * (1 + 1 - 1)
    assert span_bubble(s, HEAVY) == (p - 1) * (2 + 2 - 1)
    assert peak_activations(replay(s)) == (p,) * p


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zb_h1_keeps_r_weights_pending(p: int, m: int) -> None:
    """Rank r warms up with p-1-r forwards, then never holds more than r pending W's
    until the drain."""
    for r, row in enumerate(zb_h1(p, m).actions):
        kinds = [a.kind for a in row]
        assert kinds[: p - 1 - r] == [Kind.F] * (p - 1 - r)
        assert kinds[p - 1 - r : p + 1 - r] == [Kind.F, Kind.I]
        last_f = max(i for i, k in enumerate(kinds) if k is Kind.F)
        pending = 0
        for k in kinds[: last_f + 1]:
            pending += (k is Kind.I) - (k is Kind.W)
            assert pending <= r + 1
            assert pending <= r or k is Kind.I


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in SIZES if m >= 2 * p - 1])
def test_zb_h2_bubble_and_memory(p: int, m: int) -> None:
    s = zb_h2(p, m)
    assert span_bubble(s, UNIT) == 0
    assert span_bubble(s, HEAVY) == (p - 1) * (2 + 2 - 2 * 1)
    assert peak_activations(replay(s)) == (2 * p - 1,) * p


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in SIZES if m >= 2 * p - 1])
def test_zb_h2_warm_up_and_tail(p: int, m: int) -> None:
    """Rank r runs 2(p-1-r)+1 forwards before its first I and ends with its last I and
    then 2r+1 W's: each rank's span is a parallelogram."""
    for r, row in enumerate(zb_h2(p, m).actions):
        kinds = [a.kind for a in row]
        warm = 2 * (p - 1 - r) + 1
        assert kinds[: warm + 1] == [Kind.F] * warm + [Kind.I]
        assert kinds[-(2 * r + 2) :] == [Kind.I] + [Kind.W] * (2 * r + 1)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in SIZES if m >= 2 * p - 1])
def test_zb_v_zero_bubble_and_memory(p: int, m: int) -> None:
    s = zb_v(p, m)
    assert span_bubble(s, UNIT) == 0
    # 2p chunk activations = p activations of a full (two-chunk) stage.
    assert peak_activations(replay(s)) == (2 * p,) * p


def test_zb_v_with_few_microbatches_keeps_bubbles() -> None:
    assert rank_times(replay(zb_v(4, 4))).span_idle == (6.0, 4.0, 2.0, 0.0)
    assert span_bubble(zb_v(2, 2)) > 0
    assert span_bubble(zb_v(8, 8)) > 0


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zb_v_warm_up(p: int, m: int) -> None:
    """Rank r starts with 2(p-r)-1 forwards of its first chunk (stage r)."""
    for r, row in enumerate(zb_v(p, m).actions):
        warm = min(2 * (p - r) - 1, m)
        assert [(a.stage, a.kind) for a in row[:warm]] == [(r, Kind.F)] * warm
        assert row[warm].stage == 2 * p - 1 - r


# -------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("make", "p", "m", "message"),
    [
        (zb_h1, 4, 3, "zb-h1 needs --microbatches >= --pp (got m=3, p=4): use 4 or more"),
        (
            zb_h2,
            4,
            6,
            "zb-h2 needs --microbatches >= 2 x --pp - 1 (got m=6, p=4): use 7 or more, or zb-h1",
        ),
        (zb_v, 0, 4, "zb-v needs --pp >= 1 (got 0): use 1 or more pipeline ranks"),
        (zb_h1, 2, 0, "zb-h1 needs --microbatches >= 1 (got 0): use 1 or more micro-batches"),
    ],
)
def test_constraints_are_checked_up_front(
    make: Callable[[int, int], Schedule], p: int, m: int, message: str
) -> None:
    with pytest.raises(ScheduleError) as err:
        make(p, m)
    assert str(err.value) == message


def test_checks_answer_without_building() -> None:
    """The registry asks the checks up front; None means the schedule fits."""
    assert check_zb_h1(4, 4) is None
    assert check_zb_h2(4, 7) is None
    assert check_zb_v(4, 1) is None
    assert check_zb_h1(4, 3) is not None
    assert check_zb_h2(4, 6) is not None
    assert check_zb_v(4, 0) is not None


# ----------------------------------------------------------------------- properties
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 40), st.sampled_from(["zb-h1", "zb-h2", "zb-v"]))
def test_every_schedule_is_complete_and_runs(p: int, extra: int, name: str) -> None:
    make = {"zb-h1": zb_h1, "zb-h2": zb_h2, "zb-v": zb_v}[name]
    least = {"zb-h1": p, "zb-h2": 2 * p - 1, "zb-v": 1}[name]
    s = make(p, least + extra - 1)
    assert s.name == name
    assert s.splits_backward
    assert_split_backward_complete(s)
    validate(s)
