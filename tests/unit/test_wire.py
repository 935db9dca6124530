"""Wire orders: one order per pair of ranks that order-matched transports (NCCL) can run."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.runtime.wiring import forward_only
from pipetrain.schedules import Action, Kind, Placement, Schedule, ScheduleError, parse_action
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.registry import SCHEDULE_NAMES, build_schedule, get_spec
from pipetrain.schedules.validate import validate
from pipetrain.schedules.wire import (
    Message,
    check_order_matched,
    issue_orders,
    message_of,
    peer_orders,
    wire_orders,
)


def program_orders(schedule: Schedule) -> dict[tuple[int, int], tuple[Message, ...]]:
    """Each rank posting its messages in its own program order (what the runtime must not do)."""
    issue: dict[tuple[int, int], list[Message]] = {}
    for rank, row in enumerate(schedule.actions):
        for action in row:
            message = message_of(action, schedule)
            if message is not None:
                peer = message.dst_rank if message.src_rank == rank else message.src_rank
                issue.setdefault((rank, peer), []).append(message)
    return {key: tuple(messages) for key, messages in issue.items()}


def assert_rules_hold(schedule: Schedule, orders: dict[tuple[int, int], tuple[Message, ...]]):
    """Every message once; rules 1 and 2 of pipetrain.schedules.wire on every rank."""
    position = {}
    for messages in orders.values():
        for i, message in enumerate(messages):
            assert message not in position
            position[message] = i
    expected = {m for m in (message_of(a, schedule) for _, _, a in schedule.enumerate_actions())}
    assert set(position) == expected - {None}
    for rank, row in enumerate(schedule.actions):
        seen: dict[int, list[Message]] = {}
        for action in row:
            message = message_of(action, schedule)
            if message is None:
                continue
            peer = message.dst_rank if message.src_rank == rank else message.src_rank
            if message.src_rank == rank:
                for earlier in seen.get(peer, []):
                    assert position[earlier] < position[message], (rank, earlier, message)
            seen.setdefault(peer, []).append(message)


def registry_cases() -> list:
    for name in SCHEDULE_NAMES:
        spec = get_spec(name)
        for p in (2, 4, 8):
            for m in (p, p + 1, 2 * p) if p < 8 else (p, p + 1):
                for v in (2, 3) if spec.uses_chunks else (None,):
                    if spec.check(p, m, v) is None:
                        yield pytest.param(name, p, m, v, id=f"{name}-p{p}-m{m}-v{v}")


@pytest.mark.parametrize(("name", "p", "m", "v"), list(registry_cases()))
def test_every_registry_schedule_has_an_order_that_runs_on_nccl_streams(name, p, m, v):
    schedule = lower(build_schedule(name, p, m, chunks=v))
    # Training and evaluation run different programs, so they have different orders.
    for program in (schedule, forward_only(schedule)):
        orders = wire_orders(program)
        assert_rules_hold(program, orders)
        issue = issue_orders(orders)
        assert check_order_matched(program, issue, headers=False).ok
        # Small messages travel packed, large ones as header and payload: both complete.
        for lookahead, packed in ((0, True), (2, True), (0, False), (2, False)):
            result = check_order_matched(program, issue, lookahead=lookahead, packed=packed)
            assert result.ok, result.problem


def test_a_user_schedule_on_a_custom_placement_has_an_order():
    # Stages 0 and 2 on rank 0, 1 and 3 on rank 1 (not a registry placement), 1F1B-like.
    placement = Placement.custom((0, 1, 0, 1))
    rank0 = "0F0 0F1 2F0 2F1 2B0 0B0 2B1 0B1"
    rank1 = "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"
    rows = [[parse_action(t) for t in row.split()] for row in (rank0, rank1)]
    schedule = lower(Schedule.build("mine", placement, 2, rows))
    validate(schedule)
    orders = wire_orders(schedule)
    assert_rules_hold(schedule, orders)
    assert check_order_matched(schedule, issue_orders(orders)).ok


def test_1f1b_order_is_the_order_of_the_sends():
    schedule = lower(build_schedule("1f1b", 2, 3))
    order = [("g" if m.is_grad else "a") + str(m.microbatch) for m in wire_orders(schedule)[(0, 1)]]
    assert order == ["a0", "a1", "g0", "a2", "g1", "g2"]
    assert set(peer_orders(wire_orders(schedule), 1)) == {0}


@pytest.mark.parametrize(("name", "p"), [("zb-v", 2), ("dualpipe-v", 2), ("1f1b", 2)])
def test_posting_in_program_order_deadlocks_and_the_checker_says_so(name, p):
    schedule = lower(build_schedule(name, p, 2 * p))
    result = check_order_matched(schedule, program_orders(schedule), headers=False)
    assert not result.ok
    assert result.problem.startswith("deadlock: rank 0 at")


def test_ranks_that_disagree_on_the_order_are_a_mismatch():
    schedule = lower(build_schedule("gpipe", 2, 2))
    issue = issue_orders(wire_orders(schedule))
    first, second, *rest = issue[(1, 0)]
    issue[(1, 0)] = (second, first, *rest)
    result = check_order_matched(schedule, issue)
    assert "rank 0 posts the header of the activations 0->1 of micro-batch 0" in result.problem
    assert "rank 1 posts the header of the activations 0->1 of micro-batch 1" in result.problem


def test_an_order_that_breaks_rule_2_deadlocks_on_the_stream():
    # Every activation first: rank 1 must send gradient 0 before activation 2 comes.
    schedule = lower(build_schedule("1f1b", 2, 4))
    (messages,) = wire_orders(schedule).values()
    bad = tuple(sorted(messages, key=lambda m: (m.is_grad, m.microbatch)))
    result = check_order_matched(schedule, issue_orders({(0, 1): bad}), headers=False)
    assert not result.ok


def test_a_cycle_of_the_rules_names_both_ranks_and_messages():
    # Rank 0 waits for the gradient before it sends the activations it depends on.
    rank0 = [Action(0, Kind.F, 0), Action(0, Kind.RECV_B, 0), Action(0, Kind.SEND_F, 0)]
    rank1 = [Action(1, Kind.RECV_F, 0), Action(1, Kind.F, 0), Action(1, Kind.B, 0)]
    rank1.append(Action(1, Kind.SEND_B, 0))
    rank0.append(Action(0, Kind.B, 0))
    schedule = Schedule.build("cycle", Placement.linear(2), 1, [rank0, rank1])
    with pytest.raises(ScheduleError) as info:
        wire_orders(schedule)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("ranks 0 and 1 cannot agree on an order of their messages")
    assert (
        "rank 0 receives the gradient 1->0 of micro-batch 0 before it sends the activations "
        "0->1 of micro-batch 0" in message
    )
    assert (
        "rank 1 receives the activations 0->1 of micro-batch 0 before it sends the gradient "
        "1->0 of micro-batch 0" in message
    )


def test_a_message_never_received_is_an_error():
    rank0 = [Action(0, Kind.F, 0), Action(0, Kind.SEND_F, 0)]
    rank1 = [Action(1, Kind.F, 0)]
    schedule = Schedule.build("lost", Placement.linear(2), 1, [rank0, rank1])
    with pytest.raises(ScheduleError, match=r"activations 0->1 of micro-batch 0 .* never received"):
        wire_orders(schedule)


@st.composite
def executed_schedules(draw: st.DrawFn) -> Schedule:
    """A schedule read off one random execution on a random placement (so it is valid)."""
    ranks = draw(st.integers(2, 4))
    stages = draw(st.integers(ranks, 2 * ranks))
    stage_to_rank = list(range(ranks)) + draw(
        st.lists(st.integers(0, ranks - 1), min_size=stages - ranks, max_size=stages - ranks)
    )
    stage_to_rank = draw(st.permutations(stage_to_rank))
    m = draw(st.integers(1, 4))
    split = draw(st.booleans())
    done: set[tuple[int, str, int]] = set()
    rows: list[list[Action]] = [[] for _ in range(ranks)]
    todo = [(s, k) for s in range(stages) for k in range(m)]
    total = len(todo) * (3 if split else 2)
    while len(done) < total:
        ready = []
        for s, k in todo:
            if (s, "F", k) not in done:
                if s == 0 or (s - 1, "F", k) in done:
                    ready.append(Action(s, Kind.F, k))
            elif (s, "B", k) not in done:
                if s == stages - 1 or (s + 1, "B", k) in done:
                    ready.append(Action(s, Kind.I if split else Kind.B, k))
            elif split and (s, "W", k) not in done:
                ready.append(Action(s, Kind.W, k))
        action = draw(st.sampled_from(ready))
        assert action.microbatch is not None
        kind = {Kind.F: "F", Kind.B: "B", Kind.I: "B", Kind.W: "W"}[action.kind]
        done.add((action.stage, kind, action.microbatch))
        rows[stage_to_rank[action.stage]].append(action)
    return Schedule.build("drawn", Placement.custom(tuple(stage_to_rank), ranks), m, rows)


@settings(max_examples=60, deadline=None)
@given(executed_schedules())
def test_any_valid_schedule_on_any_placement_runs_on_nccl_streams(schedule):
    lowered = lower(schedule)
    validate(lowered)
    issue = issue_orders(wire_orders(lowered))
    for lookahead, packed in ((0, True), (2, True), (2, False)):
        result = check_order_matched(lowered, issue, lookahead=lookahead, packed=packed)
        assert result.ok, result.problem


def test_orders_chosen_pair_by_pair_can_deadlock_across_three_ranks():
    # Stages on ranks 0, 1, 2, 0 (a ring). The orders below keep rules 1 and 2 pair by pair,
    # and run when messages are atomic; with headers, rank 0 must read the header of the
    # gradient of micro-batch 0 before it may post activations 1 to rank 1, rank 1 that of
    # the gradient from rank 2 before it posts activations 2, and rank 2 waits for rank 0.
    # One replay ordering all pairs (wire_orders) never makes such a wait run backwards.
    rows = [
        "0F0 0F2 0F1 3F0 3B0 0B0 3F2 3B2 0B2 3F1 3B1 0B1",
        "1F0 1F2 1B0 1B2 1F1 1B1",
        "2F0 2B0 2F2 2B2 2F1 2B1",
    ]
    actions = [[parse_action(t) for t in row.split()] for row in rows]
    schedule = lower(Schedule.build("ring", Placement.custom((0, 1, 2, 0)), 3, actions))
    validate(schedule)
    orders = wire_orders(schedule)
    assert check_order_matched(schedule, issue_orders(orders)).ok
    assert check_order_matched(schedule, issue_orders(orders), packed=False).ok
    chosen = dict(orders)
    for pair, text in (((0, 1), "a0 a2 g0 a1 g2 g1"), ((1, 2), "a0 g0 a2 g2 a1 g1")):
        by_name = {("g" if m.is_grad else "a") + str(m.microbatch): m for m in orders[pair]}
        chosen[pair] = tuple(by_name[name] for name in text.split())
    assert_rules_hold(schedule, chosen)
    assert check_order_matched(schedule, issue_orders(chosen), headers=False).ok
    for packed in (True, False):
        result = check_order_matched(schedule, issue_orders(chosen), packed=packed)
        assert result.problem == (
            "deadlock: rank 0 at 0SEND_F1, rank 1 at 1SEND_F2, rank 2 at 2RECV_B0"
        )
