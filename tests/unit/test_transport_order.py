"""DistTransport under NCCL's matching rules, in one process: a fake of its point-to-point.

gloo, which the multi-process tests use, matches per source in posting order but runs the
two directions of a pair independently; NCCL runs all of a pair's operations on one
stream per rank, in posting order, and an operation completes only when the peer's stream
has the matching one at its head. ``FakeNccl`` does exactly that (ranks are threads), so a
transport that posted in another order than its peer would deadlock here (the waits time
out) or pair a send with the wrong receive (the sizes or the values differ).
"""

from __future__ import annotations

import datetime
import re
import threading
from dataclasses import dataclass, field

import pytest
import torch

import pipetrain.runtime.transport as transport_module
from pipetrain.runtime.build import resolve_schedule
from pipetrain.runtime.executor import RankExecutor
from pipetrain.runtime.transport import DistTransport
from pipetrain.runtime.wiring import forward_only
from pipetrain.schedules import Placement, Schedule, parse_action
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.wire import Message, message_of

TIMEOUT_S = 10.0


@dataclass
class _Op:
    send: bool
    tensor: torch.Tensor
    done: bool = False


@dataclass(frozen=True)
class FakeGroup:
    rank: int


@dataclass
class FakeNccl:
    """``get_rank``, ``isend`` and ``irecv`` with NCCL's order semantics (module doc).

    With ``one_stream=False`` it plays gloo instead: each direction of a pair is matched in
    posting order on its own, sends never wait behind receives.
    """

    one_stream: bool = True
    # NCCL creates a pair's communicator at its first operation, blocking until both ranks
    # have arrived there; gloo connects every pair when the group is made.
    init_timeout_s: float = 10.0
    arrived: set[tuple[int, int]] = field(default_factory=set)
    # (rank, peer, lane): the operations a rank posted, in order; one lane for everything
    # on NCCL, on gloo lane 1 for sends and lane 0 for receives.
    streams: dict[tuple[int, int, int], list[_Op]] = field(default_factory=dict)
    heads: dict[tuple[int, int, int], int] = field(default_factory=dict)
    error: str = ""
    cond: threading.Condition = field(default_factory=threading.Condition)

    def get_rank(self, group: FakeGroup) -> int:
        return group.rank

    def get_backend(self, group: FakeGroup) -> str:
        return "nccl" if self.one_stream else "gloo"

    def isend(self, tensor, group, group_dst, tag):
        return self._post(group.rank, group_dst, _Op(True, tensor), tag)

    def irecv(self, tensor, group, group_src, tag):
        return self._post(group.rank, group_src, _Op(False, tensor), tag)

    def _post(self, rank: int, peer: int, op: _Op, tag: int) -> _Work:
        assert tag == 0
        lane = 0 if self.one_stream else int(op.send)
        with self.cond:
            if self.one_stream and (rank, peer) not in self.arrived:
                self.arrived.add((rank, peer))
                self.cond.notify_all()
                if not self.cond.wait_for(
                    lambda: (peer, rank) in self.arrived, self.init_timeout_s
                ):
                    raise RuntimeError(
                        f"Timed out creating the communicator of ranks {rank}, {peer}"
                    )
            self.streams.setdefault((rank, peer, lane), []).append(op)
            if self.one_stream:
                self._run((rank, peer, 0), (peer, rank, 0))
            else:
                self._run((rank, peer, lane), (peer, rank, 1 - lane))
            self.cond.notify_all()
        return _Work(self, op)

    def _run(self, x: tuple[int, int, int], y: tuple[int, int, int]) -> None:
        """Complete the heads of two facing streams while they are a send and a receive."""
        while True:
            sx, sy = self.streams.get(x, []), self.streams.get(y, [])
            hx, hy = self.heads.get(x, 0), self.heads.get(y, 0)
            if hx == len(sx) or hy == len(sy) or sx[hx].send == sy[hy].send:
                return  # nothing to pair, or two sends (two receives) facing each other
            send, recv = (sx[hx], sy[hy]) if sx[hx].send else (sy[hy], sx[hx])
            if send.tensor.shape != recv.tensor.shape or send.tensor.dtype != recv.tensor.dtype:
                self.error = (
                    f"ranks {x[0]} and {y[0]} paired {send.tensor.shape} with {recv.tensor.shape}"
                )
                return
            recv.tensor.copy_(send.tensor)
            send.done = recv.done = True
            self.heads[x], self.heads[y] = hx + 1, hy + 1


@dataclass
class _Work:
    nccl: FakeNccl
    op: _Op

    def is_completed(self) -> bool:
        with self.nccl.cond:
            # Sleeps on the condition for a moment instead of answering at once: ranks are
            # threads here, and a poll loop's naps would each wait for the GIL.
            return self.nccl.cond.wait_for(lambda: self.op.done or bool(self.nccl.error), 1e-3)

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            # NCCL's wait without a timeout only orders the CUDA stream after the
            # operation; the host must know it complete before reading its data
            # (pipetrain.runtime.waits.finish polls is_completed first).
            with self.nccl.cond:
                if self.nccl.error:
                    raise RuntimeError(self.nccl.error)
                assert self.op.done, "wait() without a timeout on an unfinished operation"
            return
        with self.nccl.cond:
            self.nccl.cond.wait_for(
                lambda: self.op.done or bool(self.nccl.error), timeout.total_seconds()
            )
            if self.nccl.error:
                raise RuntimeError(self.nccl.error)
            if not self.op.done:
                raise RuntimeError("Timed out waiting for a point-to-point operation")


def _value(stage: int, mb: int, step: int) -> float:
    return float(1000 * step + 10 * stage + mb)


class FakeRunner:
    """A stage that checks it gets exactly its own micro-batch's tensors from its neighbours.

    Outputs are two tensors (float and int64) whose shapes differ per boundary, filled with
    a value naming (step, stage, micro-batch), so a message matched with the wrong receive
    shows up as another size or value.
    """

    def __init__(
        self, stage: int, placement: Placement, steps: list[int], widen: tuple[int, ...] = ()
    ) -> None:
        self.stage = stage
        self.is_first = placement.is_first(stage)
        self.is_last = placement.is_last(stage)
        self.saved: dict[int, bool] = {}
        self.loss_sum = None
        self._steps = steps  # the step being run, shared with the test
        self._widen = widen  # per step, added to every width (shapes that change)

    def reset(self) -> None:
        self.saved.clear()

    def _pair(self, value: float, width: int) -> tuple[torch.Tensor, ...]:
        step = self._steps[0]
        width += self._widen[step] if step < len(self._widen) else 0
        return torch.full((2, width), value), torch.full((width,), int(value))

    def _check(self, got: tuple[torch.Tensor, ...], value: float, width: int) -> None:
        want = self._pair(value, width)
        assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

    def forward(self, mb, inputs, target, denominator, training):
        step = self._steps[0]
        if not self.is_first:
            self._check(inputs, _value(self.stage - 1, mb, step), 3 + self.stage)
        self.saved[mb] = True
        return self._pair(_value(self.stage, mb, step), 4 + self.stage)

    def backward(self, mb, grads, weights):
        step = self._steps[0]
        del self.saved[mb]
        if not self.is_last:
            self._check(grads, -_value(self.stage + 1, mb, step), 20 + self.stage)
        return self._pair(-_value(self.stage, mb, step), 19 + self.stage)

    def weight(self, mb) -> None:
        return None


class _NoReducer:
    def start(self, stage: int) -> None:
        return None


def run_over_fake_nccl(
    program: Schedule, steps: int = 2, timeout_s: float = TIMEOUT_S, one_stream: bool = True
) -> str:
    """Run every rank of a lowered program in a thread over FakeNccl; the errors, or ''."""
    nccl = FakeNccl(one_stream, init_timeout_s=timeout_s)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transport_module, "dist", nccl)
        return _run_threads(nccl, program, steps, timeout_s)


def _run_threads(
    nccl: FakeNccl, program: Schedule, steps: int, timeout_s: float, widen: tuple[int, ...] = ()
) -> str:
    placement = program.placement
    errors: list[str] = []
    current = [0]

    def rank_main(rank: int) -> None:
        try:
            group, cpu = FakeGroup(rank), torch.device("cpu")
            transport = DistTransport(group, placement.stage_to_rank, cpu, timeout_s)
            runners = {
                s: FakeRunner(s, placement, current, widen) for s in placement.stages_of(rank)
            }
            ex = RankExecutor(
                program, rank, runners, transport, _NoReducer(), step_hook=lambda s, k: None
            )
            inputs = [torch.zeros(1)] * program.microbatches
            for step in range(steps):
                ex.begin(step, inputs, inputs, 1.0, True)
                transport.begin_step(step, [ex.wire])
                ex.run()
                transport.end_step()
                barrier.wait(timeout_s)
                transport.commit_step()  # every rank ended the step (Pipeline: its summary)
                if rank == 0:
                    current[0] = step + 1
                barrier.wait(timeout_s)
        except Exception as exc:
            cause = f" (from: {exc.__cause__})" if exc.__cause__ is not None else ""
            errors.append(f"rank {rank}: {exc}{cause}")
            barrier.abort()
            with nccl.cond:
                nccl.error = nccl.error or f"rank {rank} failed"
                nccl.cond.notify_all()

    barrier = threading.Barrier(placement.num_ranks)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(placement.num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * timeout_s)
    return "; ".join(errors)


def _cases():
    cases = []
    for name, p, m, v in [
        ("gpipe", 2, 3, None),
        ("1f1b", 4, 5, None),
        ("interleaved-1f1b", 2, 4, 2),
        ("interleaved-1f1b", 2, 4, 3),
        ("interleaved-1f1b", 4, 8, 2),
        ("looped-bfs", 2, 3, 2),
        ("zb-h1", 2, 4, None),
        ("zb-h2", 4, 8, None),
        ("zb-v", 2, 4, None),
        ("zb-v", 4, 8, None),
        ("dualpipe-v", 2, 4, None),
        ("dualpipe-v", 4, 8, None),
        ("chimera", 4, 4, None),
        ("pipedream", 2, 4, None),
    ]:
        cases.append(pytest.param(name, p, m, v, id=f"{name}-p{p}-m{m}-v{v}"))
    return cases


@pytest.mark.parametrize(("name", "p", "m", "v"), _cases())
def test_schedules_run_over_nccl_order_semantics(name, p, m, v):
    program = resolve_schedule(name, p, m, v)
    assert run_over_fake_nccl(program) == ""
    assert run_over_fake_nccl(forward_only(program)) == ""
    # gloo's semantics, which the transport meets with its two directions apart.
    assert run_over_fake_nccl(program, one_stream=False) == ""


def ring_program() -> Schedule:
    """Stages on ranks 0, 1, 2, 0: the ring of test_wire, where orders chosen pair by pair
    deadlock."""
    rows = [
        "0F0 0F2 0F1 3F0 3B0 0B0 3F2 3B2 0B2 3F1 3B1 0B1",
        "1F0 1F2 1B0 1B2 1F1 1B1",
        "2F0 2B0 2F2 2B2 2F1 2B1",
    ]
    actions = [[parse_action(t) for t in row.split()] for row in rows]
    return lower(Schedule.build("ring", Placement.custom((0, 1, 2, 0)), 3, actions))


def test_a_ring_of_three_ranks_runs_over_nccl_order_semantics():
    # The ring of test_wire, where orders chosen pair by pair deadlock.
    program = ring_program()
    assert run_over_fake_nccl(program) == ""


def test_without_meeting_its_peers_first_the_ring_deadlocks_in_communicator_creation(
    monkeypatch,
):
    # Rank 0's first operation with rank 2 is the receive of activations 2->3, posted when
    # the step begins; it would wait for rank 2, which waits for rank 1, which waits for
    # the activations rank 0 has not sent: DistTransport._connect meets the peers first.
    program = ring_program()
    monkeypatch.setattr(DistTransport, "_connect", lambda self, peers: None)
    problem = run_over_fake_nccl(program, steps=1, timeout_s=1.0)
    assert "Timed out creating the communicator of ranks 0, 2" in problem


def test_the_fake_fails_a_transport_that_posts_in_program_order(monkeypatch):
    # Each rank's own program order (no agreed wire order) deadlocks even 1F1B on NCCL.
    program = resolve_schedule("1f1b", 2, 4, None)

    def own_order(self, step, wires):
        mine: dict[int, list[Message]] = {}
        for action in program.actions[self._rank]:
            message = message_of(action, program)
            if message is not None:
                peer = message.dst_rank if message.src_rank == self._rank else message.src_rank
                mine.setdefault(peer, []).append(message)
        original(self, step, [{peer: tuple(msgs) for peer, msgs in mine.items()}])

    original = DistTransport.begin_step
    monkeypatch.setattr(DistTransport, "begin_step", own_order)
    problem = run_over_fake_nccl(program, steps=1, timeout_s=1.0)
    # Both ranks wait (rank 0 for gradient 0, rank 1 for activations 1); either times out.
    assert re.search(r"rank (0|1): step 0, receiving .* peer rank (1|0) did not answer", problem)


def _gpipe_sends(steps: int) -> dict[int, list[torch.Tensor]]:
    """GPipe, p = 2, m = 3, each message two tensors, run ``steps`` steps over the fake of
    NCCL: the tensors each rank sent, in order."""
    program = resolve_schedule("gpipe", 2, 3, None)
    nccl = FakeNccl(True, init_timeout_s=TIMEOUT_S)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transport_module, "dist", nccl)
        assert _run_threads(nccl, program, steps, TIMEOUT_S) == ""
    return {
        rank: [
            op.tensor
            for (r, _, _), ops in nccl.streams.items()
            if r == rank
            for op in ops
            if op.send
        ]
        for rank in (0, 1)
    }


def test_later_messages_of_a_boundary_travel_packed():
    # The first message of each boundary in a step goes as header + 2 tensors, the other
    # two as one packed buffer each, so rank 0 issues 1 (its meeting token) + 3 + 2 sends
    # and rank 1 issues 3 + 2.
    sends = _gpipe_sends(1)
    assert len(sends[0]) == 6 and len(sends[1]) == 5
    packed = [t for ts in sends.values() for t in ts if t.dtype == torch.uint8]
    assert len(packed) == 4


def test_first_messages_of_later_steps_are_posted_with_the_last_steps_shapes():
    # 3 steps of the same shapes. Step 0 as above (6 + 5 sends); from step 1 on, the first
    # message of each boundary is posted with step 0's shapes, so all three of each
    # boundary travel packed: 3 more sends per rank and step.
    sends = _gpipe_sends(3)
    assert len(sends[0]) == 6 + 3 + 3 and len(sends[1]) == 5 + 3 + 3
    packed = [t for ts in sends.values() for t in ts if t.dtype == torch.uint8]
    assert len(packed) == 4 + 6 + 6


def test_without_a_commit_every_step_starts_header_first(monkeypatch):
    # A step not known to have ended on every rank leaves no guess: step 1 sends as step 0.
    monkeypatch.setattr(DistTransport, "commit_step", lambda self: None)
    sends = _gpipe_sends(2)
    assert len(sends[0]) == 6 + 5 and len(sends[1]) == 5 + 5


@pytest.mark.parametrize("pack_limit", [None, 0])
@pytest.mark.parametrize("one_stream", [True, False])
@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [("1f1b", 4, 5, None), ("interleaved-1f1b", 2, 4, 2), ("zb-v", 2, 4, None)],
)
def test_shapes_that_change_between_steps_send_a_filler_then_the_payload(
    monkeypatch, name, p, m, v, one_stream, pack_limit
):
    # Widths grow, stay, shrink, stay: steps 1 and 3 miss the guess (the sender fills the
    # posted buffers, then sends the payload the header announces), steps 2 and 4 hit it.
    # The runners check every tensor's values and the fake every pairing's size.
    if pack_limit is not None:
        import pipetrain.runtime.wire_format as wire_format

        monkeypatch.setattr(wire_format, "PACK_LIMIT", pack_limit)
    program = resolve_schedule(name, p, m, v)
    nccl = FakeNccl(one_stream, init_timeout_s=TIMEOUT_S)
    monkeypatch.setattr(transport_module, "dist", nccl)
    assert _run_threads(nccl, program, 5, TIMEOUT_S, widen=(0, 7, 7, 2, 2)) == ""


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [("1f1b", 4, 5, None), ("interleaved-1f1b", 2, 4, 2), ("zb-v", 2, 4, None)],
)
def test_receives_posted_only_by_the_receive_that_needs_them(monkeypatch, name, p, m, v):
    # With ``progress`` idle, every receive is first reached by a RECV pumping through it
    # (gloo's semantics: sends never wait for receives), guessed or header first.
    monkeypatch.setattr(DistTransport, "progress", lambda self: None)
    program = resolve_schedule(name, p, m, v)
    gloo = FakeNccl(False, init_timeout_s=TIMEOUT_S)
    monkeypatch.setattr(transport_module, "dist", gloo)
    assert _run_threads(gloo, program, 4, TIMEOUT_S, widen=(0, 0, 3, 3)) == ""


def test_wire_entries_are_built_once_per_program(monkeypatch):
    # The wire orders of a program never change: begin_step turns them into entries the
    # first time only (each rank: once for training; 3 steps run).
    import pipetrain.runtime.transport as transport

    calls: list[int] = []
    real = transport.peer_entries

    def counting(rank, wire):
        calls.append(rank)
        return real(rank, wire)

    monkeypatch.setattr(transport, "peer_entries", counting)
    program = resolve_schedule("1f1b", 2, 4, None)
    nccl = FakeNccl(True, init_timeout_s=TIMEOUT_S)
    monkeypatch.setattr(transport_module, "dist", nccl)
    assert _run_threads(nccl, program, 3, TIMEOUT_S) == ""
    assert sorted(calls) == [0, 1]


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [("1f1b", 4, 5, None), ("interleaved-1f1b", 2, 4, 2), ("zb-v", 2, 4, None)],
)
def test_messages_too_large_to_pack_go_as_header_and_payload(monkeypatch, name, p, m, v):
    # Over wire_format.PACK_LIMIT a later message is a header and its tensors again (the copy
    # would cost memory until the send is known complete): both ends switch alike.
    import pipetrain.runtime.wire_format as wire_format

    monkeypatch.setattr(wire_format, "PACK_LIMIT", 0)
    program = resolve_schedule(name, p, m, v)
    nccl = FakeNccl(True, init_timeout_s=TIMEOUT_S)
    monkeypatch.setattr(transport_module, "dist", nccl)
    assert _run_threads(nccl, program, 2, TIMEOUT_S) == ""
    sent = [op.tensor for ops in nccl.streams.values() for op in ops if op.send]
    assert sent and not any(t.dtype == torch.uint8 for t in sent)
    # gloo's semantics too.
    gloo = FakeNccl(False, init_timeout_s=TIMEOUT_S)
    monkeypatch.setattr(transport_module, "dist", gloo)
    assert _run_threads(gloo, program, 2, TIMEOUT_S) == ""


def test_a_transfer_refused_at_once_names_the_message_and_the_peer():
    # gloo raises from isend/irecv themselves when the peer has closed the connection:
    # that is one line naming the step, the message and the peer, like a failed wait.
    program = resolve_schedule("1f1b", 2, 2, None)
    nccl = FakeNccl(True, init_timeout_s=2.0)
    real_isend = nccl.isend

    def isend(tensor, group, group_dst, tag):
        if group.rank == 0 and tensor.numel() > 1:  # not the meeting token
            raise RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer")
        return real_isend(tensor, group, group_dst, tag)

    nccl.isend = isend
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transport_module, "dist", nccl)
        problem = _run_threads(nccl, program, 1, 2.0)
    assert re.search(
        r"rank 0: rank 0: step 0, sending activations to stage 1 \(micro-batch 0\): peer rank 1 "
        r"was lost",
        problem,
    ), problem
