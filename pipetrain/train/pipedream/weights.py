"""Weight versions of asynchronous schedules: PipeDream's stashing, 2BW's double buffer.

In a schedule without a flush a stage updates its weights (STEP) while micro-batches that
went forward with the old weights still have to come back. ``WeightVersions`` keeps, per
stage, every version some micro-batch still needs, and frees it when none does:

- before ``F(s, k)`` the stage's parameters are pointed (``p.data``, no copy) at the
  version the rule picks for micro-batch k, and k is recorded as a user of it;
- every tensor the forward saves for its backward is packed as a detached alias
  (``saved_tensors_hooks``), so the backward computes with the values its forward saw,
  whatever ``p.data`` holds by then; ``B(s, k)`` only drops k's hold on its version;
- ``STEP(s, k)`` points the parameters at a fresh copy of the newest version and runs the
  optimizer on it in place: the update goes to the newest weights, and no stashed version
  is ever written to (so autograd's in-place checks, skipped by the packing, are not
  needed: a version's storage never changes after it is made).

Rules (which version a forward uses):

- ``latest`` (PipeDream): the newest version of the stage when its forward runs. Rank r of
  a linear 1F1B stream then holds ``p - r`` versions.
- ``vertical`` (PipeDream with vertical sync): the version the first stage used for the
  same micro-batch (the number of first-stage STEPs before ``F(0, k)``). Every rank reads
  that number from the schedule, which is data on every rank, instead of receiving it with
  the activations: the same number, without a message.
- ``window`` (PipeDream-2BW): micro-batch k of window w (m = ``window`` micro-batches each)
  uses version ``max(w - 1, 0)``; with a STEP after each window that is the update rule
  W(t+1) = W(t) - lr * grad f(W(t-1)) (W(-1) = W(0)), and at most two versions live.

Streams. Version numbers continue from one ``stream`` to the next, and each stream drains
at its end. A drain starts the next stream the way the run starts: nothing is in flight,
so PipeDream's next forwards take the newest version, and 2BW's first window uses the
newest version too (windows are counted from the stream's start: W(-1) = W(0) again).
Between streams each stage therefore holds exactly one version, its parameters: a
checkpoint there needs nothing beyond weights and optimizer state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.runtime.errors import PipelineInputError
from pipetrain.schedules import Action, Kind, Schedule

__all__ = ["RULES", "StageVersionStats", "WeightVersions", "rule_for"]

RULES = ("latest", "vertical", "window")

# (stage, micro-batch of the stream) -> factor for the gradients accumulated for a STEP.
GradScale = Callable[[int, int], float]


def rule_for(schedule: Schedule, *, vertical_sync: bool = False) -> str:
    """The version rule of an asynchronous schedule (``pipedream`` or ``pipedream-2bw``)."""
    if schedule.name == "pipedream-2bw":
        if vertical_sync:
            raise PipelineInputError(
                "vertical_sync is for pipedream: pipedream-2bw already gives every stage of a "
                "micro-batch the same version; drop --vertical-sync"
            )
        return "window"
    if not schedule.asynchronous:
        raise PipelineInputError(
            f"schedule {schedule.name!r} is synchronous: weight versions are for pipedream and "
            f"pipedream-2bw"
        )
    return "vertical" if vertical_sync else "latest"


@dataclass(frozen=True)
class StageVersionStats:
    """What one stage's versions did: the most alive at once, and how many were made."""

    stage: int
    peak: int
    created: int


class _Stage:
    """The versions of one stage's parameters."""

    def __init__(self, stage: int, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.stage = stage
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = optimizer
        # Version number -> one tensor per parameter. Never written to after it is made.
        self.versions: dict[int, tuple[torch.Tensor, ...]] = {
            0: tuple(p.detach() for p in self.params)
        }
        self.newest = 0
        self.users: dict[int, int] = {}  # micro-batch in flight -> version its forward used
        self.done: set[int] = set()  # micro-batches of this stream whose backward ran
        self.next_undone = 0  # the first micro-batch of this stream still to come back
        self.peak = 1
        self.created = 0

    def point_at(self, version: int) -> None:
        for p, data in zip(self.params, self.versions[version], strict=True):
            p.data = data

    def free(self, oldest_needed: int | None) -> None:
        """Drop every version that neither an in-flight nor a later micro-batch needs.

        ``oldest_needed``: the oldest version a micro-batch still to come will use (None:
        later forwards take the newest). Rules keep their versions in micro-batch order.
        """
        keep = set(self.users.values()) | {self.newest}
        for version in list(self.versions):
            if version not in keep and (oldest_needed is None or version < oldest_needed):
                del self.versions[version]
        self.peak = max(self.peak, len(self.versions))

    def finish(self, microbatch: int) -> None:
        self.users.pop(microbatch, None)
        self.done.add(microbatch)
        while self.next_undone in self.done:
            self.next_undone += 1


class WeightVersions:
    """The weight versions of this process's stages under one rule; feeds the runtime's hooks.

    Pass ``compute_hook`` and ``step_hook`` to ``build_pipeline`` (``PipelineHooks``) and run
    every training step inside ``stream()``. ``optimizers`` maps each stage here to an
    optimizer holding its parameters (stages may share one: a STEP hides the others'
    gradients).
    ``grad_scale(stage, k)`` multiplies the gradients before the STEP that follows
    backward k (the runtime divides every loss by the tokens of the whole stream; an
    update wants the mean over its own micro-batches).
    """

    def __init__(
        self,
        schedule: Schedule,
        modules: Mapping[int, nn.Module],
        optimizers: Mapping[int, torch.optim.Optimizer],
        *,
        rule: str,
        grad_scale: GradScale | None = None,
    ) -> None:
        if rule not in RULES:
            raise PipelineInputError(f"version rule {rule!r}: use one of {', '.join(RULES)}")
        if set(modules) != set(optimizers):
            raise PipelineInputError(
                f"optimizers for stages {sorted(optimizers)} but modules of stages {sorted(modules)}: "
                f"give one optimizer per stage"
            )
        self.rule = rule
        self.window = dict(schedule.params).get("window", 1)
        self._stages = {s: _Stage(s, modules[s], optimizers[s]) for s in sorted(modules)}
        # Stage -> parameters of the other stages here that share its optimizer.
        self._shared = {
            s: [
                p
                for other in self._stages.values()
                if other.stage != s and other.optimizer is st.optimizer
                for p in other.params
            ]
            for s, st in self._stages.items()
        }
        self._grad_scale = grad_scale
        self._first_stage_steps = _steps_before_forwards(schedule, stage=0)
        self._version_offset = 0  # the versions made before this stream (every stage alike)
        self._training = False

    # ------------------------------------------------------------------ streams
    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Run one stream (a ``Pipeline.step``) inside this context.

        Saved tensors are packed as detached aliases while it runs (see the module doc).
        When it ends every micro-batch has come back: only the newest version remains, and
        the parameters hold it (for evaluation and checkpoints).
        """
        newest = {st.newest for st in self._stages.values()}
        if len(newest) > 1:
            raise PipelineInputError(
                f"stages here start a stream at different versions {sorted(newest)}: a "
                f"stream must start after a drained one"
            )
        self._version_offset = min((st.newest for st in self._stages.values()), default=0)
        for st in self._stages.values():
            # Between streams the parameters are the truth: a checkpoint load may have
            # replaced or overwritten them.
            st.versions = {st.newest: tuple(p.detach() for p in st.params)}
            st.users.clear()
            st.done.clear()
            st.next_undone = 0
        self._training = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                yield
        finally:
            self._training = False
            for st in self._stages.values():
                st.users.clear()
                st.point_at(st.newest)
                st.free(None)

    # ------------------------------------------------------------------ the hooks
    def compute_hook(self, action: Action) -> None:
        st = self._stages.get(action.stage)
        if st is None or action.microbatch is None:
            return
        if not self._training:
            if action.kind is Kind.F:
                return  # evaluation: the parameters hold the newest versions
            # Without the stream's packing the backward meets parameters that a STEP has
            # updated in place (autograd fails after some stages have stepped already).
            raise _outside_stream(action)
        k = action.microbatch
        if action.kind is Kind.F:
            version = self._version_for(st, k)
            st.users[k] = version
            st.point_at(version)
            st.free(self._needed(st.next_undone))
        elif action.kind in (Kind.B, Kind.I):
            # The saved tensors already hold the forward's values; k lets go of its version.
            st.finish(k)
            st.free(self._needed(st.next_undone))

    def step_hook(self, stage: int, microbatch: int) -> None:
        if not self._training:
            raise _outside_stream(Action(stage, Kind.STEP, microbatch))
        st = self._stages[stage]
        scale = 1.0 if self._grad_scale is None else self._grad_scale(stage, microbatch)
        # A fresh copy of the newest version takes the in-place update; stashed versions
        # (some micro-batch's saved tensors alias them) stay as they were.
        for p, data in zip(st.params, st.versions[st.newest], strict=True):
            p.data = data.clone()
            if p.grad is not None and scale != 1.0:
                p.grad.mul_(scale)
        # An optimizer shared with other stages here must not step their pending gradients.
        hidden = [(p, p.grad) for p in self._shared[stage]]
        for p, _ in hidden:
            p.grad = None
        st.optimizer.step()
        st.optimizer.zero_grad(set_to_none=True)
        for p, grad in hidden:
            p.grad = grad
        st.newest += 1
        st.created += 1
        st.versions[st.newest] = tuple(p.detach() for p in st.params)
        st.free(self._needed(st.next_undone))

    def _needed(self, k: int) -> int | None:
        """The version micro-batch k of this stream will use (None: the newest then)."""
        if self.rule == "latest":
            return None
        if self.rule == "vertical":
            steps = self._first_stage_steps.get(k)
            return None if steps is None else self._version_offset + steps
        return self._version_offset + max(k // self.window - 1, 0)

    def _version_for(self, st: _Stage, k: int) -> int:
        version = self._needed(k)
        if version is None:
            return st.newest
        if version not in st.versions:
            raise PipelineInputError(
                f"stage {st.stage}: micro-batch {k} needs weight version {version}, which was "
                f"freed or not made yet (versions {sorted(st.versions)}): the schedule does not "
                f"fit rule {self.rule!r}"
            )
        return version

    # ------------------------------------------------------------------ reports, resume
    def stats(self) -> tuple[StageVersionStats, ...]:
        """Per stage here: the most versions alive at once, and how many STEPs made one."""
        return tuple(StageVersionStats(s, st.peak, st.created) for s, st in self._stages.items())

    def live(self) -> dict[int, int]:
        """Stage -> versions alive now."""
        return {s: len(st.versions) for s, st in self._stages.items()}


def _outside_stream(action: Action) -> PipelineInputError:
    return PipelineInputError(
        f"{action} of a training step ran outside WeightVersions.stream(): run every step "
        f"of an asynchronous schedule inside 'with versions.stream():'"
    )


def _steps_before_forwards(schedule: Schedule, *, stage: int) -> dict[int, int]:
    """Micro-batch -> number of STEPs of ``stage`` before its forward, in program order."""
    placement = schedule.placement
    if stage >= placement.num_stages:
        return {}
    row = schedule.actions[placement.rank_of(stage)]
    steps, out = 0, {}
    for a in row:
        if a.stage != stage:
            continue
        if a.kind is Kind.STEP:
            steps += 1
        elif a.kind is Kind.F and a.microbatch is not None:
            out[a.microbatch] = steps
    return out


def _pack(t: torch.Tensor) -> torch.Tensor:
    # A detached alias: the same storage (the version the forward used), its own version
    # counter, so the later in-place update of the parameter does not trip autograd.
    return t.detach()


def _unpack(t: Any) -> torch.Tensor:
    tensor: torch.Tensor = t
    return tensor
