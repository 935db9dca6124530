"""Sharded data parallelism (``--shard``): FSDP2's ``fully_shard`` on each stage of a rank.

Each stage module is sharded over the "dp" dimension of the (pp, dp) mesh: between steps
a replica holds 1/dp of the stage's parameters, gradients and AdamW state. A step runs:

    start of the step         all-gather the parameters of every stage of the rank,
                              asynchronously, in the order of the stages' first F
    first F of the stage      wait for that gather (FSDP2's pre-forward); it stays
                              gathered (reshard_after_forward=False)
    every F, B, I and W       on the unsharded parameters; gradients add up unsharded
    after the last B or W     reduce-scatter the gradients into the shards, then reshard
                              (the pipeline's grads_hook; the rest of the schedule goes on)

FSDP2 would reduce-scatter in its post-backward hook, at the end of each autograd
backward. With the split backward of the zero-bubble schedules that is the end of I,
before W has added the weight gradients (runtime/stage.py runs W outside autograd), so
the hook is held off for the whole step (gradient sync off, no reshard after backward)
and ``_reduce_scatter_now`` runs FSDP2's post-backward itself once the stage's last W is
done. FSDP2 has no public entry for that; torch.distributed.pipelining calls the same
internal methods (``_PipelineStageBase.perform_reduce_grad``), and ``fsdp_internals``
lists what is used so that a torch that changes them fails at start-up, not silently.

Issued at the start of the step, a gather overlaps what the rank does before the stage's
first F: on ranks after the first, the wait for the first activation (the warm-up), and
for a rank's later stages, the forwards of its earlier ones. FSDP2 gathered in the
pre-forward hook before, which blocked that F for the whole gather. ``unshard`` is a no-op
on parameters still gathered (the later micro-steps of a gradient accumulation), so there
is still one all-gather per stage per optimizer step.

The reduce-scatter sums and divides by dp (forced sum: gloo has no AVG), the mean of the
replicas' gradients; the loop weights each replica's loss by its share of the batch's
target tokens (``replica_denominator``) so that the mean is the full batch's gradient.

Not supported, refused with a one-line error: asynchronous schedules (weight versions
change inside a step), Chimera's replicated stages (their ALLREDUCE would sum sharded
and unsharded gradients mid-step), both in the preflight plan, and torch.compile
(untested with FSDP2 here) in the config.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle, fully_shard

from pipetrain.config.schema import ConfigError
from pipetrain.parallel.mesh import Mesh
from pipetrain.parallel.stats import DataParallelStats, gather_stats
from pipetrain.runtime import Pipeline, PipelineError
from pipetrain.schedules import Action, Kind, Schedule

__all__ = [
    "ShardedGradients",
    "check_shardable",
    "fsdp_internals",
    "missing_fsdp_internals",
]

# The torch version the private entry points below were read in and tested against.
CHECKED_TORCH = "2.13.0"


def fsdp_internals() -> dict[str, Any]:
    """Name -> the private FSDP2 attribute ``_reduce_scatter_now`` relies on (None: gone)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state

    group_cls = getattr(_fsdp_param_group, "FSDPParamGroup", None)
    state_cls = getattr(_fsdp_state, "FSDPState", None)
    return {
        "fully_shard.state": getattr(fully_shard, "state", None),
        "FSDPParamGroup.post_backward": getattr(group_cls, "post_backward", None),
        "FSDPState._root_post_backward_final_callback": getattr(
            state_cls, "_root_post_backward_final_callback", None
        ),
    }


def missing_fsdp_internals(module: nn.Module | None = None) -> list[str]:
    """The entry points of ``fsdp_internals`` this torch lacks (empty when all are there);
    given a ``fully_shard``-ed module, also the state attributes they are reached through."""
    missing = [name for name, found in fsdp_internals().items() if found is None]
    if module is not None and not missing:
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        context = getattr(state, "_state_ctx", None)
        if not isinstance(getattr(context, "all_states", None), list):
            missing.append("FSDPState._state_ctx.all_states")
        if _param_groups(state) is None:
            missing.append("FSDPState._fsdp_param_groups")
    return missing


def _param_groups(state: Any) -> list[Any] | None:
    """An FSDP state's parameter groups: a list in torch 2.13 (``_fsdp_param_groups``), one
    group or None in earlier releases (``_fsdp_param_group``, seen in 2.11); None when
    neither layout is there."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if isinstance(groups, list):
        return groups
    if hasattr(state, "_fsdp_param_group"):
        single = state._fsdp_param_group
        return [] if single is None else [single]
    return None


def _check_internals(module: nn.Module | None) -> None:
    missing = missing_fsdp_internals(module)
    if missing:
        raise ConfigError(
            f"pipeline.shard relies on FSDP2 internals checked in torch {CHECKED_TORCH}, and "
            f"torch {torch.__version__} lacks {', '.join(missing)}: use torch {CHECKED_TORCH} "
            f"or drop --shard"
        )


def _reduce_scatter_now(module: FSDPModule) -> None:
    """FSDP2's post-backward of ``module``, now: reduce-scatter the unsharded gradients
    accumulated over the step into the sharded ``.grad`` and reshard the parameters.

    Private FSDP2 API, as torch.distributed.pipelining uses it, checked against torch
    2.13.0 (``CHECKED_TORCH``): the state's context lists every FSDP state under this root
    (``_state_ctx.all_states``), each holds parameter groups (``_param_groups``)
    whose ``post_backward`` reduce-scatters when gradient sync is on and reshards when
    reshard-after-backward is on; ``_root_post_backward_final_callback`` then waits for the
    reductions and resets the per-step state, as at the end of a last backward.
    """
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)  # type: ignore[attr-defined]
    for each in state._state_ctx.all_states:
        for param_group in _param_groups(each) or ():
            param_group.post_backward()
    state._root_post_backward_final_callback()


def _unsharded_bytes(module: nn.Module) -> int:
    # DTensor parameters report their global shape: the bytes a reduce-scatter takes in.
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def check_shardable(schedule: Schedule) -> None:
    """Refuse, in one line, a schedule that sharded stages (``--shard``) do not support."""
    if schedule.asynchronous:
        raise ConfigError(
            f"pipeline.shard does not support the asynchronous schedule {schedule.name!r} (weights "
            f"change inside a step): use a synchronous schedule such as 1f1b or drop --shard"
        )
    if schedule.placement.replicas > 1:
        # Their ALLREDUCE would sum mid-step gradients that FSDP2 has not reduced yet.
        raise ConfigError(
            f"pipeline.shard does not support {schedule.name!r}, whose stages are replicated "
            f"inside the pipeline: use another schedule (1f1b, zb-h1, ...) or drop --shard"
        )


class ShardedGradients:
    """FSDP2 per stage: the counterpart of ``parallel.ReplicaGradients`` for ``--shard``.

    Build it, pass ``grads_hook`` to ``build_pipeline`` (``PipelineHooks``), apply the stage
    options, then ``attach`` the pipeline (this shards it: build the optimizer after).
    Per optimizer step: ``begin(sync)`` before each pipeline step (sync only on the last
    of a gradient accumulation), ``finish(step)`` after the last one; ``reshard()`` after
    a forward outside training (evaluation).
    """

    def __init__(self, mesh: Mesh, *, timeout_s: float) -> None:
        if mesh.dp_mesh is None:
            raise ConfigError("pipeline.shard needs pipeline.dp > 1: add --dp 2 or drop --shard")
        self._mesh = mesh
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._modules: dict[int, FSDPModule] = {}
        # Stages in the order their last B/W runs, and in the order of their first F: the
        # same on every replica, so the dp group sees the same collectives in one order.
        self._order: list[int] = []
        self._gather_order: list[int] = []
        # Gathers issued by ``begin`` that no forward has waited for yet.
        self._gathering: dict[int, UnshardHandle] = {}
        self._reduced: list[int] = []
        self._early: tuple[int, ...] = ()
        self._sync = False
        # The loop's step (from 0) of the pipeline step now running, known once ``finish``
        # has seen one: a resumed run does not start at 0. None before that.
        self._step: int | None = None
        self._in_step_s = 0.0
        self._waits: list[float] = []
        self.bytes_per_step = 0

    # ----------------------------------------------------------------- set-up
    def attach(self, pipeline: Pipeline) -> None:
        """Shard every stage module of this rank over the dp group."""
        check_shardable(pipeline.schedule)
        _check_internals(None)
        backend = dist.get_backend(self._mesh.dp_group)
        for stage, module in zip(pipeline.stages, pipeline.modules, strict=True):
            # Gathered at the stage's first forward of a step and kept to its last W.
            fully_shard(module, mesh=self._mesh.dp_mesh, reshard_after_forward=False)
            assert isinstance(module, FSDPModule)
            _check_internals(module)
            if backend == "gloo":
                # gloo has no AVG reduction: sum, then FSDP2 divides by dp.
                module.set_force_sum_reduction_for_comms(True)
            self._modules[stage] = module
        pipeline.rebind_parameters()
        self.bytes_per_step = sum(_unsharded_bytes(m) for m in pipeline.modules)
        rank = dist.get_rank(self._mesh.pp_group) if self._mesh.pp > 1 else 0
        self._plan(pipeline.schedule.actions[rank])

    def _plan(self, actions: Sequence[Action]) -> None:
        last = {a.stage: pos for pos, a in enumerate(actions) if a.kind in (Kind.B, Kind.W)}
        self._order = sorted(last, key=lambda s: last[s])
        first: dict[int, int] = {}
        for pos, action in enumerate(actions):
            if action.kind is Kind.F:
                first.setdefault(action.stage, pos)
        # A stage without a forward (none in a training schedule) is gathered last.
        self._gather_order = sorted(
            self._modules, key=lambda s: (s not in first, first.get(s, 0), s)
        )

    # ----------------------------------------------------------------- per step
    def begin(self, sync: bool) -> None:
        """Before a pipeline step: ``sync`` on the last step of a gradient accumulation."""
        self._sync = sync
        for module in self._modules.values():
            # Every backward of the step only accumulates; _reduce_scatter_now reduces.
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
        for stage in self._gather_order:
            # FSDP2's pre-forward waits for a pending unshard; the handle is kept for
            # ``finish``, in case no forward did.
            handle = self._modules[stage].unshard(async_op=True)
            if handle is not None:
                self._gathering[stage] = handle

    def grads_hook(self, stage: int) -> None:
        """The pipeline's hook: ``stage`` has run its last B or W of the step."""
        if self._sync:
            self._reduce(stage)

    def _reduce(self, stage: int) -> None:
        if stage in self._reduced:
            return
        t0 = time.perf_counter()
        try:
            _reduce_scatter_now(self._modules[stage])
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            # Steps are named from 1, as the progress and ReplicaGradients name them.
            when = (
                f"training step {self._step + 1}"
                if self._step is not None
                else "its first training step"
            )
            raise PipelineError(
                f"rank {self._mesh.rank}: {when}, reduce-scatter of stage {stage}'s "
                f"gradients with the other replicas (dp group of pp rank {self._mesh.pp_rank}) "
                f"failed or timed out: {first}"
            ) from exc
        self._in_step_s += time.perf_counter() - t0
        self._reduced.append(stage)

    def finish(self, step: int) -> None:
        """Reduce what the hook did not (a stage without backward), in the canonical order,
        after any gather that no forward waited for."""
        self._step = step
        self._early = tuple(self._reduced)
        for handle in self._gathering.values():
            handle.wait()  # a no-op once the stage's first forward has waited
        self._gathering.clear()
        for stage in [*self._order, *sorted(self._modules)]:
            self._reduce(stage)
        self._waits.append(self._in_step_s)
        self._in_step_s = 0.0
        self._reduced.clear()
        self._step = step + 1

    @property
    def sharded(self) -> bool:
        return True

    def after_eval(self) -> None:
        """Evaluation's forwards gathered the parameters: free them."""
        self.reshard()

    def reshard(self) -> None:
        """Free the gathered parameters (after evaluation, whose forwards gathered them)."""
        for module in self._modules.values():
            module.reshard()

    @property
    def launched_in_step(self) -> tuple[int, ...]:
        """Stages whose reduce-scatter ran inside the last pipeline step (overlapped)."""
        return self._early

    def stats(self, skip_first: int = 1, *, state_bytes: int = 0) -> DataParallelStats:
        """The run's cost so far, every rank's (collective: call it on every rank)."""
        return gather_stats(
            self._mesh, self.bytes_per_step, self._waits[skip_first:] or self._waits,
            state_bytes=state_bytes, sharded=True,
        )  # fmt: skip
