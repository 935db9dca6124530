"""AdamW, the learning-rate schedule, and the guarded update: global clipping, NaN skip.

The update of a pipeline step is decided once for all stages. Each rank sums the squares
of its own gradients (a tied weight held by two stages counted once), the sums are
all-reduced over the pipeline group together with a "something was not finite" count,
and every rank derives the same global norm, the same clip factor and the same decision
to step or to skip. Clipping per stage would use only that stage's norm (2.196 and 1.519
where the true norm was 2.671, see shared/reference/torch-on-cpu.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipetrain.config.schema import OptimConfig
from pipetrain.errors import RunFailed
from pipetrain.parallel.sync import Gradients
from pipetrain.tensors import local_tensor

__all__ = [
    "GradCheck",
    "Gradients",
    "GuardedUpdate",
    "StepOutcome",
    "TrainingDiverged",
    "build_optimizer",
    "check_gradients",
    "local_grads",
    "lr_at",
    "param_groups",
]

# Same guard as torch.nn.utils.clip_grad_norm_, so one process matches torch exactly.
_CLIP_EPS = 1e-6


class TrainingDiverged(RunFailed):
    """Too many updates in a row were skipped for a non-finite loss or gradient."""


def _decays(name: str, param: torch.Tensor) -> bool:
    """Weight decay shrinks matrices; norms' gains, biases and other vectors are left alone."""
    leaf = name.rsplit(".", 1)[-1]
    return param.ndim >= 2 and leaf != "bias" and "norm" not in name


def param_groups(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, object]]:
    """Two AdamW groups: matrices with ``weight_decay``, everything else without."""
    decay: list[torch.nn.Parameter] = []
    keep: list[torch.nn.Parameter] = []
    for name, param in named_parameters:
        if param.requires_grad:
            (decay if _decays(name, param) else keep).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]


def build_optimizer(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], config: OptimConfig
) -> torch.optim.AdamW:
    """AdamW over these parameters (fp32 master weights: the parameters themselves)."""
    return torch.optim.AdamW(
        param_groups(named_parameters, config.weight_decay),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
    )


def lr_at(step: int, config: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (from 0): linear warm-up, then cosine decay."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    floor = config.lr * config.min_lr_ratio
    span = max(1, total_steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return floor + 0.5 * (config.lr - floor) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class GradCheck:
    """The global gradient norm and whether the loss and every gradient were finite."""

    norm: float
    finite: bool


def local_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's part of each existing gradient (the shard of a DTensor one)."""
    return [local_tensor(p.grad) for p in params if p.grad is not None]


def check_gradients(grads: Gradients, loss: float, group: dist.ProcessGroup | None) -> GradCheck:
    """Global norm over every rank of ``group`` (None: this process holds all stages)."""
    device = next((p.device for p in grads.all), torch.device("cpu"))
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in local_grads(grads.counted):
        squares += torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2
    # Loss and every gradient, tied copies included, must be finite on every rank. The
    # count stays on the device until the one read below: a test per tensor on the host
    # would wait for the device once per gradient, every step.
    counted = {id(p) for p in grads.counted}
    bad = torch.zeros((), dtype=torch.float64, device=device)
    for grad in local_grads(p for p in grads.all if id(p) not in counted):
        bad += ~torch.isfinite(grad).all()
    finite = torch.isfinite(squares)
    bad += ~finite
    # An inf or NaN in the sum would poison the norm: send the count instead.
    squares = torch.where(finite, squares, torch.zeros_like(squares))
    if not math.isfinite(loss):
        bad += 1
    local = torch.stack([squares, bad])
    if group is not None:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    total, bad_count = local.tolist()
    return GradCheck(math.sqrt(total), bad_count == 0.0)


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did, the same on every rank."""

    lr: float
    # Global norm of the (accumulated) gradient before clipping; nan when skipped.
    grad_norm: float
    # Factor the gradients were multiplied by (1.0 = not clipped).
    clip_factor: float
    skipped: bool
    # Consecutive skipped updates, this one included.
    bad_in_row: int


class GuardedUpdate:
    """Scale, check, clip and step (or skip) the optimizer of one rank."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimConfig,
        *,
        total_steps: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        self._optimizer = optimizer
        self._config = config
        self._total_steps = total_steps
        self._group = group
        self._bad_in_row = 0

    def apply(
        self, step: int, grads: Gradients, loss: float, *, accumulated: int = 1
    ) -> StepOutcome:
        """Update with the gradients summed over ``accumulated`` pipeline steps.

        Each pipeline step's gradient is that of its mean loss, so the sum is divided by
        ``accumulated``. Raises ``TrainingDiverged`` after ``max_bad_steps`` skips in a row.
        """
        lr = lr_at(step, self._config, self._total_steps)
        if accumulated > 1:
            torch._foreach_mul_(local_grads(grads.all), 1.0 / accumulated)
        check = check_gradients(grads, loss, self._group)
        if not check.finite:
            self._optimizer.zero_grad(set_to_none=True)
            self._bad_in_row += 1
            if self._bad_in_row >= self._config.max_bad_steps:
                raise TrainingDiverged(
                    f"step {step + 1}: loss or gradients were not finite for {self._bad_in_row} steps in a row "
                    f"(optim.max_bad_steps = {self._config.max_bad_steps}): lower --lr or raise "
                    f"optim.warmup_steps (under --precision bf16, also try fp32)"
                )
            return StepOutcome(lr, math.nan, 1.0, True, self._bad_in_row)
        self._bad_in_row = 0
        factor = 1.0
        if self._config.grad_clip > 0 and check.norm > self._config.grad_clip:
            factor = self._config.grad_clip / (check.norm + _CLIP_EPS)
            torch._foreach_mul_(local_grads(grads.all), factor)
        for group in self._optimizer.param_groups:
            group["lr"] = lr
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        return StepOutcome(lr, check.norm, factor, False, 0)
