"""Replay, lowering and the text pictures: the engine under every other schedule tool."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipetrain.schedules import Action, Kind, Placement, Schedule, ScheduleError, parse_action
from pipetrain.schedules.execution import Costs, replay
from pipetrain.schedules.gpipe import gpipe
from pipetrain.schedules.grid import format_grid, format_timeline
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.one_f_one_b import one_f_one_b


def sched(rows: list[str], placement: Placement | None = None, m: int = 2) -> Schedule:
    actions = [[parse_action(t) for t in row.split()] for row in rows]
    return Schedule.build("t", placement or Placement.linear(len(rows)), m, actions)


def spans(schedule: Schedule, costs: Costs | None = None) -> dict[str, tuple[float, float]]:
    timeline = replay(schedule, costs or Costs())
    return {str(e.action): (e.start, e.end) for e in timeline.events}


def test_replay_times_follow_dependencies_and_costs() -> None:
    times = spans(sched(["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]))
    assert times == {
        "0F0": (0, 1),
        "0F1": (1, 2),
        "1F0": (1, 2),
        "1F1": (2, 3),
        "1B0": (3, 5),
        "1B1": (5, 7),
        "0B0": (5, 7),
        "0B1": (7, 9),
    }


def test_replay_uses_per_stage_costs_and_split_backward() -> None:
    costs = Costs(forward=(1.0, 3.0), backward_input=(2.0, 1.0), backward_weight=0.5)
    times = spans(sched(["0F0 0I0 0W0", "1F0 1I0 1W0"], m=1), costs)
    assert times == {
        "0F0": (0, 1),
        "1F0": (1, 4),
        "1I0": (4, 5),
        "1W0": (5, 5.5),
        "0I0": (5, 7),
        "0W0": (7, 7.5),
    }


def test_per_stage_costs_must_cover_every_model_stage() -> None:
    with pytest.raises(ScheduleError, match=r"costs: forward has 2 values for 3 model stages"):
        replay(gpipe(3, 2), Costs(forward=(1.0, 2.0)))


def test_events_grouped_by_rank_in_program_order() -> None:
    schedule = one_f_one_b(4, 8)
    timeline = replay(schedule)
    assert [e.rank for e in timeline.events] == sorted(e.rank for e in timeline.events)
    for rank in range(4):
        assert tuple(e.action for e in timeline.of_rank(rank)) == schedule.actions[rank]
    assert timeline.makespan == 8 * 3 + 3 * 3  # m(F+B) + (p-1)(F+B)


@pytest.mark.parametrize("latency", [0.0, 0.25, 2.0])
def test_lowered_replay_matches_compute_only(latency: float) -> None:
    costs = Costs(latency=latency, bandwidth=4.0, message_bytes=2.0)
    for schedule in (gpipe(3, 5), one_f_one_b(4, 6)):
        plain = replay(schedule, costs)
        lowered = replay(lower(schedule), costs)
        assert lowered.makespan == plain.makespan
        compute = {(e.rank, e.action): (e.start, e.end) for e in plain.events}
        assert {
            (e.rank, e.action): (e.start, e.end) for e in lowered.events if not e.action.is_comm
        } == compute


def test_transfer_cost_on_every_cross_rank_edge() -> None:
    # GPipe, p = 2, m = 1: F0 -> transfer -> F1, B1 -> transfer -> B0.
    timeline = replay(gpipe(2, 1), Costs(latency=0.5))
    assert timeline.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2


def test_same_rank_edges_cost_no_transfer() -> None:
    # Stages 0 and 1 on rank 0, stages 2 and 3 on rank 1: only the edge 1 -> 2 crosses.
    placement = Placement.custom([0, 0, 1, 1])
    schedule = sched(["0F0 1F0 1B0 0B0", "2F0 3F0 3B0 2B0"], placement, m=1)
    times = spans(schedule, Costs(latency=1.0))
    assert times["1F0"] == (1, 2)  # straight after 0F0 on the same rank
    assert times["2F0"] == (3, 4)  # one transfer after 1F0
    assert times["3F0"] == (4, 5)
    assert times["1B0"] == (10, 12)  # 2B0 ends at 9, plus one transfer


def test_sends_and_receives_take_no_rank_time() -> None:
    timeline = replay(lower(gpipe(2, 1)), Costs(latency=1.0))
    comm = {str(e.action): (e.start, e.end) for e in timeline.events if e.action.is_comm}
    assert comm == {"0SEND_F0": (1, 1), "1RECV_F0": (2, 2), "1SEND_B0": (5, 5), "0RECV_B0": (6, 6)}


def test_allreduce_starts_when_every_replica_arrives() -> None:
    placement = Placement.bidirectional(2)
    rows = ["0F0 0B0 3F1 3B1 0ALLREDUCE 3ALLREDUCE", "1F0 1B0 2F1 2B1 2ALLREDUCE 1ALLREDUCE"]
    timeline = replay(sched(rows, placement), Costs(allreduce=0.5))
    ar = {
        str(e.action): (e.rank, e.start, e.end)
        for e in timeline.events
        if e.action.kind is Kind.ALLREDUCE
    }
    ends = {r: max(e.end for e in timeline.of_rank(r) if e.action.is_compute) for r in (0, 1)}
    start = max(ends.values())
    assert ar["0ALLREDUCE"][1:] == ar["2ALLREDUCE"][1:] == (start, start + 0.5)
    assert ar["3ALLREDUCE"][1:] == ar["1ALLREDUCE"][1:] == (start + 0.5, start + 1)


def test_step_follows_its_backward() -> None:
    rows = ["0F0 0B0 0STEP0 0F1 0B1 0STEP1", "1F0 1B0 1STEP0 1F1 1B1 1STEP1"]
    times = spans(sched(rows), Costs(step=0.5))
    assert times["1STEP0"] == (4, 4.5)
    assert times["0STEP0"] == (6, 6.5)
    assert times["0F1"] == (6.5, 7.5)


def test_stall_raises_with_marked_grid() -> None:
    with pytest.raises(ScheduleError) as info:
        replay(sched(["0B0 0F0", "1F0 1B0"], m=1))
    assert "rank 0 at position 0 (0B0) waits for 0F0 (rank 0, position 1)" in str(info.value)
    assert "rank 1 at position 0 (1F0) waits for 0F0" in str(info.value)
    assert info.value.grid.splitlines()[0] == "rank 0 | [>0B0<] 0F0"


def test_stall_on_an_action_nobody_runs() -> None:
    with pytest.raises(ScheduleError, match=r"waits for 1B0 or 1I0, which no rank runs"):
        replay(sched(["0F0 0B0", "1F0"], m=1))


def test_lowering_places_messages_around_compute() -> None:
    lowered = lower(sched(["0F0 0I0 0W0", "1F0 1I0 1W0"], m=1))
    assert [str(a) for a in lowered.actions[0]] == ["0F0", "0SEND_F0", "0RECV_B0", "0I0", "0W0"]
    assert [str(a) for a in lowered.actions[1]] == ["1RECV_F0", "1F0", "1I0", "1SEND_B0", "1W0"]
    assert lower(lowered) == lowered


def test_lowering_skips_same_rank_edges_and_keeps_hand_placed_messages() -> None:
    placement = Placement.v_shape(2)  # rank 0: stages 0, 3; rank 1: stages 1, 2
    schedule = sched(["0F0 3F0 3B0 0B0", "1F0 2F0 2B0 1B0"], placement, m=1)
    lowered = lower(schedule)
    assert [str(a) for a in lowered.actions[1]] == [
        "1RECV_F0", "1F0", "2F0", "2SEND_F0", "2RECV_B0", "2B0", "1B0", "1SEND_B0",
    ]  # fmt: skip
    moved = list(lowered.actions[0])
    moved.remove(Action(0, Kind.SEND_F, 0))
    moved.insert(1, Action(0, Kind.SEND_F, 0))
    hand = Schedule.build("t", placement, 1, [moved, lowered.actions[1]])
    assert lower(hand) == hand


def test_lowered_message_order_can_differ_between_sender_and_receiver() -> None:
    # V placement, p = 2: link 0 -> 1 carries 0's activations and 3's gradients.
    placement = Placement.v_shape(2)
    rows = ["0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1", "1F0 2F0 2B0 1F1 2F1 2B1 1B0 1B1"]
    lowered = lower(sched(rows, placement))
    sent = [str(a) for a in lowered.actions[0] if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    posted = [str(a) for a in lowered.actions[1] if a.kind in (Kind.RECV_F, Kind.RECV_B)]
    assert sent == ["0SEND_F0", "0SEND_F1", "3SEND_B0", "3SEND_B1"]
    assert posted == ["1RECV_F0", "2RECV_B0", "1RECV_F1", "2RECV_B1"]
    assert replay(lowered).makespan == replay(sched(rows, placement)).makespan


def test_format_grid_context_window() -> None:
    schedule = gpipe(2, 20)
    text = format_grid(schedule, {(1, 20)}, context=2)
    assert text.splitlines()[1] == "rank 1 | ... 1F18 1F19 [>1B0<] 1B1 1B2 ..."


def test_format_timeline_shows_idle_time() -> None:
    assert format_timeline(replay(gpipe(2, 2))).splitlines() == [
        "rank 0 | 0F0 0F1 .   .   .   0B0 0B0 0B1 0B1",
        "rank 1 | .   1F0 1F1 1B0 1B0 1B1 1B1",
    ]


def test_schedule_package_imports_no_torch() -> None:
    code = (
        "import pkgutil, importlib, sys, pipetrain.schedules as s\n"
        "for m in pkgutil.iter_modules(s.__path__):\n"
        "    importlib.import_module(f'pipetrain.schedules.{m.name}')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
