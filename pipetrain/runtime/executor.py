"""The interpreter: one rank's action list, run through one table from kind to handler.

Every schedule runs through this loop; none has a loop of its own. The table is resolved
once per program (an action of an unknown kind fails when the pipeline is built, not in
the middle of a step), so a step costs a list walk, a call per action and two clock
readings.

Data between actions lives in two mailboxes keyed like messages: ``_inbox`` holds what a
stage will consume (received, or handed over in memory by a stage of the same rank) and
``_outbox`` what a SEND action will send. The same executor runs under both transports;
with the in-memory one a receive that is not there yet returns False and the caller runs
another rank (the single-process debug mode).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pipetrain.runtime.errors import PipelineError, PipelineInputError
from pipetrain.runtime.ranges import ranged_handlers
from pipetrain.runtime.stage import StageRunner
from pipetrain.runtime.timeline import ActionClock
from pipetrain.runtime.wire_format import Acks, MessageKey
from pipetrain.schedules import Action, Kind, Schedule
from pipetrain.schedules.acks import gradient_acks
from pipetrain.schedules.messages import Message
from pipetrain.schedules.wire import PeerOrders, peer_orders, wire_orders

__all__ = [
    "ComputeHook",
    "GradReducer",
    "GradsHook",
    "PipelineHooks",
    "RankExecutor",
    "StepHook",
    "Transport",
]

# Called for a STEP action with (stage, micro-batch): the caller's optimizer step of that
# stage (asynchronous schedules).
StepHook = Callable[[int, int], None]
# Called with each F, B, I and W action just before it runs: asynchronous schedules choose
# the weight version a micro-batch uses there (pipetrain.train.pipedream.weights).
ComputeHook = Callable[[Action], None]
# Called with a stage right after the last action of a step that adds to its weight
# gradients (its last B or W): data parallelism starts that stage's all-reduce there.
GradsHook = Callable[[int], None]


@dataclass(frozen=True)
class PipelineHooks:
    """The caller's code that a pipeline runs inside its steps (``build_pipeline(hooks=)``).

    ``step_hook(stage, microbatch)`` runs the STEP actions of asynchronous schedules;
    ``compute_hook(action)`` runs before each F, B, I and W (where
    pipetrain.train.pipedream.weights picks a micro-batch's weight version);
    ``grads_hook(stage)`` runs right after a stage's last B or W of a training step (data
    parallelism starts its all-reduce there). None: nothing runs there.
    """

    step_hook: StepHook | None = None
    compute_hook: ComputeHook | None = None
    grads_hook: GradsHook | None = None


class Transport(Protocol):
    def begin_step(
        self, step: int, wires: Sequence[PeerOrders], where: str = "", acks: Acks | None = None
    ) -> None: ...
    def end_step(self) -> None: ...
    def send(self, key: MessageKey, src_stage: int, tensors: tuple[torch.Tensor, ...]) -> None: ...
    def recv(self, key: MessageKey, src_stage: int) -> tuple[torch.Tensor, ...] | None: ...
    def progress(self) -> None: ...


class GradReducer(Protocol):
    """Sums the gradients of a stage's replicas (Chimera's ALLREDUCE action)."""

    def start(self, stage: int) -> None: ...


class RankExecutor:
    """Runs one rank's program of a schedule, step after step."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        stages: dict[int, StageRunner],
        transport: Transport,
        reducer: GradReducer,
        step_hook: StepHook | None = None,
        compute_hook: ComputeHook | None = None,
        grads_hook: GradsHook | None = None,
    ) -> None:
        self.rank = rank
        self.actions: tuple[Action, ...] = schedule.actions[rank]
        self._placement = schedule.placement
        self._stages = stages
        # The per-batch side inputs each stage takes (none for most: a runner without
        # the attribute, such as a test's stand-in, takes none and is called as before).
        self._extra_names: dict[int, frozenset[str]] = {
            s: getattr(r, "extra_names", frozenset()) for s, r in stages.items()
        }
        self._transport = transport
        self._reducer = reducer
        self._step_hook = step_hook
        self._compute_hook = compute_hook
        table: dict[Kind, Callable[[Action], bool]] = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.I: self._backward_input,
            Kind.W: self._weight,
            Kind.SEND_F: self._send,
            Kind.SEND_B: self._send,
            Kind.RECV_F: self._recv,
            Kind.RECV_B: self._recv,
            Kind.ALLREDUCE: self._allreduce,
            Kind.STEP: self._step,
        }
        handlers = []
        for action in self.actions:
            handler = table.get(action.kind)
            if handler is None:
                raise PipelineInputError(
                    f"rank {rank}: action {action} has kind {action.kind!r}, which the runtime cannot run"
                )
            if action.stage not in stages:
                raise PipelineInputError(
                    f"rank {rank}: action {action} names stage {action.stage}, which the placement puts on "
                    f"rank {self._placement.rank_of(action.stage)}; fix the schedule's rank lists"
                )
            if action.kind is Kind.STEP and step_hook is None:
                raise PipelineInputError(
                    f"rank {rank}: schedule {schedule.name!r} has STEP actions: pass hooks=PipelineHooks(step_hook=...) "
                    f"(the optimizer step of a stage) to build_pipeline"
                )
            handlers.append(handler)
        if grads_hook is not None:
            handlers = _after_last_grads(self.actions, handlers, grads_hook)
        self._handlers: tuple[Callable[[Action], bool], ...] = tuple(handlers)
        self._plain = self._handlers
        self._ranged: tuple[Callable[[Action], bool], ...] | None = None
        self._ranges_on = False
        self._schedule = schedule
        self._wire: PeerOrders | None = None
        self._acks: Acks | None = None
        self.clock = ActionClock(len(self.actions))
        self._inbox: dict[MessageKey, tuple[torch.Tensor, ...]] = {}
        self._outbox: dict[MessageKey, tuple[torch.Tensor, ...]] = {}
        self._pos = 0
        self._where = "step 0"
        self._inputs: Sequence[torch.Tensor] = ()
        self._targets: Sequence[torch.Tensor] = ()
        self._extras: Mapping[str, Sequence[torch.Tensor]] = {}
        self._denominator = 1.0
        self._training = True

    @property
    def schedule(self) -> Schedule:
        """The (lowered) schedule whose program of this rank runs here."""
        return self._schedule

    @property
    def wire(self) -> PeerOrders:
        """This program's messages with each peer rank in wire order (pipetrain.schedules.wire).

        A transport that matches messages by order (DistTransport) follows it. Computed on
        first use: the debug mode, which matches by name, never needs it.
        """
        if self._wire is None:
            self._wire = peer_orders(wire_orders(self._schedule), self.rank)
        return self._wire

    @property
    def acks(self) -> Acks:
        """Each message this rank receives -> the gradients it sent whose arrival that
        message proves (``pipetrain.schedules.acks``): the transport frees them then
        rather than at the end of the step."""
        if self._acks is None:
            self._acks = {
                _key(got): tuple(_key(sent) for sent in gradients)
                for got, gradients in gradient_acks(self._schedule)[self.rank].items()
            }
        return self._acks

    # ----------------------------------------------------------------- driving
    def begin(
        self,
        step: int,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        denominator: float,
        training: bool,
        where: str = "",
        extras: Mapping[str, Sequence[torch.Tensor]] | None = None,
    ) -> None:
        """Prepare a step: micro-batched inputs (first stages) and targets (last stages).

        ``where``: the step as errors name it (the caller's count; default ``step N``).
        ``extras``: micro-batched side inputs by name, for the stages that take them.
        """
        self._where = where or f"step {step}"
        self._inputs = inputs
        self._extras = extras or {}
        self._targets = targets
        self._denominator = denominator
        self._training = training
        self._pos = 0
        self._inbox.clear()
        self._outbox.clear()
        for runner in self._stages.values():
            runner.reset()

    def use_ranges(self, on: bool, *, nvtx: bool = False) -> None:
        """Run the next steps' actions inside named profiler ranges (``on``) or plainly.

        The ranged table is built on first use and swapped in whole, so ``run`` stays
        the same loop and a step without ranges pays nothing (pipetrain.runtime.ranges).
        """
        if on == self._ranges_on:  # most steps: nothing to swap
            return
        if on and self._ranged is None:
            self._ranged = ranged_handlers(self.actions, self._plain, nvtx=nvtx)
        self._handlers = self._ranged if on and self._ranged is not None else self._plain
        self._ranges_on = on

    @property
    def done(self) -> bool:
        return self._pos == len(self.actions)

    @property
    def position(self) -> int:
        """Index of the next action to run."""
        return self._pos

    @property
    def blocked_on(self) -> Action | None:
        return None if self.done else self.actions[self._pos]

    @property
    def where(self) -> str:
        """The step as errors name it (``begin``'s ``where``)."""
        return self._where

    def run(self) -> bool:
        """Run actions until the program ends (True) or a receive has nothing yet (False)."""
        actions, handlers, times = self.actions, self._handlers, self.clock.times
        clock = time.perf_counter_ns
        pos, end = self._pos, len(actions)
        try:
            while pos < end:
                # The start before the action runs: the action in progress is then the one
                # whose start is later than its end (the hang doctor, pipetrain.runtime.hang).
                times[2 * pos] = clock()
                if not handlers[pos](actions[pos]):
                    return False
                times[2 * pos + 1] = clock()
                pos += 1
        finally:
            self._pos = pos
        return True

    # ----------------------------------------------------------------- compute
    def _forward(self, action: Action) -> bool:
        self._transport.progress()
        stage, mb = action.stage, action.microbatch
        assert mb is not None
        runner = self._stages[stage]
        if self._compute_hook is not None:
            self._compute_hook(action)
        if runner.is_first:
            inputs: tuple[torch.Tensor, ...] = (self._inputs[mb],)
        else:
            inputs = self._take(action, MessageKey(stage, False, mb))
        target = self._targets[mb] if runner.is_last else None
        names = self._extra_names[stage]
        if names:
            extras = {name: self._extras[name][mb] for name in names}
            outputs = runner.forward(mb, inputs, target, self._denominator, self._training, extras)
        else:
            outputs = runner.forward(mb, inputs, target, self._denominator, self._training)
        if not runner.is_last:
            self._hand_over(stage, stage + 1, False, mb, outputs)
        return True

    def _backward(self, action: Action) -> bool:
        return self._run_backward(action, weights=True)

    def _backward_input(self, action: Action) -> bool:
        return self._run_backward(action, weights=False)

    def _run_backward(self, action: Action, weights: bool) -> bool:
        self._transport.progress()
        stage, mb = action.stage, action.microbatch
        assert mb is not None
        runner = self._stages[stage]
        if mb not in runner.saved:
            raise PipelineError(
                f"rank {self.rank}: {self._where}, action {action} runs before F{mb} of stage {stage}: "
                f"the schedule is invalid (validate it with pipetrain.schedules.validate)"
            )
        grads = None if runner.is_last else self._take(action, MessageKey(stage, True, mb))
        if self._compute_hook is not None:
            self._compute_hook(action)
        input_grads = runner.backward(mb, grads, weights)
        if not runner.is_first:
            self._hand_over(stage, stage - 1, True, mb, input_grads)
        return True

    def _weight(self, action: Action) -> bool:
        self._transport.progress()
        assert action.microbatch is not None
        if self._compute_hook is not None:
            self._compute_hook(action)
        self._stages[action.stage].weight(action.microbatch)
        return True

    def _hand_over(
        self, src: int, dst: int, is_grad: bool, mb: int, tensors: tuple[torch.Tensor, ...]
    ) -> None:
        key = MessageKey(dst, is_grad, mb)
        if dst in self._stages:
            # A neighbour on this rank: no message, the tensors change hands in memory.
            self._inbox[key] = tuple(t.detach() for t in tensors)
        else:
            self._outbox[key] = tensors

    def _take(self, action: Action, key: MessageKey) -> tuple[torch.Tensor, ...]:
        try:
            return self._inbox.pop(key)
        except KeyError:
            what = "gradient" if key.is_grad else "input"
            raise PipelineError(
                f"rank {self.rank}: {self._where}, action {action}: its {what} was never received; "
                f"the schedule lacks a RECV before it (lower it with pipetrain.schedules.lowering.lower)"
            ) from None

    # ----------------------------------------------------------------- messages
    def _send(self, action: Action) -> bool:
        stage, mb = action.stage, action.microbatch
        assert mb is not None
        is_grad = action.kind is Kind.SEND_B
        key = MessageKey(stage - 1 if is_grad else stage + 1, is_grad, mb)
        try:
            tensors = self._outbox.pop(key)
        except KeyError:
            raise PipelineError(
                f"rank {self.rank}: {self._where}, action {action} sends what no earlier action produced; "
                f"put it after the {'B/I' if is_grad else 'F'} of micro-batch {mb} on stage {stage}"
            ) from None
        self._transport.send(key, stage, tensors)
        return True

    def _recv_key(self, action: Action) -> tuple[MessageKey, int]:
        stage, mb = action.stage, action.microbatch
        assert mb is not None
        if action.kind is Kind.RECV_B:
            return MessageKey(stage, True, mb), stage + 1
        return MessageKey(stage, False, mb), stage - 1

    def _recv(self, action: Action) -> bool:
        key, src = self._recv_key(action)
        tensors = self._transport.recv(key, src)
        if tensors is None:
            return False
        self._inbox[key] = tensors
        return True

    # ----------------------------------------------------------------- step-level
    def _allreduce(self, action: Action) -> bool:
        self._reducer.start(action.stage)
        return True

    def _step(self, action: Action) -> bool:
        assert self._step_hook is not None and action.microbatch is not None
        self._step_hook(action.stage, action.microbatch)
        return True

    def loss_sum(self) -> float:
        """This rank's share of the step's loss (0 on a rank with no last stage)."""
        total = 0.0
        for stage in sorted(self._stages):
            value = self._stages[stage].loss_sum
            if value is not None:
                total += float(value)
        return total


def _key(message: Message) -> MessageKey:
    return MessageKey(message.dst_stage, message.is_grad, message.microbatch)


def _after_last_grads(
    actions: Sequence[Action], handlers: list[Callable[[Action], bool]], hook: GradsHook
) -> list[Callable[[Action], bool]]:
    """The handlers, with each stage's last B or W followed by ``hook(stage)``.

    Wrapping once, when the program is built, keeps the per-action loop free of checks.
    """
    last = {a.stage: pos for pos, a in enumerate(actions) if a.kind in (Kind.B, Kind.W)}
    wrapped = list(handlers)
    for stage, pos in last.items():
        wrapped[pos] = _then(handlers[pos], hook, stage)
    return wrapped


def _then(
    handler: Callable[[Action], bool], hook: GradsHook, stage: int
) -> Callable[[Action], bool]:
    def run(action: Action) -> bool:
        done = handler(action)
        if done:
            hook(stage)
        return done

    return run
