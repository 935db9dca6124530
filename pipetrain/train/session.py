"""What one process of a synchronous run holds, built once before its first step.

``open_session`` is the set-up step of ``pipetrain.train.loop.train``: this rank's pipeline
with its stage options, the data-parallel gradient sync (``pipetrain.parallel``), the data
and output (``pipetrain.train.shared``, as the asynchronous trainer opens them), the
optimizer and its guard, and the checkpoints. The loop then only steps, evaluates and
finishes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist

from pipetrain.checkpoint import CheckpointPolicy, Layout, RunCheckpoints
from pipetrain.config import TrainConfig, config_to_dict
from pipetrain.data import (
    Batch,
    Corpus,
    eval_batches,
    train_batch,
)
from pipetrain.launch.role import ProcessRole
from pipetrain.models import model_spec
from pipetrain.models.hf import load_hf_weights
from pipetrain.parallel import (
    ExpertGradients,
    ExpertGroups,
    Gradients,
    GradientSync,
    Mesh,
    expert_groups,
    expert_parameters,
    gradient_sync,
    norm_share,
    replica_denominator,
    replica_mean,
    shard_batch,
    shard_experts,
    shard_pipeline,
)
from pipetrain.parallel.expert_stats import ExpertTracker
from pipetrain.runtime import Pipeline, PipelineHooks, build_pipeline
from pipetrain.tensors import local_tensor
from pipetrain.train.memory_check import memory_baseline
from pipetrain.train.metrics import RunOutput
from pipetrain.train.optim import GuardedUpdate, build_optimizer
from pipetrain.train.plan import RunPlan
from pipetrain.train.shared import open_data, open_output
from pipetrain.train.stage_options import apply_stage_options

__all__ = ["Session", "local_gradients", "open_session"]


@dataclass(frozen=True)
class Session:
    """One process's synchronous run, set up: what every step and evaluation works with."""

    config: TrainConfig
    role: ProcessRole
    plan: RunPlan
    device: torch.device
    # The pipeline group (None with one pipeline rank or in one process) and the mesh of
    # pipeline x data-parallel groups (None without a process group).
    group: Any
    mesh: Mesh | None
    pipeline: Pipeline
    # Whether this process holds a first stage (feeds inputs) and a last one (targets).
    first: bool
    last: bool
    # The data, on processes that hold a first or last stage only.
    corpus: Corpus | None
    evals: list[tuple[Batch, float | None]] | None
    # The gradients of this rank's replicas (replicated or sharded); None without dp.
    replicas: GradientSync | None
    optimizer: torch.optim.Optimizer
    update: GuardedUpdate
    grads: Gradients
    output: RunOutput
    checkpoints: RunCheckpoints
    # The MoE layers' step records and balancing (None for a dense model).
    experts: ExpertTracker | None = None
    # This process's memory once set up, before the steps (train.memory_check).
    memory_baseline: int = 0

    @property
    def sharded(self) -> bool:
        """Each replica holds a slice of the parameters (``--shard``)."""
        return self.replicas is not None and self.replicas.sharded

    def shard(self, batch: Batch) -> tuple[Batch, float | None]:
        """This replica's rows, and what it divides its loss by (None: its own tokens)."""
        return _shard(batch, self.mesh)

    def micro_batch(self, index: int) -> tuple[Any, Any, float | None]:
        """(inputs, targets, loss denominator) of training micro-batch ``index`` here.

        Inputs only on a first stage and targets only on a last one; None elsewhere.
        """
        if self.corpus is None:
            return None, None, None
        d, r = self.config.data, self.config.run
        batch = train_batch(
            self.corpus, index, seed=r.seed, batch_size=d.batch_size, seq_len=d.seq_len
        )
        batch, denominator = self.shard(batch)
        return (
            batch.inputs if self.first else None,
            batch.targets if self.last else None,
            denominator,
        )

    def evaluate(self, step: int) -> float:
        """The held-out loss, known on every rank and reported; NaN when evaluation is off."""
        d, r = self.config.data, self.config.run
        if not r.evaluate:
            return math.nan
        losses = []
        for i in range(d.eval_batches):
            batch, denominator = self.evals[i] if self.evals is not None else (None, None)
            losses.append(
                self.pipeline.eval_loss(
                    batch.inputs if batch is not None and self.first else None,
                    batch.targets if batch is not None and self.last else None,
                    denominator=denominator,
                    label=f"evaluation after step {step} (batch {i + 1} of {d.eval_batches})",
                )
            )
        if self.replicas is not None:
            self.replicas.after_eval()
        value = sum(losses) / len(losses)
        if self.mesh is not None:
            value = replica_mean([value], self.mesh, self.device)[0]
        self.output.report({"step": step, "eval_loss": value})
        self.output.say(f"eval loss after {step} steps: {value:.4f}")
        return value


def open_session(
    config: TrainConfig,
    role: ProcessRole,
    plan: RunPlan,
    device: torch.device,
    group: Any,
    out: IO[str],
    mesh: Mesh | None,
) -> Session:
    """Build this process's part of the run, in the order the pieces depend on each other."""
    p, r = config.pipeline, config.run
    # Data parallelism: gradients averaged over the replicas (replicated or, with --shard,
    # sharded stages), shards of every batch, and the norm, the NaN decision and
    # checkpoints over every process (the world group).
    # Expert parallelism: each rank of an ep group builds its share of the experts only.
    experts = expert_groups(mesh, p.ep) if mesh is not None and p.ep > 1 else None
    replicas = gradient_sync(
        mesh,
        shard=p.shard,
        timeout_s=p.timeout_s,
        experts=ExpertGradients(experts, p.dp) if experts is not None else None,
        grad_views=p.grad_as_bucket_view,
    )
    everyone = mesh.world_group if mesh is not None else group

    pipeline = _build_stages(config, plan, device, group, mesh, experts, replicas)
    first, last, corpus = open_data(config, pipeline, everyone)
    evals = _eval_batches(config, corpus, mesh)
    optimizer = build_optimizer(pipeline.named_parameters(), config.optim)
    update = GuardedUpdate(optimizer, config.optim, total_steps=r.steps, group=everyone)
    grads = _gradients(pipeline, mesh, replicas, experts)
    output = open_output(config, role, out)
    if role.reporter and corpus is not None:
        _describe(config, plan, pipeline, corpus, device, output.say)
    checkpoints = _checkpoints(config, plan, pipeline, optimizer, everyone, device, output)
    return Session(
        config=config,
        role=role,
        plan=plan,
        device=device,
        group=group,
        mesh=mesh,
        pipeline=pipeline,
        first=first,
        last=last,
        corpus=corpus,
        evals=evals,
        replicas=replicas,
        optimizer=optimizer,
        update=update,
        grads=grads,
        output=output,
        checkpoints=checkpoints,
        memory_baseline=memory_baseline(device),
        experts=(
            ExpertTracker(
                plan.model,
                pipeline.modules,
                mesh,
                device,
                group=experts.group if experts is not None else None,
            )
            if plan.model.n_experts
            else None
        ),
    )


def _build_stages(
    config: TrainConfig,
    plan: RunPlan,
    device: torch.device,
    group: Any,
    mesh: Mesh | None,
    experts: ExpertGroups | None,
    replicas: GradientSync | None,
) -> Pipeline:
    """This rank's stages, built, loaded, sharded (experts, then tp, then dp) and wrapped
    with the stage options, in the order each step needs the one before."""
    p, r = config.pipeline, config.run
    pipeline = build_pipeline(
        model_spec(
            plan.model,
            expert_shard=(experts.ep_rank, experts.ep) if experts is not None else None,
        ),
        schedule=plan.prepared,
        microbatches=p.microbatches,
        group=group,
        ranks=None if group is not None else p.pp,
        device=device,
        seed=r.seed,
        split=plan.split,
        timeout_s=p.timeout_s,
        hooks=PipelineHooks(grads_hook=replicas.grads_hook if replicas is not None else None),
    )
    if pipeline.hang_watch is not None:  # the hang doctor's report: <run dir>/doctor.json
        pipeline.hang_watch.report_dir = config.run_dir
    if config.model.init_from:  # this rank's layers only; before tp shards them
        load_hf_weights(pipeline, config.model.init_from, check=False)
    if experts is not None:
        shard_experts(pipeline.modules, experts)
    if mesh is not None and mesh.tp > 1:  # first: the options and FSDP2 wrap the tp shards
        shard_pipeline(pipeline, mesh.tp_mesh, sequence_parallel=p.sequence_parallel)
    recomputing = p.recomputing_ranks
    for stage, module in zip(pipeline.stages, pipeline.modules, strict=True):
        apply_stage_options(
            module,
            device=device,
            precision=p.precision,
            recompute=pipeline.schedule.placement.rank_of(stage) in recomputing,
            compile_stage=p.compile,
        )
    if replicas is not None:  # sharding replaces the parameters: before the optimizer
        replicas.attach(pipeline)
    return pipeline


def local_gradients(pipeline: Pipeline) -> Gradients:
    """This process's parameters; tied copies and replicas after the first are not counted."""
    placement = pipeline.schedule.placement
    params: list[torch.Tensor] = []
    extra: list[torch.Tensor] = []
    seen: set[int] = set()
    for stage, module in zip(pipeline.stages, pipeline.modules, strict=True):
        for name, param in module.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            params.append(param)
            if name in pipeline.tied_names or placement.replica(stage) > 0:
                extra.append(param)
    return Gradients.of(params, not_counted=extra)


def _eval_batches(
    config: TrainConfig, corpus: Corpus | None, mesh: Mesh | None
) -> list[tuple[Batch, float | None]] | None:
    """The held-out batches, this replica's rows of each; None where no data is read."""
    if corpus is None:
        return None
    d = config.data
    return [
        _shard(b, mesh)
        for b in eval_batches(
            corpus, batch_size=d.batch_size, seq_len=d.seq_len, count=d.eval_batches
        )
    ]


def _gradients(
    pipeline: Pipeline,
    mesh: Mesh | None,
    replicas: GradientSync | None,
    experts: ExpertGroups | None,
) -> Gradients:
    """The gradients the norm and the NaN decision see: with dp, each process's share."""
    if mesh is None:
        return local_gradients(pipeline)
    return norm_share(
        local_gradients(pipeline),
        mesh,
        sharded=replicas is not None and replicas.sharded,
        experts=(
            (expert_parameters(pipeline.modules), experts.replica_index == 0)
            if experts is not None
            else None
        ),
    )


def _describe(
    config: TrainConfig,
    plan: RunPlan,
    pipeline: Pipeline,
    corpus: Corpus,
    device: torch.device,
    say: Callable[[str], None],
) -> None:
    """The data, the model, the schedule and its early input gradients, in the run's first
    lines."""
    p = config.pipeline
    # A tensor-parallel layer's DTensor parameters count what this process holds.
    n_params = sum(local_tensor(param).numel() for param in pipeline.parameters())
    tp = f" x tp {p.tp}{' (sequence parallel)' if p.sequence_parallel else ''}" if p.tp > 1 else ""
    say(f"data: {corpus.description}")
    say(
        f"model {plan.model.name}: {plan.model.n_layers} blocks, d_model {plan.model.d_model}; "
        f"schedule {plan.schedule.name} on {p.pp} rank{'s' if p.pp > 1 else ''}{tp}, split {[len(s) for s in plan.split]} layers, "
        f"{n_params:,} parameters in this process, device {device}"
    )
    if plan.early_splits:
        n = len(plan.early_splits)
        say(
            f"early input gradients: {n} backward{'s' if n > 1 else ''} run as I then W "
            f"({', '.join(plan.early_splits)}; --no-early-grads runs them whole)"
        )


def _shard(batch: Batch, mesh: Mesh | None) -> tuple[Batch, float | None]:
    if mesh is None or mesh.dp == 1:
        return batch, None
    return (
        shard_batch(batch, mesh.dp_rank, mesh.dp),
        replica_denominator(batch.targets, mesh.dp),
    )


def _checkpoints(
    config: TrainConfig,
    plan: RunPlan,
    pipeline: Pipeline,
    optimizer: torch.optim.Optimizer,
    everyone: Any,
    device: torch.device,
    output: RunOutput,
) -> RunCheckpoints:
    """Saving, resuming and the stop signal, over every process of the run."""
    p, r = config.pipeline, config.run
    model_fields = dataclasses.asdict(plan.model)
    model_fields.pop("name")  # a label: the same weights load whatever the preset was called
    return RunCheckpoints(
        CheckpointPolicy(r.checkpoint_dir, r.checkpoint_every, r.keep, r.resume, r.stop_grace_s),
        modules=pipeline.modules,
        optimizer=optimizer,
        model=model_fields,
        layout=Layout(
            p.pp,
            # Model stages per rank: the V schedules hold 2 whatever pipeline.chunks says.
            len(plan.split) // p.pp,
            p.schedule,
            dist.get_world_size(everyone) if everyone is not None else 1,
            plan.split,
            tp=p.tp,
        ),
        config=config_to_dict(config),
        total_steps=r.steps,
        group=everyone,
        device=device,
        say=output.say,
        # Batches are a function of (seed, index): the position is all the data state there is.
        state=lambda done: {"step": done, "data_position": done * config.optim.grad_accum},
    )
