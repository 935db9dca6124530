"""Processes that share cores: a replayed timeline's segments shrink where the bubble frees
cores, and keep their length where every process is busy or nothing computes."""

from __future__ import annotations

import pytest

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.events import Event, Timeline
from pipetrain.sim.shared_cores import shared_core_makespan, shared_speedup_limit


def _work(rank: int, start: float, end: float, mb: int = 0) -> Event:
    return Event(rank, Action(rank, Kind.F, mb), start, end)


def _staggered() -> Timeline:
    # Rank 0 works over [0, 2), rank 1 over [1, 3): one busy, then both, then one.
    return Timeline("t", 2, (_work(0, 0.0, 2.0), _work(1, 1.0, 3.0)))


def test_no_change_where_every_process_has_a_core() -> None:
    t = _staggered()
    assert shared_core_makespan(t, processes_per_rank=1, processes=2, cores=2) == t.makespan
    assert shared_core_makespan(t, processes_per_rank=2, processes=4, cores=8) == t.makespan


def test_a_segment_with_cores_to_spare_runs_at_a_whole_core() -> None:
    # 2 ranks x 2 processes on 2 cores: profiled at half a core each. Alone, a rank's two
    # processes get a core each (twice as fast); together all four share (as profiled).
    made = shared_core_makespan(_staggered(), processes_per_rank=2, processes=4, cores=2)
    assert made == pytest.approx(0.5 + 1.0 + 0.5)


def test_three_busy_on_two_cores_run_at_two_thirds_of_a_core() -> None:
    t = Timeline("t", 4, tuple(_work(r, 0.0, 1.0) for r in range(3)))
    made = shared_core_makespan(t, processes_per_rank=1, processes=4, cores=2)
    assert made == pytest.approx(0.5 / (2 / 3))


def test_message_gaps_keep_their_length_and_sends_take_no_core() -> None:
    send = Event(0, Action(0, Kind.SEND_F, 0), 1.0, 1.5)
    t = Timeline("t", 2, (_work(0, 0.0, 1.0), send, _work(1, 1.5, 2.5)))
    made = shared_core_makespan(t, processes_per_rank=1, processes=4, cores=2)
    assert made == pytest.approx(0.5 + 0.5 + 0.5)


def test_the_speedup_limit_is_the_profiled_share_of_a_core() -> None:
    assert shared_speedup_limit(4, 2) == 0.5
    assert shared_speedup_limit(2, 2) == 1.0
