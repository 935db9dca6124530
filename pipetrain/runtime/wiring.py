"""The wiring of a pipeline: what connects this process's stages to each other and to the
other ranks of its group.

``wire`` builds it once, when the pipeline is built: a runner per stage, the transport
(in memory for the debug mode, ``DistTransport`` over the process group), the reducer of
the gradients that several stages share (Chimera's replicas, tied embeddings), the
executor of each local rank's training program and of its forward-only evaluation
program, and the note that maps the group's ranks to global ranks in errors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.models import PipelineSpec, StageModule
from pipetrain.runtime.collectives import DistReducer, LocalReducer, ReplicaGroup, TiedGroup
from pipetrain.runtime.executor import PipelineHooks, RankExecutor
from pipetrain.runtime.local_transport import InMemoryTransport
from pipetrain.runtime.stage import LossFn, StageRunner
from pipetrain.runtime.transport import DistTransport
from pipetrain.schedules import Kind, Placement, Schedule

__all__ = ["Wiring", "forward_only", "retrain", "wire"]

# (tied key, stage) -> that stage's copy of the tied weight.
TiedParams = dict[tuple[str, int], nn.Parameter]
# stage -> the parameters its replicas (Chimera) sum, tied weights left out.
ReplicaParams = dict[int, list[nn.Parameter]]


@dataclass(frozen=True)
class Wiring:
    """This process's stages connected: one field per part that a step uses."""

    group: Any  # the pipeline's process group; None in the debug mode
    # InMemoryTransport in the debug mode, else DistTransport (which also commits a step's
    # shapes as the next step's guess).
    transport: Any
    reducer: LocalReducer | DistReducer
    train: list[RankExecutor]  # one per local rank: the training program
    eval: list[RankExecutor]  # one per local rank: the forward-only program
    # What the reducer sums, kept so that ``Pipeline.rebind_parameters`` can update it in
    # place when a wrapper (FSDP2) replaces a stage's parameters.
    tied_params: TiedParams
    replica_params: ReplicaParams
    # A tied copy's own name -> the canonical key of the weight it shares.
    tied_names: dict[str, str]
    # Appended to errors where the group's ranks are not the global ranks.
    rank_map: str
    # What ``retrain`` builds another training program from: each stage's runner, the
    # ranks whose programs run here, and the caller's hooks.
    runners: dict[int, StageRunner]
    ranks: tuple[int, ...]
    hooks: PipelineHooks


def wire(
    schedule: Schedule,
    spec: PipelineSpec,
    split: tuple[tuple[int, ...], ...],
    stage_modules: dict[int, StageModule],
    *,
    ranks: tuple[int, ...],
    group: Any,
    device: torch.device,
    loss_fn: LossFn,
    timeout_s: float,
    hooks: PipelineHooks,
) -> Wiring:
    """Connect ``stage_modules`` (this process's stages) for ``schedule`` on ``ranks``
    (the ranks whose programs run here: all of them in the debug mode, ``group=None``)."""
    placement = schedule.placement
    runners = _runners(schedule, stage_modules, loss_fn)
    tied_params = {
        (key, s): module.tied_parameters()[key]
        for s, module in stage_modules.items()
        for key in module.tied_parameters()
    }
    tied_ids = {id(p) for p in tied_params.values()}
    replica_params = {
        s: [p for p in module.parameters() if p.requires_grad and id(p) not in tied_ids]
        for s, module in stage_modules.items()
    }
    replica_groups = _replica_groups(placement)
    tied_groups = _tied_groups(placement, spec.tied_holders(split))
    transport: Any
    reducer: LocalReducer | DistReducer
    if group is None:
        transport = InMemoryTransport()
        reducer = LocalReducer(replica_groups, replica_params, tied_groups, tied_params)
    else:
        transport = DistTransport(group, placement.stage_to_rank, device, timeout_s)
        reducer = DistReducer(
            group, ranks[0], replica_groups, replica_params, tied_groups, tied_params, timeout_s
        )

    wiring = Wiring(
        group=group,
        transport=transport,
        reducer=reducer,
        train=[],
        eval=[],
        tied_params=tied_params,
        replica_params=replica_params,
        tied_names=_tied_names(stage_modules),
        rank_map=_rank_map(group),
        runners=runners,
        ranks=ranks,
        hooks=hooks,
    )
    return dataclasses.replace(
        wiring,
        train=_executors(wiring, schedule, grads=True),
        eval=_executors(wiring, forward_only(schedule), grads=False),
    )


def retrain(wiring: Wiring, schedule: Schedule) -> Wiring:
    """``wiring`` with the training program of ``schedule``: the same placement on the
    same stages, transport and reducer, another micro-batch count (``pipetrain train
    --microbatches auto``). The stages split the backwards the new program splits; the
    evaluation program stays. The transport keeps each program's wire orders, and with
    them the shapes it guessed for that program's messages."""
    split = _split_microbatches(schedule)
    for stage, runner in wiring.runners.items():
        runner.split_as(stage in split, split.get(stage))
    return dataclasses.replace(wiring, train=_executors(wiring, schedule, grads=True))


def _executors(wiring: Wiring, program: Schedule, *, grads: bool) -> list[RankExecutor]:
    """An executor of ``program`` per local rank; ``grads``: with the caller's hook that
    runs once a stage's gradients are final (training)."""
    hooks, placement = wiring.hooks, program.placement
    return [
        RankExecutor(
            program,
            r,
            {s: wiring.runners[s] for s in placement.stages_of(r)},
            wiring.transport,
            wiring.reducer,
            hooks.step_hook,
            hooks.compute_hook,
            hooks.grads_hook if grads else None,
        )
        for r in wiring.ranks
    ]


def forward_only(schedule: Schedule) -> Schedule:
    """The forward actions of a schedule, in its order (evaluation)."""
    keep = {Kind.F, Kind.SEND_F, Kind.RECV_F}
    rows = tuple(tuple(a for a in row if a.kind in keep) for row in schedule.actions)
    return Schedule(schedule.name + "/forward", schedule.placement, schedule.microbatches, rows)


def _runners(
    schedule: Schedule, stage_modules: dict[int, StageModule], loss_fn: LossFn
) -> dict[int, StageRunner]:
    placement = schedule.placement
    split_mbs = _split_microbatches(schedule)  # stage -> its split backwards, None: all
    return {
        s: StageRunner(
            s,
            module,
            is_first=placement.is_first(s),
            is_last=placement.is_last(s),
            loss_fn=loss_fn,
            split_backward=s in split_mbs,
            split_only=split_mbs.get(s),
        )
        for s, module in stage_modules.items()
    }


def _split_microbatches(schedule: Schedule) -> dict[int, frozenset[int] | None]:
    """The stages whose backward the schedule splits into I and W, each with the
    micro-batches it splits, or None where it splits every one (the zero-bubble family)."""
    split: dict[int, set[int]] = {}
    forwards: dict[int, set[int]] = {}
    for row in schedule.actions:
        for action in row:
            if action.microbatch is None:
                continue
            if action.kind is Kind.I:
                split.setdefault(action.stage, set()).add(action.microbatch)
            elif action.kind is Kind.F:
                forwards.setdefault(action.stage, set()).add(action.microbatch)
    return {
        stage: None if mbs == forwards.get(stage) else frozenset(mbs)
        for stage, mbs in split.items()
    }


def _replica_groups(placement: Placement) -> list[ReplicaGroup]:
    """The replicas of each model stage (several only under Chimera) and their ranks."""
    return [
        ReplicaGroup(
            j,
            placement.replicas_of(j),
            tuple(placement.rank_of(s) for s in placement.replicas_of(j)),
        )
        for j in range(placement.num_model_stages)
    ]


def _tied_groups(placement: Placement, holders: dict[str, tuple[int, ...]]) -> list[TiedGroup]:
    """Per tied weight held by more than one stage: the stages that hold it and their ranks.

    ``holders``: tied key -> the model stages that hold it (``PipelineSpec.tied_holders``).
    """
    groups = []
    for key, model_stages in holders.items():
        if len(model_stages) * placement.replicas <= 1:
            continue
        stages = tuple(
            s for s in range(placement.num_stages) if placement.model_stage(s) in model_stages
        )
        groups.append(TiedGroup(key, stages, tuple(placement.rank_of(s) for s in stages)))
    return groups


def _tied_names(stage_modules: dict[int, StageModule]) -> dict[str, str]:
    names: dict[str, str] = {}
    for module in stage_modules.values():
        by_id = {id(p): key for key, p in module.tied_parameters().items()}
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in by_id and name != by_id[id(p)]:
                names[name] = by_id[id(p)]
    return names


def _rank_map(group: Any) -> str:
    """The runtime's errors number ranks within the pipeline's group; where those are not
    the global ranks (data parallelism: one pipeline per replica), this says which process
    is which."""
    if group is None:
        return ""
    world = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    if world == list(range(len(world))):
        return ""
    pairs = ", ".join(f"{r} is global rank {g}" for r, g in enumerate(world))
    return f" [ranks of this pipeline's group: {pairs}]"
