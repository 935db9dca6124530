"""When a gradient sent back may be freed (``pipetrain.schedules.acks``), and the memory
the simulator counts for the ones still held."""

from __future__ import annotations

import pytest

from pipetrain.schedules.acks import gradient_acks
from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.messages import RECV_KINDS, SEND_KINDS, Message, message_of
from pipetrain.schedules.registry import SCHEDULE_NAMES, get_spec
from pipetrain.schedules.schedule import Schedule
from pipetrain.sim.simulator import gradient_releases, simulate


def _gradient(src_rank: int, dst_rank: int, stage: int, mb: int) -> Message:
    return Message(src_rank, dst_rank, stage, stage - 1, True, mb)


def test_1f1b_frees_a_gradient_at_the_next_activation_sent_after_it_arrived() -> None:
    # 1F1B p=2 m=4, rank 0: F0 F1 B0 F2 B1 F3 B2 B3. Rank 1's gradient of micro-batch 0
    # arrives before rank 0's B0, which F2 (and its activation) follows; that of 1 before
    # B1, then F3; those of 2 and 3 have no activation after them: kept to the end.
    acks = gradient_acks(lower(get_spec("1f1b").build(2, 4)))
    assert acks[0] == {}  # rank 0 sends no gradient
    assert acks[1] == {
        Message(0, 1, 0, 1, False, 2): (_gradient(1, 0, 1, 0),),
        Message(0, 1, 0, 1, False, 3): (_gradient(1, 0, 1, 1),),
    }


@pytest.mark.parametrize("name", sorted(SCHEDULE_NAMES))
def test_a_gradient_is_freed_only_by_a_message_its_receiver_sent_after_receiving_it(
    name: str,
) -> None:
    spec = get_spec(name)
    schedule = lower(spec.build(4, 8, 2 if spec.uses_chunks else None))
    freed = 0
    for rank, by_message in gradient_acks(schedule).items():
        for got, gradients in by_message.items():
            assert got.dst_rank == rank and got.src_rank != rank
            peer = schedule.actions[got.src_rank]
            sent_at = _position(peer, SEND_KINDS, got, schedule)
            for gradient in gradients:
                assert gradient.src_rank == rank and gradient.dst_rank == got.src_rank
                received_at = _position(peer, RECV_KINDS, gradient, schedule)
                assert received_at < sent_at, (name, gradient, got)
                freed += 1
    if schedule.placement.num_ranks > 1 and name not in _NO_LATER_MESSAGE:
        assert freed > 0, name


# Schedules where no rank sends its neighbour anything after receiving a gradient from it
# (all forwards before all backwards): every gradient is kept to the end of the step.
_NO_LATER_MESSAGE = {"gpipe", "looped-bfs", "naive"}


def _position(
    program: tuple[Action, ...], kinds: frozenset[Kind], message: Message, schedule: Schedule
) -> int:
    """Where in ``program`` a send or receive (``kinds``) moves ``message``."""
    return next(
        i for i, a in enumerate(program) if a.kind in kinds and message_of(a, schedule) == message
    )


def test_the_simulator_holds_a_gradient_until_its_acknowledging_action() -> None:
    # 1F1B p=2 m=4 at unit costs; rank 1 (one live micro-batch of 1.0) sends 0.5 back per
    # B. Held to the step's end, three sit beside its last F (2.5); freed as rank 0's next
    # activation arrives, only B2's does (1.5: B3's comes after the last F).
    schedule = get_spec("1f1b").build(2, 4)
    held = simulate(schedule, activation_bytes=[0.0, 1.0], sent_bytes=0.5)
    assert held.peak_activation_bytes == (0.0, 1.5)
    assert gradient_releases(schedule) == {(1, 0): (1, 2, False), (1, 1): (1, 3, False)}
