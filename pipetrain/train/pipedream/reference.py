"""A single-process reference for asynchronous pipelines, written without the runtime.

It replays a schedule's compute actions and STEPs on one process, the whole model split
into stage modules, and keeps the weight versions by hand: every version is a dict of
plain tensors, a forward runs ``torch.func.functional_call`` on fresh leaves of the
version its rule picks, and its backward uses those same leaves. Nothing here swaps
``p.data`` or packs saved tensors, so a runtime that gets stashing wrong disagrees with it.

The replay runs the ranks' programs in turns, an action as soon as what it needs is
done: ``F(s, k)`` after ``F(s-1, k)``, ``B(s, k)`` after ``B(s+1, k)``. Any such order
gives the same numbers: a stage's versions depend only on its own program's order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call

from pipetrain.models import PipelineSpec, build_stage
from pipetrain.runtime.stage import IGNORE_INDEX, token_cross_entropy
from pipetrain.schedules import Action, Kind, Schedule
from pipetrain.train.pipedream.plan import async_schedule

__all__ = ["ReferenceResult", "reference_run"]

# (parameters of one stage, in named_parameters order) -> its optimizer.
ReferenceOptimizer = Callable[[list[torch.nn.Parameter], list[str]], torch.optim.Optimizer]

_Version = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ReferenceResult:
    losses: tuple[float, ...]  # mean token loss of each training step
    weights: dict[str, torch.Tensor]  # newest weights by global name (stage modules merged)


class _StageState:
    def __init__(self, module: torch.nn.Module, make_optimizer: ReferenceOptimizer) -> None:
        self.module = module
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        # The optimizer's own copy of the newest weights, updated in place.
        self.master = [
            torch.nn.Parameter(p.detach().clone())
            for n, p in module.named_parameters()
            if p.requires_grad
        ]
        self.optimizer = make_optimizer(self.master, self.names)
        self.versions: dict[int, _Version] = {0: self.snapshot()}
        self.newest = 0
        self.grads: dict[str, torch.Tensor] = {}
        self.collected: list[int] = []
        self.saved: dict[
            int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], _Version]
        ] = {}

    def snapshot(self) -> _Version:
        return {n: p.detach().clone() for n, p in zip(self.names, self.master, strict=True)}


def reference_run(
    spec: PipelineSpec,
    split: Sequence[Sequence[int]],
    *,
    schedule: str,
    pp: int,
    microbatches: int,
    stream_steps: int,
    streams: int,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    make_optimizer: ReferenceOptimizer,
    lr_at: Callable[[int], float] | None = None,
    vertical_sync: bool = False,
    seed: int = 0,
) -> ReferenceResult:
    """Train ``streams x stream_steps`` steps on ``batches`` (one (inputs, targets) per step)."""
    built = async_schedule(schedule, pp, microbatches, stream_steps)
    stages = [
        _StageState(build_stage(spec, tuple(layers), seed=seed, device="cpu"), make_optimizer)
        for layers in split
    ]
    losses: list[float] = []
    for stream in range(streams):
        first_step = stream * stream_steps
        chunk = batches[first_step : first_step + stream_steps]
        inputs = torch.cat([b[0] for b in chunk]).chunk(built.microbatches)
        targets = torch.cat([b[1] for b in chunk]).chunk(built.microbatches)
        losses.extend(
            _replay(
                built,
                stages,
                inputs,
                targets,
                first_step * microbatches,
                microbatches,
                lr_at,
                vertical_sync,
            )
        )
    weights = {n: t for st in stages for n, t in st.versions[st.newest].items()}
    return ReferenceResult(tuple(losses), weights)


def _replay(
    schedule: Schedule,
    stages: list[_StageState],
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    first_mb: int,
    window: int,
    lr_at: Callable[[int], float] | None,
    vertical_sync: bool,
) -> list[float]:
    """One stream: every rank's program run to its end; the mean loss of each step."""
    replay = _Replay(schedule, stages, inputs, targets, first_mb, window, lr_at, vertical_sync)
    programs = [list(row) for row in schedule.actions]
    positions = [0] * len(programs)
    while any(pos < len(row) for pos, row in zip(positions, programs, strict=True)):
        progressed = False
        for r, row in enumerate(programs):
            while positions[r] < len(row) and replay.ready(row[positions[r]]):
                replay.run(row[positions[r]])
                positions[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("reference replay is stuck: the schedule is invalid")
    return replay.step_losses()


class _Replay:
    """What one stream's actions share: the activations and input gradients in flight
    between stages, each micro-batch's loss, and the version stage 0 gave it."""

    def __init__(
        self,
        schedule: Schedule,
        stages: list[_StageState],
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        first_mb: int,
        window: int,
        lr_at: Callable[[int], float] | None,
        vertical_sync: bool,
    ) -> None:
        self.schedule, self.stages = schedule, stages
        self.inputs, self.targets = inputs, targets
        self.first_mb, self.window = first_mb, window
        self.lr_at, self.vertical_sync = lr_at, vertical_sync
        self.last = len(stages) - 1
        self.counts = [float((t != IGNORE_INDEX).sum()) for t in targets]
        self.loss_sums = [0.0] * len(targets)
        self.first_versions: dict[int, int] = {}  # micro-batch -> version stage 0 used
        self.base = stages[0].newest  # versions made before this stream, the same on every stage
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.input_grads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.done: set[Action] = set()

    def ready(self, a: Action) -> bool:
        """``F(s, k)`` after ``F(s-1, k)``, ``B(s, k)`` after ``B(s+1, k)``."""
        k = a.microbatch
        if a.kind is Kind.F:
            return a.stage == 0 or Action(a.stage - 1, Kind.F, k) in self.done
        if a.kind is Kind.B:
            return a.stage == self.last or Action(a.stage + 1, Kind.B, k) in self.done
        return True

    def run(self, a: Action) -> None:
        assert a.microbatch is not None
        if a.kind is Kind.F:
            self.forward(a.stage, a.microbatch)
        elif a.kind is Kind.B:
            self.backward(a.stage, a.microbatch)
        elif a.kind is Kind.STEP:
            self.step(a.stage, a.microbatch)
        self.done.add(a)

    def version_for(self, s: int, k: int) -> int:
        if self.schedule.name == "pipedream-2bw":
            # Windows count from the stream's start: its first window uses the newest.
            return self.base + max(k // self.window - 1, 0)
        if self.vertical_sync and s > 0:
            return self.first_versions[k]  # the version that travels with the activations
        return self.stages[s].newest

    def forward(self, s: int, k: int) -> None:
        st = self.stages[s]
        v = self.version_for(s, k)
        if s == 0:
            self.first_versions[k] = v
        leaves = {n: t.detach().requires_grad_() for n, t in st.versions[v].items()}
        x = (
            (self.inputs[k],)
            if s == 0
            else tuple(
                t.detach().requires_grad_(t.is_floating_point())
                for t in self.outputs.pop((s - 1, k))
            )
        )
        out = functional_call(st.module, leaves, x)
        out = out if isinstance(out, tuple) else (out,)
        if s == self.last:
            loss = token_cross_entropy(out[0], self.targets[k])
            self.loss_sums[k] = float(loss.detach())
            out = (loss,)
        else:
            self.outputs[(s, k)] = out
        st.saved[k] = (x, out, leaves)

    def backward(self, s: int, k: int) -> None:
        st = self.stages[s]
        x, out, leaves = st.saved.pop(k)
        if s == self.last:
            torch.autograd.backward(out)
        else:
            grads = self.input_grads.pop((s + 1, k))
            floating = [o for o in out if o.is_floating_point()]
            pairs = [(o, g) for o, g in zip(floating, grads, strict=True) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if s > 0:
            self.input_grads[(s, k)] = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t) for t in x if t.requires_grad
            )
        for n, leaf in leaves.items():
            if leaf.grad is not None:
                acc = st.grads.get(n)
                st.grads[n] = leaf.grad if acc is None else acc + leaf.grad
        st.collected.append(k)

    def step(self, s: int, k: int) -> None:
        st = self.stages[s]
        tokens = sum(self.counts[j] for j in st.collected)
        for n, p in zip(st.names, st.master, strict=True):
            g = st.grads.get(n)
            p.grad = None if g is None else g / max(tokens, 1.0)
        if self.lr_at is not None:
            for group in st.optimizer.param_groups:
                group["lr"] = self.lr_at((self.first_mb + k) // self.window)
        st.optimizer.step()
        st.grads.clear()
        st.collected.clear()
        st.newest += 1
        # Every version is kept: memory is not what this reference checks.
        st.versions[st.newest] = st.snapshot()

    def step_losses(self) -> list[float]:
        """The mean token loss of each step: its window's loss sums over its tokens."""
        w = self.window
        return [
            sum(self.loss_sums[i * w : (i + 1) * w])
            / max(sum(self.counts[i * w : (i + 1) * w]), 1.0)
            for i in range(len(self.targets) // w)
        ]
