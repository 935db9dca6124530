"""The training run of one process: build this rank's stages, train, evaluate, report.

The same function runs every case: ``--pp 1`` (one stage, no process group), the
single-process debug mode (every rank's stages in this process), and one rank of a
process group started by ``launch`` or by torchrun. Only rank 0 reports; every rank
knows the loss, so every rank takes the same decisions.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist

from pipetrain.checkpoint import CheckpointPolicy, Layout, RunCheckpoints
from pipetrain.errors import InputError
from pipetrain.models import build_full_model, model_spec
from pipetrain.runtime import Pipeline, build_pipeline
from pipetrain.schedules import Kind
from pipetrain.schedules.execution import Costs, Timeline
from pipetrain.train.config import ConfigError, TrainConfig, config_to_dict, config_to_toml
from pipetrain.train.data import (
    Batch,
    Corpus,
    eval_batches,
    load_corpus,
    load_tokenizer,
    train_batch,
)
from pipetrain.train.metrics import (
    RunOutput,
    RunSummary,
    measured_bubble,
    peak_memory_bytes,
)
from pipetrain.train.optim import Gradients, GuardedUpdate, build_optimizer
from pipetrain.train.parallel import (
    Mesh,
    ReplicaGradients,
    build_mesh,
    norm_share,
    replica_denominator,
    replica_mean,
    shard_batch,
    state_bytes,
)
from pipetrain.train.plan import RunPlan, plan_run, threads_per_process
from pipetrain.train.sample import gather_state_dict, generate
from pipetrain.train.sharded import ShardedGradients
from pipetrain.train.stage_options import StageOptionError, apply_stage_options

__all__ = ["ProcessRole", "announce", "resolve_device", "train"]

# Steps left out of the timing averages: the first runs allocations (and compilation).
_WARMUP_STEPS = 1


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


def resolve_device(setting: str, local_rank: int) -> torch.device:
    """``cuda:<local rank>`` when asked for (or ``auto`` and present), else the CPU."""
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(
                "pipeline.device is 'cuda' but no CUDA device is available: use --device cpu"
            )
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def announce(config: TrainConfig, out: IO[str]) -> None:
    """Print the resolved config and save it with the run (rank 0, once per run)."""
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    text = config_to_toml(config)
    (run_dir / "config.toml").write_text(text, encoding="utf-8")
    out.write(f"# resolved config, saved to {run_dir / 'config.toml'}\n{text}\n")
    out.flush()


# ----------------------------------------------------------------------------- pieces


def _holds(pipeline: Pipeline) -> tuple[bool, bool]:
    """Whether this process holds a first stage (needs inputs) and a last one (targets)."""
    placement = pipeline.schedule.placement
    return (
        any(placement.is_first(s) for s in pipeline.stages),
        any(placement.is_last(s) for s in pipeline.stages),
    )


def _gradients(pipeline: Pipeline) -> Gradients:
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


def _simulated_bubble(plan: RunPlan, timelines: list[Timeline]) -> float | None:
    """Bubble of the simulator for this schedule, fed with the measured action times."""
    from pipetrain.sim import simulate

    placement = plan.schedule.placement
    durations: dict[tuple[Kind, int], list[float]] = defaultdict(list)
    for timeline in timelines:
        for event in timeline.events:
            if event.action.is_compute:
                durations[(event.action.kind, placement.model_stage(event.action.stage))].append(
                    event.duration
                )
    if not durations:
        return None
    stages = range(placement.num_model_stages)

    def per_stage(kind: Kind) -> tuple[float, ...]:
        return tuple(
            statistics.median(durations[(kind, s)]) if durations[(kind, s)] else 0.0 for s in stages
        )

    costs = Costs(
        forward=per_stage(Kind.F),
        backward=per_stage(Kind.B),
        backward_input=per_stage(Kind.I),
        backward_weight=per_stage(Kind.W),
    )
    return simulate(plan.schedule, costs).bubble.idle_fraction


def peak_memory_per_rank(role: ProcessRole, device: torch.device) -> tuple[int, ...]:
    """Every rank's peak memory in bytes, known on every rank (a collective)."""
    peak = peak_memory_bytes(str(device))
    if not role.distributed:
        return (peak,)
    everyone: list[Any] = [None] * role.world_size
    dist.all_gather_object(everyone, peak)
    return tuple(int(p) for p in everyone)


# ----------------------------------------------------------------------------- the run


def train(
    config: TrainConfig, role: ProcessRole, *, out: IO[str] | None = None, announced: bool = False
) -> RunSummary | None:
    """Train as one process of the run; returns the summary on rank 0 (None elsewhere).

    ``announced``: the launcher already printed and saved the resolved config.
    """
    out = sys.stdout if out is None else out
    started = time.perf_counter()
    p = config.pipeline
    if role.distributed and role.world_size != p.pp * p.dp:
        raise ConfigError(
            f"{role.world_size} processes were started but pipeline.pp x pipeline.dp is "
            f"{p.pp * p.dp}: start {p.pp * p.dp} processes in all (torchrun --nnodes x "
            f"--nproc-per-node) or change --pp/--dp"
        )
    tokenizer = load_tokenizer(config.data.tokenizer)
    plan = plan_run(config, vocab_size=tokenizer.vocab_size)
    device = resolve_device(p.device, role.local_rank)
    if device.type == "cpu":
        torch.set_num_threads(threads_per_process(p.threads, role.local_world_size))
    if role.reporter and not announced:
        announce(config, out)

    group: Any = None
    mesh: Mesh | None = None
    if role.distributed:
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                timeout=datetime.timedelta(seconds=p.timeout_s),
            )
        mesh = build_mesh(device.type, p.pp, p.dp)
        # One pipeline rank (--pp 1 --dp N) runs its single stage without a pipeline group.
        group = mesh.pp_group if p.pp > 1 else None
    try:
        return _train(config, role, plan, device, group, out, started, mesh)
    finally:
        if role.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _train(
    config: TrainConfig,
    role: ProcessRole,
    plan: RunPlan,
    device: torch.device,
    group: Any,
    out: IO[str],
    started: float,
    mesh: Mesh | None = None,
) -> RunSummary | None:
    if plan.schedule.asynchronous:  # pipedream, pipedream-2bw: weights change inside a step
        from pipetrain.train.async_loop import train_async

        return train_async(config, role, plan, device, group, out, started)
    p, d, r = config.pipeline, config.data, config.run
    spec = model_spec(plan.model)
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
    sharded = replicas if isinstance(replicas, ShardedGradients) else None
    everyone = mesh.world_group if mesh is not None else group

    def shard(batch: Batch) -> tuple[Batch, float | None]:
        """This replica's rows, and what it divides its loss by (None: its own tokens)."""
        if mesh is None or mesh.dp == 1:
            return batch, None
        return (
            shard_batch(batch, mesh.dp_rank, mesh.dp),
            replica_denominator(batch.targets, mesh.dp),
        )

    pipeline = build_pipeline(
        spec,
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
    first, last = _holds(pipeline)
    corpus: Corpus | None = load_corpus(d) if first or last else None
    evals: list[tuple[Batch, float | None]] | None = None
    if corpus is not None:
        evals = [
            shard(b)
            for b in eval_batches(
                corpus, batch_size=d.batch_size, seq_len=d.seq_len, count=d.eval_batches
            )
        ]

    optimizer = build_optimizer(pipeline.named_parameters(), config.optim)
    update = GuardedUpdate(optimizer, config.optim, total_steps=r.steps, group=everyone)
    grads = (
        _gradients(pipeline)
        if mesh is None
        else norm_share(_gradients(pipeline), mesh, sharded=sharded is not None)
    )

    output = RunOutput(
        active=role.reporter,
        total_steps=r.steps,
        stream=out,
        metrics_path=config.metrics_path,
        tensorboard_dir=config.run_dir / "tensorboard" if r.tensorboard else None,
    )
    progress, report, say = output.progress, output.report, output.say

    if role.reporter and corpus is not None:
        n_params = sum(param.numel() for param in pipeline.parameters())
        say(f"data: {corpus.description}")
        say(
            f"model {plan.model.name}: {plan.model.n_layers} blocks, d_model {plan.model.d_model}; "
            f"schedule {plan.schedule.name} on {p.pp} ranks, split {[len(s) for s in plan.split]} layers, "
            f"{n_params:,} parameters in this process, device {device}"
        )

    def evaluate(step: int) -> float:
        if not r.evaluate:
            return math.nan
        losses = []
        for i in range(d.eval_batches):
            batch, denominator = evals[i] if evals is not None else (None, None)
            losses.append(
                pipeline.eval_loss(
                    batch.inputs if batch is not None and first else None,
                    batch.targets if batch is not None and last else None,
                    denominator=denominator,
                )
            )
        if sharded is not None:  # the forwards gathered the parameters: free them
            sharded.reshard()
        value = sum(losses) / len(losses)
        if mesh is not None:
            value = replica_mean([value], mesh, device)[0]
        report({"step": step, "eval_loss": value})
        say(f"eval loss after {step} steps: {value:.4f}")
        return value

    model_fields = dataclasses.asdict(plan.model)
    model_fields.pop("name")  # a label: the same weights load whatever the preset was called
    checkpoints = RunCheckpoints(
        CheckpointPolicy(r.checkpoint_dir, r.checkpoint_every, r.keep, r.resume),
        modules=pipeline.modules,
        optimizer=optimizer,
        model=model_fields,
        layout=Layout(
            p.pp,
            p.chunks,
            p.schedule,
            dist.get_world_size(everyone) if everyone is not None else 1,
            plan.split,
        ),
        config=config_to_dict(config),
        total_steps=r.steps,
        group=everyone,
        device=device,
        say=say,
        # Batches are a function of (seed, index): the position is all the data state there is.
        state=lambda done: {"step": done, "data_position": done * config.optim.grad_accum},
    )
    start = checkpoints.resume()
    first_eval = evaluate(start)
    last_eval = first_eval
    accum = config.optim.grad_accum
    # (step time, tokens, timeline, bubble) of every step this process trains.
    measured: list[tuple[float, int, Timeline, float]] = []
    skipped = 0
    last_timeline: Timeline | None = None
    loop_started = time.perf_counter()
    for step in range(start, r.steps):
        t0 = time.perf_counter()
        losses: list[float] = []
        tokens = 0
        for micro in range(accum):
            batch = (
                train_batch(
                    corpus,
                    step * accum + micro,
                    seed=r.seed,
                    batch_size=d.batch_size,
                    seq_len=d.seq_len,
                )
                if corpus is not None
                else None
            )
            denominator = None
            if batch is not None:
                batch, denominator = shard(batch)
            inputs = batch.inputs if batch is not None and first else None
            targets = batch.targets if batch is not None and last else None
            if replicas is not None:
                replicas.begin(sync=micro == accum - 1)
            result = _first_step_guard(
                pipeline,
                inputs,
                targets,
                compiled=p.compile and step == 0 and micro == 0,
                denominator=denominator,
            )
            losses.append(result.loss)
            tokens += result.tokens
            last_timeline = result.timeline
        loss = sum(losses) / len(losses)
        if replicas is not None and mesh is not None:
            replicas.finish(step)
            loss, mean_tokens = replica_mean([loss, float(tokens)], mesh, device)
            tokens = round(mean_tokens * mesh.dp)
        outcome = update.apply(step, grads, loss, accumulated=accum)
        elapsed = time.perf_counter() - t0
        assert last_timeline is not None
        # In one process the ranks take turns: their idle time says nothing of a pipeline.
        bubble = measured_bubble(last_timeline) if role.distributed else math.nan
        measured.append((elapsed, tokens, last_timeline, bubble))
        skipped += int(outcome.skipped)
        tokens_per_s = tokens / elapsed if elapsed > 0 else math.nan
        report(
            {
                "step": step + 1,
                "loss": loss,
                "lr": outcome.lr,
                "grad_norm": outcome.grad_norm,
                "clip_factor": outcome.clip_factor,
                "skipped": outcome.skipped,
                "tokens": tokens,
                "tokens_per_s": tokens_per_s,
                "step_time_s": elapsed,
                "bubble": bubble,
            }
        )
        if progress is not None:
            note = (
                f"skipped: non-finite loss or gradient ({outcome.bad_in_row} in a row)"
                if outcome.skipped
                else ""
            )
            progress.update(
                step,
                loss=loss,
                tokens_per_s=tokens_per_s,
                elapsed_s=time.perf_counter() - loop_started,
                note=note,
            )
        if r.eval_every and (step + 1) % r.eval_every == 0 and step + 1 < r.steps:
            last_eval = evaluate(step + 1)
        if checkpoints.after_step(step + 1):
            break
    checkpoints.close()
    last_eval = evaluate(step + 1 if checkpoints.stopped else r.steps)

    if r.timeline and role.reporter and last_timeline is not None:
        from pipetrain.sim.render import plot

        plot(last_timeline, r.timeline)
        say(f"measured timeline of the last step drawn to {r.timeline}")
    peaks = peak_memory_per_rank(role, device)
    # Timing leaves out the warm-up steps, unless there is nothing else.
    timed = measured[_WARMUP_STEPS:] or measured
    train_time = sum(m[0] for m in timed)
    summary = RunSummary(
        steps=len(measured),
        wall_s=time.perf_counter() - started,
        tokens=sum(m[1] for m in measured),
        tokens_per_s=sum(m[1] for m in timed) / train_time if train_time > 0 else math.nan,
        measured_bubble=statistics.mean(m[3] for m in timed)
        if role.distributed and timed
        else None,
        simulated_bubble=_simulated_bubble(plan, [m[2] for m in timed]) if p.pp > 1 else None,
        first_eval_loss=first_eval,
        final_eval_loss=last_eval,
        peak_memory=peaks,
        skipped_steps=skipped,
    )
    if role.reporter:
        say(summary.format())
    dp_stats = (
        replicas.stats(_WARMUP_STEPS, state_bytes=state_bytes(pipeline.parameters(), optimizer))
        if replicas is not None
        else None
    )
    if dp_stats is not None:
        say(dp_stats.format())
    # The replicas hold the same weights: the first one samples. Sharded, every replica
    # takes part in gathering the full weights.
    if r.sample_tokens and (mesh is None or mesh.dp_rank == 0 or sharded is not None):
        _sample(config, plan, pipeline, group, corpus, say, here=mesh is None or mesh.dp_rank == 0)
    output.record(summary.to_json())
    if dp_stats is not None:
        output.record(dp_stats.to_json())
    output.close()
    return summary if role.reporter else None


def _first_step_guard(
    pipeline: Pipeline,
    inputs: Any,
    targets: Any,
    *,
    compiled: bool,
    denominator: float | None = None,
) -> Any:
    """Run a step; a failure of torch.compile (it compiles on the first call) becomes one line."""
    if not compiled:
        return pipeline.step(inputs, targets, denominator=denominator)
    try:
        return pipeline.step(inputs, targets, denominator=denominator)
    except InputError:
        raise
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise StageOptionError(
            f"pipeline.compile: torch.compile failed on this machine ({type(exc).__name__}: {first_line}): "
            f"drop --compile"
        ) from None


def _sample(
    config: TrainConfig,
    plan: RunPlan,
    pipeline: Pipeline,
    group: Any,
    corpus: Corpus | None,
    say: Any,
    *,
    here: bool = True,
) -> None:
    """Rank 0 prints text generated by the model assembled from every stage's weights.

    ``here`` false: this process only helps gather the weights (another replica samples).
    """
    state = gather_state_dict(pipeline.modules, group)
    if state is None or corpus is None or not here:
        return
    r = config.run
    model = build_full_model(model_spec(plan.model), seed=r.seed, device="cpu")
    model.load_state_dict(state)
    model.eval()
    tokenizer = corpus.tokenizer
    ids = generate(
        model,
        tokenizer.encode(r.sample_prompt),
        new_tokens=r.sample_tokens,
        context=min(plan.model.max_seq_len, config.data.seq_len),
        temperature=r.sample_temperature,
        seed=r.seed,
    )
    say(f"sample (temperature {r.sample_temperature}):\n{r.sample_prompt}{tokenizer.decode(ids)}\n")
