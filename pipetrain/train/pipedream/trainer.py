"""Asynchronous pipeline training: PipeDream (weight stashing) and PipeDream-2BW.

A run of N training steps of m micro-batches is cut into streams of ``stream_steps``
steps. One stream is one ``pipedream(p, m, stream_steps)`` (or ``pipedream_2bw``)
schedule: ``m x stream_steps`` micro-batches go through the 1F1B order without a flush, a
STEP after every backward (PipeDream) or after every m backwards (2BW), and the pipeline
drains only at the stream's end. ``stream_steps`` equal to N is one stream for the whole
run. A drain restarts staleness the way the run's start does (see
pipetrain.train.pipedream.weights): the forwards after it use the newest weights. Checkpoints,
evaluation and logging happen between streams, where nothing is in flight and every
stage holds one version: a save there is a drain-at-save-time checkpoint of weights and
optimizer state, and a resumed run cuts the same streams as an uninterrupted one, so it
continues exactly.

What an update does. The gradient of a STEP is the mean over the tokens of the
micro-batches whose backwards it collects (one for PipeDream, m for 2BW): the runtime
divides every loss by the tokens of the whole stream, and the STEP multiplies back. The
learning rate of a STEP is ``lr_at(step)`` for the training step its last micro-batch
belongs to. There is no gradient clipping (a global norm per STEP would be a collective
after every backward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.errors import InputError
from pipetrain.models import PipelineSpec
from pipetrain.runtime import Pipeline, PipelineHooks, build_pipeline
from pipetrain.runtime.stage import IGNORE_INDEX, token_cross_entropy
from pipetrain.schedules import Action, Kind
from pipetrain.schedules.execution import Timeline
from pipetrain.train.pipedream.plan import ASYNC_SCHEDULES, async_schedule
from pipetrain.train.pipedream.weights import StageVersionStats, WeightVersions, rule_for

__all__ = [
    "ASYNC_SCHEDULES",
    "AsyncInputError",
    "AsyncTrainer",
    "OptimizerFactory",
    "StreamResult",
    "async_schedule",
    "predicted_versions",
]

# (named parameters of one stage) -> the optimizer of that stage.
OptimizerFactory = Callable[[Iterable[tuple[str, nn.Parameter]]], torch.optim.Optimizer]


class AsyncInputError(InputError):
    """A setting that an asynchronous run cannot use."""


@dataclass(frozen=True)
class StreamResult:
    """One stream: the loss of each training step in it, the same on every rank."""

    losses: tuple[float, ...]  # mean loss per target token of each step (m micro-batches)
    tokens: int
    wall_s: float
    timeline: Timeline


def predicted_versions(
    schedule_name: str, pp: int, microbatches: int, steps: int
) -> tuple[int, ...]:
    """The simulator's weight versions per rank for this stream (unit costs)."""
    from pipetrain.sim import simulate

    return simulate(async_schedule(schedule_name, pp, microbatches, steps)).weight_versions


class AsyncTrainer:
    """This process's stages of an asynchronous pipeline, trained stream by stream."""

    def __init__(
        self,
        spec: PipelineSpec,
        *,
        schedule: str,
        pp: int,
        microbatches: int,
        stream_steps: int,
        make_optimizer: OptimizerFactory,
        lr_at: Callable[[int], float] | None = None,
        vertical_sync: bool = False,
        group: Any = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        split: Sequence[Sequence[int]] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if stream_steps < 1:
            raise AsyncInputError(f"stream_steps is {stream_steps}: use 1 or more steps per stream")
        built = async_schedule(schedule, pp, microbatches, stream_steps)
        self._last_stage = built.placement.num_stages - 1
        self.window = microbatches
        self.stream_steps = stream_steps
        self._group = group
        self._lr_at = lr_at
        self._current: dict[int, int] = {}  # stage -> micro-batch of its running forward
        self._pending: dict[int, list[int]] = {}  # stage -> backwards since its last STEP
        self._loss_sums: dict[int, torch.Tensor] = {}  # micro-batch -> summed token loss
        self._counts: list[float] = []  # target tokens of each micro-batch of the stream
        self._first_mb = 0
        self.pipeline: Pipeline = build_pipeline(
            spec,
            schedule=built,
            microbatches=built.microbatches,
            group=group,
            ranks=None if group is not None else pp,
            device=device,
            seed=seed,
            split=split,
            loss_fn=self._loss,
            loss_reduction="sum",  # token_cross_entropy's, recorded per micro-batch
            timeout_s=timeout_s,
            hooks=PipelineHooks(step_hook=self._step_hook, compute_hook=self._compute_hook),
        )
        modules = dict(zip(self.pipeline.stages, self.pipeline.modules, strict=True))
        if any(module.tied_parameters() for module in modules.values()) and pp > 1:
            raise AsyncInputError(
                "asynchronous schedules update each stage on its own and cannot keep a weight "
                "tied across stages in step: use a model without tied embeddings (e.g. llama-tiny)"
            )
        # One optimizer for this process's stages (a checkpoint saves it like a synchronous
        # run's); a STEP of one stage steps only that stage's parameters.
        self.optimizer = make_optimizer(self.pipeline.named_parameters())
        self.versions = WeightVersions(
            self.pipeline.schedule,
            modules,
            {s: self.optimizer for s in modules},
            rule=rule_for(built, vertical_sync=vertical_sync),
            grad_scale=self._grad_scale,
        )
        self._placement = built.placement
        self.schedule_name = schedule

    # ------------------------------------------------------------------ hooks
    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = token_cross_entropy(logits, targets)
        self._loss_sums[self._current[self._last_stage]] = loss.detach()
        return loss

    def _compute_hook(self, action: Action) -> None:
        assert action.microbatch is not None
        if action.kind is Kind.F:
            self._current[action.stage] = action.microbatch
        elif action.kind is Kind.B:
            self._pending.setdefault(action.stage, []).append(action.microbatch)
        self.versions.compute_hook(action)

    def _grad_scale(self, stage: int, microbatch: int) -> float:
        collected = self._pending.pop(stage, [microbatch])
        tokens = sum(self._counts[k] for k in collected)
        return sum(self._counts) / max(tokens, 1.0)

    def _step_hook(self, stage: int, microbatch: int) -> None:
        if self._lr_at is not None:
            lr = self._lr_at((self._first_mb + microbatch) // self.window)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.versions.step_hook(stage, microbatch)

    # ------------------------------------------------------------------ streams
    @property
    def microbatches_per_stream(self) -> int:
        return self.window * self.stream_steps

    def train_stream(
        self, first_step: int, inputs: torch.Tensor | None, targets: torch.Tensor | None
    ) -> StreamResult:
        """Train ``stream_steps`` steps from step ``first_step``: batches stacked on dim 0.

        ``inputs``/``targets`` are (stream_steps x batch, T): the steps' batches one after
        the other (ranks without a first or last stage may pass None).
        """
        mbs = self.microbatches_per_stream
        device = self.pipeline.device
        counts = torch.zeros(mbs, dtype=torch.float64, device=device)
        if targets is not None:
            for k, chunk in enumerate(targets.chunk(mbs, dim=0)):
                counts[k] = float((chunk != IGNORE_INDEX).sum())
        self._reduce(counts, dist.ReduceOp.MAX)
        self._counts = counts.tolist()
        self._first_mb = first_step * self.window
        self._loss_sums.clear()
        self._pending.clear()
        started = time.perf_counter()
        # Errors name the training steps of the stream as the run counts them (a resumed
        # run's too), not the pipeline's count of streams, which restarts at 1.
        last = first_step + self.stream_steps
        label = (
            f"training step {last}"
            if self.stream_steps == 1
            else f"the stream of training steps {first_step + 1}-{last}"
        )
        with self.versions.stream():
            result = self.pipeline.step(inputs, targets, label=label)
        wall = time.perf_counter() - started
        sums = torch.zeros(mbs, dtype=torch.float64, device=device)
        for k, value in self._loss_sums.items():
            sums[k] = float(value)
        self._reduce(sums, dist.ReduceOp.SUM)
        losses = []
        for step in range(self.stream_steps):
            window = slice(step * self.window, (step + 1) * self.window)
            losses.append(float(sums[window].sum()) / max(float(counts[window].sum()), 1.0))
        return StreamResult(tuple(losses), int(counts.sum()), wall, result.timeline)

    def eval_loss(
        self, batches: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]]
    ) -> float:
        """Mean token loss over ``batches`` (each (inputs, targets)), forward only.

        The pipeline splits what it gets into a stream's micro-batches, so ``stream_steps``
        batches go in together; the last group is filled up with repeated batches whose
        losses are left out, so every batch counts once, as in a synchronous run.
        """
        if not batches:
            raise AsyncInputError("eval_loss needs at least one batch")
        n, mbs = self.stream_steps, self.microbatches_per_stream
        device = self.pipeline.device
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, tokens
        for g in range(-(-len(batches) // n)):
            chosen = [g * n + i for i in range(n)]
            group = [batches[i % len(batches)] for i in chosen]
            targets = _cat([b[1] for b in group])
            self._loss_sums.clear()
            self.pipeline.eval_loss(_cat([b[0] for b in group]), targets)
            if self._last_stage not in self.pipeline.stages or targets is None:
                continue  # the rank with the last stage adds the losses
            for k, chunk in enumerate(targets.chunk(mbs, dim=0)):
                if chosen[k // self.window] < len(batches):
                    totals[0] += float(self._loss_sums[k])
                    totals[1] += float((chunk != IGNORE_INDEX).sum())
        self._reduce(totals, dist.ReduceOp.SUM)
        return float(totals[0]) / max(float(totals[1]), 1.0)

    def _reduce(self, tensor: torch.Tensor, op: Any) -> None:
        if self._group is not None:
            dist.all_reduce(tensor, op=op, group=self._group)

    # ------------------------------------------------------------------ reports
    def version_stats(self) -> tuple[StageVersionStats, ...]:
        """Per stage in this process: most weight versions alive at once, versions made."""
        return self.versions.stats()

    def rank_peaks(self) -> tuple[int, ...]:
        """Per pipeline rank, the most versions alive at once on one of its stages."""
        local = {self._placement.rank_of(s.stage): s.peak for s in self.version_stats()}
        ranks = self._placement.num_ranks
        peaks = torch.zeros(ranks, dtype=torch.float64, device=self.pipeline.device)
        for r, peak in local.items():
            peaks[r] = float(peak)
        self._reduce(peaks, dist.ReduceOp.MAX)
        return tuple(int(v) for v in peaks.tolist())


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [p for p in parts if p is not None]
    return torch.cat(present, dim=0) if len(present) == len(parts) else None
