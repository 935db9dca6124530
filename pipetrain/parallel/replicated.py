"""Data-parallel gradients of one pipeline rank's stages (DDP per stage), and their cost.

The mesh, the data split and the loss denominator are in ``pipetrain.parallel.mesh``.

Gradients (DDP per stage): once a stage's last backward piece of the step (its last B or
W) has run, its gradients are copied into flat buckets and summed over the dp group by
asynchronous all-reduces, while the rank goes on with the rest of its schedule (the
cool-down); ``finish`` waits for them before the optimizer and divides by ``dp``.

With ``grad_views`` (``pipeline.grad_as_bucket_view``, DDP's ``gradient_as_bucket_view``)
the flat buckets are allocated once, at the first step, and every ``.grad`` is a view into
its bucket, set at ``begin`` wherever the optimizer left it None: the backward (and a
split backward's W) adds into the bucket in place and the all-reduce sums it where it
lies, with no copy either way. A process then holds one gradient copy for the whole step
instead of the ``.grad`` tensors from the first backward and the buckets from the last
(docs/memory_model.md).

Weights tied across pipeline ranks (and Chimera's replicated stages) are summed by the
pipeline at the end of its step, after these buckets would have been filled: their dp
all-reduce runs after the pipeline step instead (a sum over both is a sum in any order).
Sharded, the tied copies on two pipeline ranks have the same dp layout, so the pipeline
sums their local shards.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.config.schema import ConfigError
from pipetrain.parallel.ep import ExpertGradients, expert_parameters
from pipetrain.parallel.mesh import Mesh
from pipetrain.parallel.stats import DataParallelStats, gather_stats
from pipetrain.runtime import Pipeline, PipelineError
from pipetrain.runtime.waits import finish
from pipetrain.runtime.wire_format import describe_failure
from pipetrain.schedules import Action, Kind
from pipetrain.tensors import local_tensor as _local

__all__ = ["DEFAULT_BUCKET_BYTES", "ReplicaGradients"]

# Like DDP's default bucket: large enough to amortise a collective's latency, small enough
# that the first bucket of a stage starts early.
DEFAULT_BUCKET_BYTES = 25 * 2**20


def _grads_of(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    # A parameter without a gradient this step still takes its place in the bucket, so
    # every replica's buckets line up element for element.
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [_local(p.grad) for p in params if p.grad is not None]


def _nbytes(param: torch.Tensor) -> int:
    local = _local(param)
    return local.numel() * local.element_size()


def _buckets(params: Sequence[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    buckets: list[list[nn.Parameter]] = []
    size = limit
    for p in params:
        nbytes = _nbytes(p)
        if size + nbytes > limit and size > 0:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def _views(params: Sequence[nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """A zeroed flat buffer for ``params``' local gradients and each one's gradient as a
    view into it (a DTensor's with its parameter's layout); None where they cannot share
    one (different dtypes or devices)."""
    shards = [_local(p) for p in params]
    if len({(t.dtype, t.device) for t in shards}) != 1:
        return None
    flat = torch.zeros(
        sum(t.numel() for t in shards), dtype=shards[0].dtype, device=shards[0].device
    )
    views, offset = [], 0
    for p, t in zip(params, shards, strict=True):
        view = flat[offset : offset + t.numel()].view_as(t)
        views.append(view if t is p else _like(p, view))
        offset += t.numel()
    return flat, views


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor laid out as ``param`` (a tensor-parallel weight), sharing its
    storage: the backward then adds its gradient into the bucket in place, and leaves it
    in the parameter's layout (``tp._grad_like_param`` has nothing to move)."""
    from torch.distributed.tensor import DTensor

    assert isinstance(param, DTensor)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )  # fmt: skip


@dataclass(frozen=True)
class _Launched:
    """One bucket in flight: the collective's handle, its flat buffer, its parameters."""

    work: Any
    flat: torch.Tensor
    params: list[nn.Parameter]
    what: str
    viewed: bool = False  # the gradients are views of ``flat``: nothing to copy back


class ReplicaGradients:
    """DDP for the stages of one pipeline rank: bucketed, asynchronous, per stage.

    Build it, pass ``grads_hook`` to ``build_pipeline`` (``PipelineHooks``), then ``attach``
    the pipeline. Per optimizer step: ``begin(sync)`` before each pipeline step (sync only
    on the last of a gradient accumulation), ``finish(step)`` after the last one.
    """

    def __init__(
        self,
        mesh: Mesh,
        *,
        timeout_s: float,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        experts: ExpertGradients | None = None,
        grad_views: bool = False,
    ) -> None:
        """``experts``: expert parallelism; the routed experts' gradients are reduced over
        their own replicas by it, after the dense buckets, instead of over dp.
        ``grad_views``: the ``.grad`` tensors are views into persistent flat buckets."""
        if bucket_bytes < 1:
            raise ConfigError(f"bucket_bytes is {bucket_bytes}: use a positive size")
        self._mesh = mesh
        self._timeout_s = timeout_s
        self._polls = dist.get_backend(mesh.dp_group) == "nccl"  # waits.finish
        self._bucket_bytes = bucket_bytes
        self._stage_buckets: dict[int, list[list[nn.Parameter]]] = {}
        self._late: list[list[nn.Parameter]] = []
        # Stages in the order their last B/W runs: the same on every replica.
        self._order: list[int] = []
        self._launched: set[int] = set()
        # Stages launched by the hook (inside the pipeline step) in the last step.
        self._early: tuple[int, ...] = ()
        self._in_flight: list[_Launched] = []
        self._sync = False
        self._waits: list[float] = []
        self.bytes_per_step = 0
        self._experts = experts
        self._expert_params: list[nn.Parameter] = []
        self._grad_views = grad_views
        # Per bucket (by the id of its parameter list): its flat buffer and the views.
        self._flats: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    # ----------------------------------------------------------------- set-up
    def attach(self, pipeline: Pipeline) -> None:
        """Learn the stages, their parameters and when each stage's gradients are final."""
        placement = pipeline.schedule.placement
        tied = {id(p) for m in pipeline.modules for p in m.tied_parameters().values()}
        if self._experts is not None:
            self._expert_params = expert_parameters(pipeline.modules)
        seen: set[int] = {id(p) for p in self._expert_params}
        late: list[nn.Parameter] = []
        for stage, module in zip(pipeline.stages, pipeline.modules, strict=True):
            mine: list[nn.Parameter] = []
            for p in module.parameters():
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                if id(p) in tied or placement.replicas > 1:
                    late.append(p)
                else:
                    mine.append(p)
            # Reverse order: the last layers' gradients are the first ones ready in a B.
            self._stage_buckets[stage] = _buckets(mine[::-1], self._bucket_bytes) if mine else []
        self._late = _buckets(late, self._bucket_bytes) if late else []
        buckets = self._all_buckets()
        self.bytes_per_step = sum(_nbytes(p) for b in buckets for p in b)
        rank = dist.get_rank(self._mesh.pp_group) if self._mesh.pp_group is not None else 0
        self._plan(pipeline.schedule.actions[rank])

    def _plan(self, actions: Sequence[Action]) -> None:
        last = {a.stage: pos for pos, a in enumerate(actions) if a.kind in (Kind.B, Kind.W)}
        self._order = sorted(last, key=lambda s: last[s])

    # ----------------------------------------------------------------- per step
    def begin(self, sync: bool) -> None:
        """Before a pipeline step: ``sync`` on the last step of a gradient accumulation.
        With views, a gradient the optimizer set to None is its zeroed view again."""
        self._sync = sync
        if not self._grad_views:
            return
        buckets = self._all_buckets()
        if not self._flats:
            # Made at the first step, not at ``attach``: a run's memory baseline, taken
            # before its steps, then leaves them in its measured peak, as the .grad
            # tensors they replace were.
            self._flats = {id(b): v for b in buckets if (v := _views(b)) is not None}
        for bucket in buckets:
            flat_views = self._flats.get(id(bucket))
            if flat_views is None:
                continue
            for p, view in zip(bucket, flat_views[1], strict=True):
                if p.grad is None:
                    _local(view).zero_()
                    p.grad = view

    def _all_buckets(self) -> list[list[nn.Parameter]]:
        return [b for bs in self._stage_buckets.values() for b in bs] + self._late

    def _viewed(self, params: list[nn.Parameter]) -> torch.Tensor | None:
        """The flat buffer that every gradient of ``params`` lies in, or None (no views, or
        one was replaced since ``begin``)."""
        flat_views = self._flats.get(id(params))
        if flat_views is None:
            return None
        flat, views = flat_views
        for p, view in zip(params, views, strict=True):
            if p.grad is None or _local(p.grad).data_ptr() != _local(view).data_ptr():
                return None
        return flat

    def grads_hook(self, stage: int) -> None:
        """The pipeline's hook: ``stage`` has run its last B or W of the step."""
        if self._sync:
            self._launch_through(stage)

    def _launch_through(self, stage: int) -> None:
        # Launch in the canonical order, so that every replica issues the same collectives
        # on the dp group in the same order.
        for s in self._order:
            if s not in self._launched:
                self._launch(s)
            if s == stage:
                return

    def _launch(self, stage: int) -> None:
        self._launched.add(stage)
        for bucket in self._stage_buckets.get(stage, []):
            self._start(bucket, f"stage {stage}")

    def _start(self, params: list[nn.Parameter], what: str) -> None:
        viewed = self._viewed(params)
        flat = (
            viewed if viewed is not None else torch.cat([g.reshape(-1) for g in _grads_of(params)])
        )
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._mesh.dp_group, async_op=True)
        self._in_flight.append(_Launched(work, flat, params, what, viewed is not None))

    def finish(self, step: int) -> None:
        """Wait for every bucket (launching what is left), then average over the replicas."""
        t0 = time.perf_counter()
        self._early = tuple(s for s in self._order if s in self._launched)
        for stage in self._order:
            if stage not in self._launched:
                self._launch(stage)
        for stage in self._stage_buckets:
            if stage not in self._launched:  # a stage without any backward: nothing ran
                self._launch(stage)
        for bucket in self._late:
            self._start(bucket, "weights tied or replicated across pipeline ranks")
        scale = 1.0 / self._mesh.dp
        for launched in self._in_flight:
            try:
                finish(launched.work, self._timeout_s, self._polls)
            except RuntimeError as exc:
                # ``step`` counts from 0, the progress and the pipeline's errors from 1.
                raise PipelineError(
                    f"rank {self._mesh.rank}: training step {step + 1}, data-parallel all-reduce "
                    f"of {launched.what} with the other replicas (dp group of pp rank "
                    f"{self._mesh.pp_rank}): a peer {describe_failure(exc, self._timeout_s)}"
                ) from exc
            launched.flat.mul_(scale)
            if launched.viewed:
                continue  # averaged in place
            offset = 0
            for grad in _grads_of(launched.params):
                n = grad.numel()
                grad.copy_(launched.flat[offset : offset + n].view_as(grad))
                offset += n
        if self._experts is not None:
            self._experts.reduce(self._expert_params)
        self._waits.append(time.perf_counter() - t0)
        self._in_flight.clear()
        self._launched.clear()

    @property
    def sharded(self) -> bool:
        return False

    def after_eval(self) -> None:
        """Nothing to free: replicas keep their whole parameters."""

    @property
    def launched_in_step(self) -> tuple[int, ...]:
        """Stages whose all-reduce started inside the last pipeline step (overlapped)."""
        return self._early

    def stats(self, skip_first: int = 1, *, state_bytes: int = 0) -> DataParallelStats:
        """The run's cost so far, every rank's (collective: call it on every rank).

        The first ``skip_first`` steps (warm-up) are left out of the waits.
        """
        return gather_stats(
            self._mesh, self.bytes_per_step, self._waits[skip_first:] or self._waits,
            state_bytes=state_bytes, sharded=False,
        )  # fmt: skip
