"""The trainer's side of the gradient report (``pipetrain.diagnose.grads``).

Called once per optimizer step, after the gradients are final (the replicas reduced) and
before the update scales, clips and applies them: what the optimizer sees.

- Every step: each stage's gradient norm for the metrics record, from the gradients that
  enter the global norm (``Session.grads``: tied copies and replicas counted once, tensor-
  parallel and FSDP2 shards each counted by the rank holding them), summed by one small
  all-reduce over the world group. Their squares add up to the global norm's square.
- At step 1 and every ``run.grad_report`` steps: every parameter's row; each rank sends the
  parameters that it holds distinct parts of (``norm_share`` over all its parameters), one
  all_gather_object over the world group, and rank 0 adds the shards up, prints the short
  report and appends the rows to ``<run dir>/grad_report.jsonl``.

Nothing here changes a gradient.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.diagnose.grads import (
    GradBounds,
    Measured,
    format_report,
    measure,
    merge,
    report_rows,
    row_json,
)
from pipetrain.parallel import Gradients, norm_share
from pipetrain.tensors import local_tensor
from pipetrain.train.session import Session

__all__ = ["REPORT_FILE", "gradient_report", "is_report_step"]

REPORT_FILE = "grad_report.jsonl"


def is_report_step(step: int, every: int) -> bool:
    """Whether optimizer step ``step`` (from 0) is reported: the first, and every ``every``."""
    return every > 0 and (step == 0 or (step + 1) % every == 0)


def gradient_report(session: Session, step: int) -> dict[str, float | None]:
    """Each stage's gradient norm (by stage, as text keys for JSON; None where not finite),
    and the full report at a report step. Every rank of the run must call it."""
    everyone = _everyone(session)
    scale = 1.0 / session.config.optim.grad_accum  # the update divides the summed gradients
    norms = _stage_norms(session, everyone, scale)
    if is_report_step(step, session.config.run.grad_report):
        _full_report(session, step, everyone, scale)
    return norms


def _everyone(session: Session) -> Any:
    return session.mesh.world_group if session.mesh is not None else session.group


def _stage_params(session: Session) -> Iterator[tuple[int, str, torch.nn.Parameter]]:
    """(stage, global name, parameter) of each distinct parameter of this process."""
    seen: set[int] = set()
    pipeline = session.pipeline
    for stage, module in zip(pipeline.stages, pipeline.modules, strict=True):
        for name, param in module.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield stage, name, param


def _stage_norms(session: Session, everyone: Any, scale: float) -> dict[str, float | None]:
    counted = {id(p) for p in session.grads.counted}
    stages = len(session.plan.split)
    index: list[int] = []
    squares: list[torch.Tensor] = []
    for stage, _, param in _stage_params(session):
        if id(param) in counted and param.grad is not None:
            index.append(stage)
            grad = local_tensor(param.grad)
            squares.append(torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2)
    total = torch.zeros(stages, dtype=torch.float64, device=session.device)
    if squares:
        where = torch.tensor(index, device=session.device)
        total.index_add_(0, where, torch.stack(squares).to(session.device))
    if everyone is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=everyone)
    return {
        str(stage): math.sqrt(value) * scale if math.isfinite(value) else None
        for stage, value in enumerate(total.tolist())
    }


def _full_report(session: Session, step: int, everyone: Any, scale: float) -> None:
    pipeline, config = session.pipeline, session.config
    params = list(_stage_params(session))
    placement = pipeline.schedule.placement
    # As the global norm counts them: a tied weight's second copy and a replica do not.
    in_norm = {
        id(p)
        for stage, name, p in params
        if name not in pipeline.tied_names and placement.replica(stage) == 0
    }
    mine: tuple[torch.Tensor, ...] = tuple(p for _, _, p in params)
    sends = mine
    if session.mesh is not None:
        sends = norm_share(Gradients.of(mine), session.mesh, sharded=session.sharded).counted
    sending = {id(p) for p in sends}
    measured = measure(
        ((s, n, p) for s, n, p in params if id(p) in sending),
        scale=scale,
        in_norm=lambda _, p: id(p) in in_norm,
    )
    parts: list[Measured] = measured
    if everyone is not None:
        gathered: list[Any] = [None] * dist.get_world_size(everyone)
        dist.all_gather_object(gathered, measured, group=everyone)
        parts = [m for rank in gathered for m in rank]
    if not session.role.reporter:
        return
    bounds = GradBounds(config.run.grad_vanishing, config.run.grad_exploding)
    rows = report_rows(merge(parts), bounds, step=step + 1)
    path = config.run_dir / REPORT_FILE
    session.output.say(format_report(rows, where=str(path)))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as file:
        file.writelines(json.dumps(row_json(row)) + "\n" for row in rows)
