"""The validator rejects each kind of broken schedule with a one-line, located message."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.errors import InputError
from pipetrain.schedules import Placement, Schedule, ScheduleError, parse_action
from pipetrain.schedules.execution import replay
from pipetrain.schedules.gpipe import gpipe
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.one_f_one_b import one_f_one_b
from pipetrain.schedules.registry import build_schedule
from pipetrain.schedules.validate import validate


def sched(
    rows: list[str],
    placement: Placement | None = None,
    m: int = 2,
    *,
    asynchronous: bool = False,
) -> Schedule:
    actions = [[parse_action(t) for t in row.split()] for row in rows]
    return Schedule.build(
        "t", placement or Placement.linear(len(rows)), m, actions, asynchronous=asynchronous
    )


def rejects(schedule: Schedule, *fragments: str) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return info.value


GOOD = ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]


def test_good_schedules_pass() -> None:
    validate(sched(GOOD))
    validate(lower(sched(GOOD)))
    validate(sched(["0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1F1 1I1 1W1 1W0"]))


def test_schedule_error_is_an_input_error() -> None:
    assert issubclass(ScheduleError, InputError)


def test_missing_forward() -> None:
    rejects(sched(["0F0 0B0 0B1", "1F0 1F1 1B0 1B1"]), "rank 0 never runs 0F1")


def test_missing_backward() -> None:
    rejects(
        sched(["0F0 0F1 0B0", "1F0 1F1 1B0 1B1"]),
        "rank 0 never runs 0B1 (the backward",
        "an I and a W",
    )


def test_micro_batch_that_never_runs() -> None:
    rejects(sched(GOOD, m=3), "micro-batch 2 never runs")


def test_duplicated_action() -> None:
    err = rejects(
        sched(["0F0 0F1 0B0 0B1 0B1", "1F0 1F1 1B0 1B1"]),
        "rank 0, position 4 (0B1)",
        "duplicates 0B1 of rank 0, position 3",
    )
    assert "[>0B1<]" in err.grid


def test_backward_before_forward() -> None:
    err = rejects(
        sched(["0F0 0B1 0F1 0B0", "1F0 1F1 1B0 1B1"]),
        "rank 0, position 1 (0B1)",
        "backward before its forward",
        "0F1 (position 2)",
    )
    assert err.grid.splitlines()[0].startswith("rank 0 | 0F0 [>0B1<] 0F1")


def test_w_before_i() -> None:
    rejects(
        sched(["0F0 0F1 0W0 0I0 0I1 0W1", "1F0 1I0 1W0 1F1 1I1 1W1"]),
        "rank 0, position 2 (0W0)",
        "W before its I",
    )


def test_b_mixed_with_i_and_w() -> None:
    rejects(sched(["0F0 0F1 0B0 0I0 0B1", "1F0 1F1 1B0 1B1"]), "mixes a full backward")


def test_w_without_i() -> None:
    rejects(sched(["0F0 0F1 0W0 0B1", "1F0 1F1 1B0 1B1"]), "never runs 0I0")


def test_stage_on_two_ranks() -> None:
    rejects(
        sched(["0F0 0F1 0B0 0B1 1F0", "1F1 1B0 1B1"]),
        "rank 0, position 4 (1F0)",
        "stage 1 belongs to rank 1",
        "two ranks",
    )


def test_unknown_stage_and_micro_batch() -> None:
    rejects(sched(["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1 2F0"]), "stage 2 does not exist")
    rejects(sched(["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1 1F7"]), "micro-batch 7 is outside 0..1")


def test_wrong_row_count() -> None:
    rejects(sched(GOOD, Placement.linear(3)), "2 rows of actions for 3 ranks")


def test_receive_with_no_send() -> None:
    lowered = lower(sched(GOOD))
    rows = [[a for a in lowered.actions[0] if str(a) != "0SEND_F1"], list(lowered.actions[1])]
    broken = Schedule.build("t", lowered.placement, 2, rows)
    rejects(
        broken, "rank 1", "(1RECV_F1)", "receive has no matching send", "add 0SEND_F1 to rank 0"
    )


def test_send_with_no_receive() -> None:
    lowered = lower(sched(GOOD))
    rows = [list(lowered.actions[0]), [a for a in lowered.actions[1] if str(a) != "1RECV_F0"]]
    broken = Schedule.build("t", lowered.placement, 2, rows)
    rejects(broken, "rank 0", "(0SEND_F0)", "send has no receive", "add 1RECV_F0 to rank 1")
    rows[0].remove(parse_action("0SEND_F0"))
    # Without the send either, the forward that lost its receive is reported with the fix.
    rejects(Schedule.build("t", lowered.placement, 2, rows), "(1F0)", "needs 1RECV_F0")
    rows[1].insert(0, parse_action("1RECV_F0"))
    rows[0].insert(rows[0].index(parse_action("0SEND_F1")) + 1, parse_action("0SEND_F0"))
    validate(Schedule.build("t", lowered.placement, 2, rows))  # sends out of order still match


def test_send_on_a_local_edge() -> None:
    rows = ["0F0 0SEND_F0 1F0 2F0 2B0 1B0 0B0", "3F0 3B0"]
    placement = Placement.custom([0, 0, 0, 1])
    rejects(sched(rows, placement, m=1), "(0SEND_F0)", "on the same rank")


def test_deadlock_names_every_stuck_rank() -> None:
    err = rejects(
        sched(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"]),
        "deadlocks",
        "rank 0 at position 1 (0B0) waits for 1B0 (rank 1, position 2)",
        "rank 1 at position 0 (1F1) waits for 0F1 (rank 0, position 2)",
    )
    assert err.grid.splitlines() == [
        "rank 0 | 0F0     [>0B0<] 0F1 0B1",
        "rank 1 | [>1F1<] 1F0     1B0 1B1",
    ]


def test_step_only_in_asynchronous_schedules() -> None:
    rows = ["0F0 0F1 0B0 0STEP0 0B1 0STEP1", "1F0 1F1 1B0 1STEP0 1B1 1STEP1"]
    rejects(sched(rows), "STEP in a synchronous schedule")
    validate(sched(rows, asynchronous=True))
    rejects(
        sched(["0F0 0F1 0STEP0 0B0 0B1", "1F0 1F1 1B0 1B1"], asynchronous=True),
        "(0STEP0)",
        "STEP before the backward",
    )


def test_allreduce_rules() -> None:
    placement = Placement.bidirectional(2)  # stages 0,1 down on ranks 0,1; 2,3 up on 1,0
    # Model stage 0 lives on stage 0 (rank 0) and stage 2 (rank 1); model stage 1 on 1 and 3.
    good = ["0F0 0B0 3F1 3B1 0ALLREDUCE 3ALLREDUCE", "1F0 1B0 2F1 2B1 2ALLREDUCE 1ALLREDUCE"]
    validate(sched(good, placement))
    rejects(
        sched(["0F0 0B0 3F1 3B1 0ALLREDUCE", good[1]], placement),
        "rank 0 never runs 3ALLREDUCE",
    )
    rejects(
        sched(["0F0 0ALLREDUCE 0B0 3F1 3B1 3ALLREDUCE", good[1]], placement),
        "(0ALLREDUCE)",
        "before 0B0",
    )
    # Partners in opposite orders: rank 0 waits in 0ALLREDUCE, rank 1 in 1ALLREDUCE.
    crossed = ["0F0 0B0 3F1 3B1 0ALLREDUCE 3ALLREDUCE", "1F0 1B0 2F1 2B1 1ALLREDUCE 2ALLREDUCE"]
    rejects(sched(crossed, placement), "deadlocks", "all-reduce partner")


def test_micro_batch_in_two_replicas() -> None:
    placement = Placement.bidirectional(2)
    rows = [
        "0F0 0B0 3F1 3B1 3F0 0ALLREDUCE 3ALLREDUCE",
        "1F0 1B0 2F1 2B1 2ALLREDUCE 1ALLREDUCE",
    ]
    rejects(sched(rows, placement), "micro-batch 0 runs in replicas [0, 1]")


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
def test_generated_schedules_pass(build: object) -> None:
    for p in (1, 2, 4):
        schedule = build(p, 2 * p)  # type: ignore[operator]
        validate(schedule)
        validate(lower(schedule))


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "chimera", "pipedream"]),
    lowered=st.booleans(),
    edits=st.lists(
        st.tuples(st.sampled_from(["drop", "copy", "swap", "move"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=3,
    ),
)
def test_any_edit_is_accepted_or_rejected_in_one_line(
    name: str, lowered: bool, edits: list[tuple[str, int]]
) -> None:
    schedule = build_schedule(name, 2, 4)
    if lowered:
        schedule = lower(schedule)
    rows = [list(row) for row in schedule.actions]
    for edit, seed in edits:
        r = seed % len(rows)
        if not rows[r]:
            continue
        i = seed // len(rows) % len(rows[r])
        if edit == "drop":
            rows[r].pop(i)
        elif edit == "copy":
            rows[r].insert(seed % (len(rows[r]) + 1), rows[r][i])
        elif edit == "swap":
            j = (i + 1 + seed % 3) % len(rows[r])
            rows[r][i], rows[r][j] = rows[r][j], rows[r][i]
        else:
            rows[(r + 1) % len(rows)].insert(0, rows[r].pop(i))
    edited = Schedule.build(
        name, schedule.placement, schedule.microbatches, rows, asynchronous=schedule.asynchronous
    )
    try:
        validate(edited)
    except ScheduleError as exc:
        assert "\n" not in str(exc)
        assert exc.grid.count("\n") == len(rows) - 1
    else:
        replay(edited)  # whatever validates also replays to the end


def test_allreduce_without_replicas_is_refused() -> None:
    # One replica: nothing to sum with (the simulator charged its time, the runtime skipped it).
    rejects(
        sched(["0F0 0F1 0B0 0B1 0ALLREDUCE", "1F0 1F1 1B0 1B1"]),
        "rank 0, position 4 (0ALLREDUCE)",
        "no replica whose gradients it would sum",
        "remove 0ALLREDUCE",
    )


def test_a_rank_without_a_stage_is_refused() -> None:
    # A JSON file's placement may leave a rank out: a process that would only wait.
    placement = Placement.custom((0, 1), num_ranks=3)
    rejects(sched([*GOOD, ""], placement), "rank 2 holds no stage", "use pp=2")
    rejects(sched(["", ""], Placement("custom", 2, (), 1)), "the placement holds no stage")
