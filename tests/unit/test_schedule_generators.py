"""The generators: golden pictures, exact programs, and properties over many (p, m, v)."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedules import Action, Kind, Schedule, ScheduleError
from pipetrain.schedules import gpipe as gpipe_module
from pipetrain.schedules import naive as naive_module
from pipetrain.schedules import one_f_one_b as one_f_one_b_module
from pipetrain.schedules.chimera import chimera
from pipetrain.schedules.execution import replay
from pipetrain.schedules.gpipe import gpipe
from pipetrain.schedules.grid import format_grid, format_timeline
from pipetrain.schedules.interleaved import interleaved_1f1b, looped_bfs
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.naive import naive
from pipetrain.schedules.one_f_one_b import one_f_one_b
from pipetrain.schedules.pipedream import pipedream, pipedream_2bw
from pipetrain.schedules.validate import validate


def pictures(doc: str) -> list[list[str]]:
    """The blocks of ``rank N | ...`` lines in a docstring, in order."""
    blocks: list[list[str]] = []
    previous_was_rank = False
    for line in doc.splitlines():
        is_rank = line.strip().startswith("rank ")
        if is_rank and not previous_was_rank:
            blocks.append([])
        if is_rank:
            blocks[-1].append(line.strip())
        previous_was_rank = is_rank
    return blocks


GOLDEN: list[tuple[str, object, Callable[[], Schedule]]] = [
    ("naive", naive_module, lambda: naive(3)),
    ("gpipe", gpipe_module, lambda: gpipe(3, 4)),
    ("1f1b", one_f_one_b_module, lambda: one_f_one_b(3, 4)),
    ("interleaved-1f1b", interleaved_1f1b, lambda: interleaved_1f1b(2, 4, 2)),
    ("looped-bfs", looped_bfs, lambda: looped_bfs(2, 4, 2)),
    ("pipedream", pipedream, lambda: pipedream(3, 2)),
    ("pipedream-2bw", pipedream_2bw, lambda: pipedream_2bw(3, 3)),
    ("chimera", chimera, lambda: chimera(4, 4)),
]


@pytest.mark.parametrize(("name", "documented", "build"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_docstring_pictures_are_the_real_output(
    name: str, documented: object, build: Callable[[], Schedule]
) -> None:
    schedule = build()
    assert schedule.name == name
    blocks = pictures(inspect.getdoc(documented) or "")
    assert blocks, f"{name}: no picture in the docstring"
    assert blocks[0] == format_timeline(replay(schedule)).splitlines()
    if len(blocks) > 1:
        assert blocks[1] == [line.rstrip() for line in format_grid(schedule).splitlines()]


def texts(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in row) for row in schedule.actions]


def test_golden_programs() -> None:
    assert texts(one_f_one_b(2, 3)) == ["0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"]
    assert texts(interleaved_1f1b(2, 2, 2)) == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1",
    ]
    assert texts(looped_bfs(2, 2, 2)) == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1",
    ]
    assert texts(pipedream_2bw(2, 2, steps=2)) == [
        "0F0 0F1 0B0 0F2 0B1 0STEP1 0F3 0B2 0B3 0STEP3",
        "1F0 1B0 1F1 1B1 1STEP1 1F2 1B2 1F3 1B3 1STEP3",
    ]
    assert texts(chimera(2, 2)) == [
        "0F0 3F1 3B1 0B0 3ALLREDUCE 0ALLREDUCE",
        "2F1 1F0 1B0 2B1 1ALLREDUCE 2ALLREDUCE",
    ]


def check_complete(schedule: Schedule) -> None:
    """Validates plain and lowered (which replays both to the end: no stall), and runs each
    (stage, micro-batch) of one replica chain exactly once: one F, and one B or one I + W."""
    validate(schedule)
    lowered = lower(schedule)
    validate(lowered)
    assert lower(lowered) == lowered
    placement = schedule.placement
    count = Counter(
        (a.stage, a.kind, a.microbatch) for _, _, a in schedule.enumerate_actions() if a.is_compute
    )
    replica_of_mb = {mb: placement.replica(stage) for stage, _, mb in count}
    assert sorted(replica_of_mb) == list(range(schedule.microbatches))
    expected = set()
    for mb, replica in replica_of_mb.items():
        for j in range(placement.num_model_stages):
            stage = replica * placement.num_model_stages + j
            split = (stage, Kind.I, mb) in count
            kinds = (Kind.F, Kind.I, Kind.W) if split else (Kind.F, Kind.B)
            expected |= {(stage, kind, mb) for kind in kinds}
    assert set(count) == expected
    assert set(count.values()) == {1}


sizes = st.integers(1, 6)


@settings(max_examples=25, deadline=None)
@given(p=sizes, m=st.integers(1, 14))
def test_linear_generators_are_complete(p: int, m: int) -> None:
    check_complete(naive(p, m))
    check_complete(gpipe(p, m))
    if m >= p:
        check_complete(one_f_one_b(p, m))
        check_complete(pipedream_2bw(p, m, steps=2))
    if 2 * m >= p:
        check_complete(pipedream(p, m))


@settings(max_examples=25, deadline=None)
@given(p=sizes, m=st.integers(1, 12), v=st.integers(1, 3))
def test_looped_generators_are_complete(p: int, m: int, v: int) -> None:
    check_complete(looped_bfs(p, m, v))
    if m % max(1, m // p) == 0:
        check_complete(interleaved_1f1b(p, m, v))
    else:
        with pytest.raises(ScheduleError, match="equal groups"):
            interleaved_1f1b(p, m, v)


@settings(max_examples=20, deadline=None)
@given(half_p=st.integers(1, 4), m=st.integers(2, 16))
def test_chimera_is_complete(half_p: int, m: int) -> None:
    schedule = chimera(2 * half_p, m)
    check_complete(schedule)
    down = {a.microbatch for _, _, a in schedule.enumerate_actions() if a.stage < 2 * half_p}
    assert down - {None} == set(range((m + 1) // 2))  # the first half goes down


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_one_f_one_b_memory_and_makespan(p: int) -> None:
    for m in (p, 2 * p, 4 * p):
        schedule = one_f_one_b(p, m)
        assert replay(schedule).makespan == (m + p - 1) * 3  # (m + p - 1)(F + B)
        assert replay(gpipe(p, m)).makespan == (m + p - 1) * 3
        for r, row in enumerate(schedule.actions):
            live = peak = 0
            for a in row:
                live += 1 if a.kind is Kind.F else -1
                peak = max(peak, live)
            assert peak == min(p - r, m)


@pytest.mark.parametrize(("p", "v"), [(2, 2), (4, 2), (4, 3), (8, 2)])
def test_interleaved_warmup_and_makespan(p: int, v: int) -> None:
    for m in (p, 2 * p, 4 * p):
        schedule = interleaved_1f1b(p, m, v)
        for r, row in enumerate(schedule.actions):
            warmup = min(2 * (p - 1 - r) + (v - 1) * p, m * v)
            first_backward = next(i for i, a in enumerate(row) if a.kind is Kind.B)
            # After the warm-up, one more forward precedes the first backward, if any is left.
            assert first_backward == (warmup + 1 if warmup < m * v else warmup)
        # Bubble (p-1)(F+B)/v of a whole model stage = (p-1)(F+B) in chunk costs.
        assert replay(schedule).makespan == m * v * 3 + (p - 1) * 3
        assert replay(looped_bfs(p, m, v)).makespan == m * v * 3 + (p - 1) * 3


@pytest.mark.parametrize(("p", "m"), [(4, 5), (4, 6), (4, 10), (8, 12)])
def test_interleaved_relaxed_groups_keep_the_bubble(p: int, m: int) -> None:
    assert replay(interleaved_1f1b(p, m, 2)).makespan == m * 2 * 3 + (p - 1) * 3


def test_pipedream_steps_after_every_backward() -> None:
    schedule = pipedream(4, 3, steps=2)
    assert schedule.asynchronous and schedule.microbatches == 6
    assert dict(schedule.params) == {"steps": 2, "window": 3}
    for row in schedule.actions:
        for i, a in enumerate(row):
            if a.kind is Kind.B:
                assert row[i + 1] == Action(a.stage, Kind.STEP, a.microbatch)
        assert sum(a.kind is Kind.STEP for a in row) == 6


def test_pipedream_2bw_steps_once_per_window() -> None:
    schedule = pipedream_2bw(3, 4, steps=3)
    for r, row in enumerate(schedule.actions):
        steps = [a for a in row if a.kind is Kind.STEP]
        assert steps == [Action(r, Kind.STEP, k) for k in (3, 7, 11)]


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_chimera_makespan_and_memory(p: int) -> None:
    for m in (p, 2 * p, 4 * p):
        schedule = chimera(p, m)
        # As documented: m(F+B) + (p/2-1)(F+B) + (p/2-1)F with unit costs.
        assert replay(schedule).makespan == 3 * m + 4 * (p // 2 - 1)
        peaks = []
        for row in schedule.actions:
            live = peak = 0
            for a in row:
                live += {Kind.F: 1, Kind.B: -1}.get(a.kind, 0)
                peak = max(peak, live)
            peaks.append(peak)
        assert max(peaks) == p  # the two stages of a rank together: at most p
        assert min(peaks) == (p // 2 + 1 if m == p else p)


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: one_f_one_b(4, 3), "1f1b needs --microbatches >= --pp (got m=3, p=4)"),
        (lambda: gpipe(0, 3), "gpipe needs --pp >= 1"),
        (lambda: naive(2, 0), "naive needs --microbatches >= 1"),
        (lambda: interleaved_1f1b(4, 9, 2), "use --microbatches 8 or 10"),
        (lambda: looped_bfs(4, 8, 0), "looped-bfs needs --chunks >= 1"),
        (lambda: chimera(3, 4), "chimera needs an even --pp (got p=3)"),
        (lambda: chimera(4, 1), "chimera needs --microbatches >= 2"),
        (lambda: pipedream(8, 3), "raise --microbatches to 4"),
        (lambda: pipedream_2bw(4, 3), "pipedream-2bw needs --microbatches >= --pp"),
    ],
)
def test_constraint_errors(build: Callable[[], Schedule], fragment: str) -> None:
    with pytest.raises(ScheduleError) as info:
        build()
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)
