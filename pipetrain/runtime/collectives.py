"""Gradient sums between ranks (Chimera's replicas, tied weights) and the step's summary.

Two implementations with one interface: over torch.distributed (small subgroups created
once, over the pipeline group's ranks) and in memory (the debug mode). They add in the
same order, so the two modes give the same bits: replicas are summed by a two-member
all-reduce (a + b is exact in either order), tied copies first on each rank in stage order,
then across ranks.

Subgroups are keyed by their rank set: torch names a locally synchronised group after its
ranks, so two groups on the same ranks would collide. Collectives on one group must be
issued in the same order on every member, so ALLREDUCE actions do not launch in schedule
order but in a canonical one (model-stage order), each as soon as it and all before it
are ready; the rest launch at the end of the step.
"""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.runtime.errors import PipelineError
from pipetrain.runtime.transport import describe_failure
from pipetrain.runtime.waits import finish
from pipetrain.tensors import local_tensor as _local

__all__ = [
    "DistReducer",
    "LocalReducer",
    "ReplicaGroup",
    "TiedGroup",
    "dist_barrier",
    "dist_step_summary",
]


@dataclass(frozen=True)
class ReplicaGroup:
    """The virtual stages (and their ranks) that hold one model stage (Chimera)."""

    model_stage: int
    stages: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class TiedGroup:
    """The stages (and their ranks) that hold a copy of one tied weight."""

    key: str
    stages: tuple[int, ...]
    ranks: tuple[int, ...]


def _grads(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [_local(p.grad) for p in params if p.grad is not None]


def _flat(params: Sequence[nn.Parameter]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in _grads(params)])


def _keep_one_total(params: Sequence[nn.Parameter]) -> None:
    """Zero the gradients of copies that are not their group's first.

    The sums at the end of a step add whole ``.grad`` tensors, and leave the total in every
    copy. A step that accumulates onto an earlier one (``step`` called again before
    ``zero_grad``) would then add that earlier total once per copy; with only the first
    copy keeping it, the next sum is the earlier total plus each copy's new gradient.
    """
    for param in params:
        if param.grad is not None:
            _local(param.grad).zero_()


def _unflatten_into(flat: torch.Tensor, params: Sequence[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        assert p.grad is not None
        grad = _local(p.grad)
        n = grad.numel()
        grad.copy_(flat[offset : offset + n].view_as(grad))
        offset += n


class LocalReducer:
    """In-memory sums for the debug mode, where one process holds every rank's stages.

    ``replica_params[stage]`` are the parameters of a virtual stage that its replicas sum
    (tied weights excluded: they are summed over all copies at the end of the step).
    """

    def __init__(
        self,
        replica_groups: Sequence[ReplicaGroup],
        replica_params: dict[int, list[nn.Parameter]],
        tied_groups: Sequence[TiedGroup],
        tied_params: dict[tuple[str, int], nn.Parameter],
    ) -> None:
        self._replica_groups = tuple(g for g in replica_groups if len(g.stages) > 1)
        self._replica_params = replica_params
        self._tied_groups = tied_groups
        self._tied_params = tied_params
        self._ready: set[int] = set()

    def begin(self) -> None:
        """Before a training step: only the first copy of each sum keeps earlier gradients."""
        for group in self._replica_groups:
            for stage in group.stages[1:]:
                _keep_one_total(self._replica_params[stage])
        for tied in self._tied_groups:
            _keep_one_total([self._tied_params[(tied.key, s)] for s in tied.stages[1:]])

    def start(self, stage: int) -> None:
        self._ready.add(stage)

    def finish(self, where: str) -> None:
        """Sum the replicas' and tied copies' gradients; ``where`` names the step in errors."""
        for group in self._replica_groups:
            missing = [s for s in group.stages if s not in self._ready]
            if missing and len(missing) < len(group.stages):
                raise PipelineError(
                    f"{where}: stages {missing} never ran ALLREDUCE while their replicas did: "
                    f"every replica of model stage {group.model_stage} needs one"
                )
            if missing:
                continue
            flats = [_flat(self._replica_params[s]) for s in group.stages]
            total = flats[0]
            for flat in flats[1:]:
                total = total + flat
            for s in group.stages:
                _unflatten_into(total, self._replica_params[s])
        self._ready.clear()
        for tied in self._tied_groups:
            per_rank: dict[int, torch.Tensor] = {}
            for stage, rank in zip(tied.stages, tied.ranks, strict=True):
                grad = _grads([self._tied_params[(tied.key, stage)]])[0]
                per_rank[rank] = grad if rank not in per_rank else per_rank[rank] + grad
            ranks = sorted(per_rank)
            total = per_rank[ranks[0]]
            for rank in ranks[1:]:
                total = total + per_rank[rank]
            for stage in tied.stages:
                param = self._tied_params[(tied.key, stage)]
                assert param.grad is not None
                param.grad.copy_(total)


class DistReducer:
    """The same sums over torch.distributed, on subgroups of the pipeline group.

    Built on every rank of the pipeline group; creates only the subgroups this rank is in.
    """

    def __init__(
        self,
        group: Any,
        rank: int,
        replica_groups: Sequence[ReplicaGroup],
        replica_params: dict[int, list[nn.Parameter]],
        tied_groups: Sequence[TiedGroup],
        tied_params: dict[tuple[str, int], nn.Parameter],
        timeout_s: float,
    ) -> None:
        self._rank = rank
        self._timeout_s = timeout_s
        self._polls = dist.get_backend(group) == "nccl"  # waits.finish
        self._replica_params = replica_params
        self._tied_params = tied_params
        self._subgroups: dict[tuple[int, ...], Any] = {}
        group_ranks = tuple(range(dist.get_world_size(group)))
        pipeline_key = group_ranks
        self._subgroups[pipeline_key] = group

        def subgroup(ranks: tuple[int, ...]) -> Any:
            key = tuple(sorted(set(ranks)))
            if key not in self._subgroups:
                global_ranks = [dist.get_global_rank(group, r) for r in key]
                self._subgroups[key] = dist.new_group(global_ranks, use_local_synchronization=True)
            return self._subgroups[key]

        # Canonical order: model stage, then tied key. Only groups with this rank in them.
        self._replicas: list[tuple[ReplicaGroup, Any, list[int]]] = []
        for g in replica_groups:
            if rank in g.ranks and len(set(g.ranks)) > 1:
                local = [s for s, r in zip(g.stages, g.ranks, strict=True) if r == rank]
                self._replicas.append((g, subgroup(g.ranks), local))
        self._tied: list[tuple[TiedGroup, Any | None, list[int]]] = []
        for t in tied_groups:
            if rank in t.ranks:
                local = [s for s, r in zip(t.stages, t.ranks, strict=True) if r == rank]
                self._tied.append((t, subgroup(t.ranks) if len(set(t.ranks)) > 1 else None, local))
        self._ready: set[int] = set()
        self._launched = 0
        self._works: list[tuple[Any, torch.Tensor, list[nn.Parameter], str]] = []

    def begin(self) -> None:
        """Before a training step: only the first copy of each sum keeps earlier gradients
        (``_keep_one_total``; the first is the group's first stage, on whichever rank)."""
        for group, _, local in self._replicas:
            for stage in local:
                if stage != group.stages[0]:
                    _keep_one_total(self._replica_params[stage])
        for tied, _, local in self._tied:
            _keep_one_total(
                [self._tied_params[(tied.key, s)] for s in local if s != tied.stages[0]]
            )

    def start(self, stage: int) -> None:
        self._ready.add(stage)
        self._launch(final=False)

    def _launch(self, final: bool, where: str = "the step") -> None:
        while self._launched < len(self._replicas):
            group, pg, local = self._replicas[self._launched]
            if not all(s in self._ready for s in local):
                if not final:
                    return
                if not any(s in self._ready for s in local):
                    raise PipelineError(
                        f"rank {self._rank}: {where} ended before ALLREDUCE of model stage {group.model_stage} "
                        f"(stages {local}): its replicas on ranks {group.ranks} would wait forever"
                    )
            params = [p for s in local for p in self._replica_params[s]]
            if len(local) > 1:
                raise PipelineError(
                    f"rank {self._rank} holds two replicas {local} of model stage {group.model_stage}: "
                    f"the placement must put replicas on different ranks"
                )
            flat = _flat(params)
            work = dist.all_reduce(flat, group=pg, async_op=True)
            self._works.append(
                (
                    work,
                    flat,
                    params,
                    f"ALLREDUCE of model stage {group.model_stage} with ranks {group.ranks}",
                )
            )
            self._launched += 1

    def _wait(self, work: Any, what: str, where: str) -> None:
        try:
            finish(work, self._timeout_s, self._polls)
        except RuntimeError as exc:
            raise PipelineError(
                f"rank {self._rank}: {where}, {what}: a peer {describe_failure(exc, self._timeout_s)}"
            ) from exc

    def finish(self, where: str) -> None:
        """Wait for the all-reduces and sum the tied weights; ``where`` names the step in errors."""
        self._launch(final=True, where=where)
        for work, flat, params, what in self._works:
            self._wait(work, what, where)
            _unflatten_into(flat, params)
        self._works.clear()
        self._ready.clear()
        self._launched = 0
        for tied, pg, local in self._tied:
            grads = [_grads([self._tied_params[(tied.key, s)]])[0] for s in local]
            total = grads[0]
            for grad in grads[1:]:
                total = total + grad
            if pg is not None:
                total = total.clone()
                work = dist.all_reduce(total, group=pg, async_op=True)
                self._wait(work, f"sum of tied weight {tied.key} with ranks {tied.ranks}", where)
            for s in local:
                param = self._tied_params[(tied.key, s)]
                assert param.grad is not None
                _local(param.grad).copy_(total)


# A failed barrier that waited at least this share of its timeout timed out; one that
# failed sooner lost its peer (the clocks of a loaded machine are not exact).
_SILENT_SHARE = 0.9


def dist_barrier(group: Any, rank: int, where: str, timeout_s: float, device: torch.device) -> None:
    """All ranks of the pipeline reach the start of the step ``where`` names (with a timeout).

    On gloo, torch's monitored barrier: when a rank does not arrive, rank 0 learns which.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    context = f"rank {rank}: {where}, barrier at the start of the step"
    started = time.monotonic()
    try:
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
            return
        work = dist.all_reduce(torch.zeros(1, device=device), group=group, async_op=True)
        finish(work, timeout_s, polls=True)
    except RuntimeError as exc:
        absent = re.search(r"Ranks? ([\d, ]+) failed to pass", str(exc))
        if absent:
            # gloo says "failed to pass in <timeout> ms" also for a peer whose connection
            # closed at once (its process died): only a wait that lasted the timeout
            # means the peer is silent.
            waited = time.monotonic() - started
            fate = (
                f"did not arrive within {timeout_s:g} s"
                if waited >= _SILENT_SHARE * timeout_s
                else f"were lost after {waited:.1f} s (the process died or closed the "
                f"connection; the first rank to fail names the cause in its log)"
            )
            raise PipelineError(f"{context}: peer rank(s) {absent.group(1)} {fate}") from exc
        raise PipelineError(f"{context}: a peer {describe_failure(exc, timeout_s)}") from exc


def dist_step_summary(
    group: Any,
    rank: int,
    where: str,
    row: list[float],
    width: int,
    timeout_s: float,
    device: torch.device,
) -> list[list[float]]:
    """Gather every rank's summary row (loss share, tokens, action times) to every rank."""
    mine = torch.zeros(width, dtype=torch.float64)
    mine[: len(row)] = torch.tensor(row, dtype=torch.float64)
    mine = mine.to(device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    try:
        finish(work, timeout_s, polls=dist.get_backend(group) == "nccl")
    except RuntimeError as exc:
        raise PipelineError(
            f"rank {rank}: {where}, gathering the loss at the end of the step: a peer "
            f"{describe_failure(exc, timeout_s)}"
        ) from exc
    return [r.tolist() for r in rows]
