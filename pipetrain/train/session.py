"""What one process of a synchronous run holds, built once before its first step.

``open_session`` does the set-up of ``pipetrain.train.loop``: this rank's pipeline with its
stage options, the data-parallel reducer, the data, the optimizer and its guard, the
output and the checkpoints. The loop then only steps, evaluates and finishes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist

from pipetrain.checkpoint import CheckpointPolicy, Layout, RunCheckpoints
from pipetrain.models import model_spec
from pipetrain.runtime import Pipeline, build_pipeline
from pipetrain.train.config import TrainConfig, config_to_dict
from pipetrain.train.data import (
    Batch,
    Corpus,
    DataError,
    eval_batches,
    load_corpus,
    train_batch,
)
from pipetrain.train.metrics import RunOutput
from pipetrain.train.optim import Gradients, GuardedUpdate, build_optimizer
from pipetrain.train.parallel import (
    Mesh,
    ReplicaGradients,
    norm_share,
    replica_denominator,
    replica_mean,
    shard_batch,
)
from pipetrain.train.plan import RunPlan
from pipetrain.train.sharded import ShardedGradients
from pipetrain.train.stage_options import apply_stage_options

__all__ = [
    "ProcessRole",
    "Session",
    "check_same_data",
    "corpus_fingerprint",
    "data_disagree",
    "local_gradients",
    "open_output",
    "open_session",
]


@dataclass(frozen=True)
class ProcessRole:
    """Where this process sits: its rank in the pipeline group and its neighbours on the node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def reporter(self) -> bool:
        return self.rank == 0


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
    replicas: ReplicaGradients | ShardedGradients | None
    optimizer: torch.optim.Optimizer
    update: GuardedUpdate
    grads: Gradients
    output: RunOutput
    checkpoints: RunCheckpoints

    @property
    def sharded(self) -> ShardedGradients | None:
        return self.replicas if isinstance(self.replicas, ShardedGradients) else None

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
        if self.sharded is not None:  # the forwards gathered the parameters: free them
            self.sharded.reshard()
        value = sum(losses) / len(losses)
        if self.mesh is not None:
            value = replica_mean([value], self.mesh, self.device)[0]
        self.output.report({"step": step, "eval_loss": value})
        self.output.say(f"eval loss after {step} steps: {value:.4f}")
        return value


def open_output(config: TrainConfig, role: ProcessRole, out: IO[str]) -> RunOutput:
    """Where a run's progress lines and metrics go (silent on every rank but the reporter)."""
    return RunOutput(
        active=role.reporter,
        total_steps=config.run.steps,
        stream=out,
        metrics_path=config.metrics_path,
        tensorboard_dir=config.run_dir / "tensorboard" if config.run.tensorboard else None,
        # A resumed run keeps the records of its earlier part (truncating lost them).
        resume=config.run.resume,
    )


def corpus_fingerprint(corpus: Corpus) -> tuple[str, int, int]:
    """A digest of the token streams, with their lengths for the message."""
    digest = hashlib.blake2b(digest_size=16)
    for stream in (corpus.train, corpus.eval):
        digest.update(len(stream).to_bytes(8, "little"))
        digest.update(stream.tobytes())
    return digest.hexdigest(), len(corpus.train), len(corpus.eval)


def data_disagree(by_rank: list[tuple[str, int, int] | None]) -> str | None:
    """Why the ranks that read data (``corpus_fingerprint`` of each, None where a rank
    reads none) cannot train together, in one line; None when they read the same tokens.

    The first stage reads the inputs and the last the targets of the same batch index:
    with other text on another node (files that differ under one path, or the default
    corpus of another Python version's standard library) the targets would belong to
    other inputs and the loss would fall for nothing, silently."""
    held = [(rank, f) for rank, f in enumerate(by_rank) if f is not None]
    if not held:
        return None
    (first_rank, first), *rest = held
    for rank, theirs in rest:
        if theirs != first:
            return (
                f"rank {rank} read other data than rank {first_rank} ({theirs[1]:,} train "
                f"and {theirs[2]:,} eval tokens against {first[1]:,} and {first[2]:,}) from the "
                f"same data.path: give every node the same files (the default corpus is the "
                f"running Python's standard library: use one Python version on every node)"
            )
    return None


def check_same_data(corpus: Corpus | None, group: Any) -> None:
    """Refuse, on every rank of ``group`` alike, a run whose ranks read different text."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    mine = None if corpus is None else corpus_fingerprint(corpus)
    dist.all_gather_object(everyone, mine, group=group)
    problem = data_disagree(everyone)
    if problem is not None:
        raise DataError(problem)


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
    p, d, r = config.pipeline, config.data, config.run
    # Data parallelism: gradients averaged over the replicas (replicated or, with --shard,
    # sharded stages), shards of every batch, and the norm, the NaN decision and
    # checkpoints over every process (the world group).
    replicas: ReplicaGradients | ShardedGradients | None = None
    if mesh is not None and mesh.dp > 1:
        replicas = (
            ShardedGradients(mesh, timeout_s=p.timeout_s)
            if p.shard
            else ReplicaGradients(mesh, timeout_s=p.timeout_s)
        )
    everyone = mesh.world_group if mesh is not None else group

    pipeline = build_pipeline(
        model_spec(plan.model),
        schedule=plan.schedule,
        microbatches=p.microbatches,
        group=group,
        ranks=None if group is not None else p.pp,
        device=device,
        seed=r.seed,
        split=plan.split,
        timeout_s=p.timeout_s,
        grads_hook=replicas.grads_hook if replicas is not None else None,
    )
    for module in pipeline.modules:
        apply_stage_options(
            module,
            device=device,
            precision=p.precision,
            recompute=p.recompute,
            compile_stage=p.compile,
        )
    if replicas is not None:  # sharding replaces the parameters: before the optimizer
        replicas.attach(pipeline)
    placement = pipeline.schedule.placement
    first = any(placement.is_first(s) for s in pipeline.stages)
    last = any(placement.is_last(s) for s in pipeline.stages)
    corpus: Corpus | None = load_corpus(d) if first or last else None
    if everyone is not None:
        check_same_data(corpus, everyone)
    evals: list[tuple[Batch, float | None]] | None = None
    if corpus is not None:
        evals = [
            _shard(b, mesh)
            for b in eval_batches(
                corpus, batch_size=d.batch_size, seq_len=d.seq_len, count=d.eval_batches
            )
        ]

    optimizer = build_optimizer(pipeline.named_parameters(), config.optim)
    update = GuardedUpdate(optimizer, config.optim, total_steps=r.steps, group=everyone)
    grads = (
        local_gradients(pipeline)
        if mesh is None
        else norm_share(
            local_gradients(pipeline), mesh, sharded=isinstance(replicas, ShardedGradients)
        )
    )
    output = open_output(config, role, out)
    if role.reporter and corpus is not None:
        n_params = sum(param.numel() for param in pipeline.parameters())
        output.say(f"data: {corpus.description}")
        output.say(
            f"model {plan.model.name}: {plan.model.n_layers} blocks, d_model {plan.model.d_model}; "
            f"schedule {plan.schedule.name} on {p.pp} rank{'s' if p.pp > 1 else ''}, split {[len(s) for s in plan.split]} layers, "
            f"{n_params:,} parameters in this process, device {device}"
        )
        if plan.early_splits:
            n = len(plan.early_splits)
            output.say(
                f"early input gradients: {n} backward{'s' if n > 1 else ''} run as I then W "
                f"({', '.join(plan.early_splits)}; --no-early-grads runs them whole)"
            )
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
    )


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
        CheckpointPolicy(r.checkpoint_dir, r.checkpoint_every, r.keep, r.resume),
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
        ),
        config=config_to_dict(config),
        total_steps=r.steps,
        group=everyone,
        device=device,
        say=output.say,
        # Batches are a function of (seed, index): the position is all the data state there is.
        state=lambda done: {"step": done, "data_position": done * config.optim.grad_accum},
    )
