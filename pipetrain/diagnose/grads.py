"""The gradient report: per parameter, its gradient norm, weight norm and their ratio, with
flags for what deserves a look (no gradient, zero, non-finite, vanishing, exploding).

Three steps, each a plain function:

    measured = measure(params)            # this process: sums of squares of what it holds
    merged = merge(everyone's measured)   # one entry per (stage, name): shards added up
    table = report_rows(merged, bounds, step=5)
    print(format_report(table, ...)); rows to JSONL with row_json

``measure`` works on the tensors this process holds (a DTensor's local shard), so that a
parameter split over tensor-parallel or FSDP2 ranks is measured by adding its shards'
squares in ``merge``; the caller sends each parameter's squares from the ranks that hold
distinct parts of it only (a replicated tensor once). Only ``measure`` touches torch.

"No gradient" is the classic check for a parameter left out of the forward (unused) or
frozen by mistake: after a backward every parameter the loss depends on has a ``.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.tensors import local_tensor as _local

__all__ = [
    "GradBounds",
    "GradRow",
    "Measured",
    "format_report",
    "measure",
    "merge",
    "report_rows",
    "row_json",
    "stage_norms",
]

# Flags, in the order a row lists them.
NO_GRAD = "no-grad"
FROZEN = "frozen"
ZERO = "zero"
NON_FINITE = "non-finite"
VANISHING = "vanishing"
EXPLODING = "exploding"


@dataclass(frozen=True)
class GradBounds:
    """Gradient norms outside (vanishing, exploding) are flagged; 0 turns a bound off."""

    vanishing: float = 1e-8
    exploding: float = 10.0


@dataclass(frozen=True)
class Measured:
    """One parameter (or one rank's part of it) as sums of squares, ready to add up."""

    stage: int
    name: str
    numel: int
    grad_sq: float | None  # None: no gradient (on every part)
    weight_sq: float
    finite: bool  # every part's gradient finite
    requires_grad: bool
    in_norm: bool  # enters the global norm (a tied weight's second copy does not)


@dataclass(frozen=True)
class GradRow:
    """One parameter of the report at one optimizer step."""

    step: int
    stage: int
    name: str
    numel: int
    grad_norm: float | None  # None: no gradient
    weight_norm: float
    ratio: float | None  # grad_norm / weight_norm; None without a gradient or a weight
    flags: tuple[str, ...]
    in_norm: bool


def measure(
    params: Iterable[tuple[int, str, torch.Tensor]],
    *,
    scale: float = 1.0,
    in_norm: Callable[[str, torch.Tensor], bool] = lambda name, param: True,
) -> list[Measured]:
    """(stage, global name, parameter) -> sums of squares of this process's part of each.

    ``scale`` multiplies the gradients as the optimizer will see them (1 / accumulated
    steps). All squares are summed on the device in float64 and read once.
    """
    items = list(params)
    if not items:
        return []
    sums: list[torch.Tensor] = []
    for _, _, param in items:
        weight = _local(param.detach())
        grad = _local(param.grad) if param.grad is not None else torch.zeros_like(weight)
        sums.append(torch.linalg.vector_norm(weight, dtype=torch.float64) ** 2)
        squares = torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2
        sums.append(squares * (scale * scale))
        sums.append(torch.isfinite(grad).all().to(torch.float64))
    values = torch.stack([s.to(sums[0].device) for s in sums]).tolist()  # one read
    measured = []
    for i, (stage, name, param) in enumerate(items):
        weight_sq, grad_sq, finite = values[3 * i : 3 * i + 3]
        measured.append(
            Measured(
                stage=stage,
                name=name,
                numel=_local(param.detach()).numel(),
                grad_sq=None if param.grad is None else grad_sq,
                weight_sq=weight_sq,
                finite=bool(finite) and math.isfinite(grad_sq),
                requires_grad=param.requires_grad,
                in_norm=in_norm(name, param),
            )
        )
    return measured


def merge(parts: Iterable[Measured]) -> list[Measured]:
    """One entry per (stage, name), the parts' squares and sizes added, in stage order.

    Give each parameter's parts from the ranks that hold distinct pieces of it only.
    """
    merged: dict[tuple[int, str], Measured] = {}
    for part in parts:
        key = (part.stage, part.name)
        have = merged.get(key)
        if have is None:
            merged[key] = part
            continue
        grads = [g for g in (have.grad_sq, part.grad_sq) if g is not None]
        merged[key] = Measured(
            stage=part.stage,
            name=part.name,
            numel=have.numel + part.numel,
            grad_sq=sum(grads) if grads else None,
            weight_sq=have.weight_sq + part.weight_sq,
            finite=have.finite and part.finite,
            requires_grad=have.requires_grad or part.requires_grad,
            in_norm=have.in_norm and part.in_norm,
        )
    return sorted(merged.values(), key=lambda m: m.stage)  # stable: each stage's own order


def report_rows(measured: Iterable[Measured], bounds: GradBounds, *, step: int) -> list[GradRow]:
    """Norms, ratio and flags of each merged parameter."""
    rows = []
    for m in measured:
        grad_norm = None if m.grad_sq is None else math.sqrt(m.grad_sq)
        weight_norm = math.sqrt(m.weight_sq)
        ratio = grad_norm / weight_norm if grad_norm is not None and weight_norm > 0 else None
        rows.append(
            GradRow(
                step=step,
                stage=m.stage,
                name=m.name,
                numel=m.numel,
                grad_norm=grad_norm,
                weight_norm=weight_norm,
                ratio=ratio,
                flags=_flags(m, grad_norm, bounds),
                in_norm=m.in_norm,
            )
        )
    return rows


def _flags(m: Measured, grad_norm: float | None, bounds: GradBounds) -> tuple[str, ...]:
    if grad_norm is None:
        return (NO_GRAD,) if m.requires_grad else (NO_GRAD, FROZEN)
    if not m.finite or not math.isfinite(grad_norm):
        return (NON_FINITE,)
    if grad_norm == 0.0:
        return (ZERO,)
    if bounds.vanishing and grad_norm < bounds.vanishing:
        return (VANISHING,)
    if bounds.exploding and grad_norm > bounds.exploding:
        return (EXPLODING,)
    return ()


def stage_norms(rows: Iterable[GradRow]) -> dict[int, float]:
    """Each stage's gradient norm over the parameters that enter the global norm: the
    squares of all stages add up to the global norm's square."""
    squares: dict[int, float] = {}
    for row in rows:
        squares.setdefault(row.stage, 0.0)
        if row.in_norm and row.grad_norm is not None:
            squares[row.stage] += row.grad_norm**2
    return {stage: math.sqrt(s) for stage, s in sorted(squares.items())}


def row_json(row: GradRow) -> dict[str, Any]:
    """A JSONL line's object; a non-finite number is written as null (strict JSON)."""

    def clean(value: float | None) -> float | None:
        return value if value is not None and math.isfinite(value) else None

    return {
        "step": row.step,
        "stage": row.stage,
        "name": row.name,
        "numel": row.numel,
        "grad_norm": clean(row.grad_norm),
        "weight_norm": clean(row.weight_norm),
        "ratio": clean(row.ratio),
        "flags": list(row.flags),
        "in_norm": row.in_norm,
    }


def format_report(rows: Sequence[GradRow], *, where: str = "", max_flagged: int = 10) -> str:
    """A few lines: a line per stage (its norm, parameters, flagged, the largest ratio)
    and the flagged parameters by name, at most ``max_flagged`` of them."""
    if not rows:
        return "gradient report: no parameters"
    step = rows[0].step
    flagged = [r for r in rows if r.flags]
    lines = [
        f"gradient report, step {step}: {len(rows)} parameters, {len(flagged)} flagged"
        + (f" (every parameter: {where})" if where else "")
    ]
    norms = stage_norms(rows)
    for stage, norm in norms.items():
        mine = [r for r in rows if r.stage == stage]
        ratios = [r for r in mine if r.ratio is not None and math.isfinite(r.ratio)]
        top = max(ratios, key=lambda r: r.ratio or 0.0, default=None)
        largest = f", largest grad/weight {top.ratio:.2e} ({top.name})" if top else ""
        n_flagged = sum(1 for r in mine if r.flags)
        lines.append(
            f"  stage {stage}: grad norm {norm:.4g} over {len(mine)} parameters, "
            f"{n_flagged} flagged{largest}"
        )
    for row in flagged[:max_flagged]:
        shown = "-" if row.grad_norm is None else f"{row.grad_norm:.3g}"
        lines.append(
            f"  ! {row.name} (stage {row.stage}): {', '.join(row.flags)}; grad norm {shown}, "
            f"weight norm {row.weight_norm:.3g}"
        )
    if len(flagged) > max_flagged:
        lines.append(
            f"  ... and {len(flagged) - max_flagged} more flagged (see {where or 'the table'})"
        )
    return "\n".join(lines)
