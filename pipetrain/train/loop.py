"""The synchronous training run of one process: set up, train step by step, finish.

``train`` reads top to bottom: ``_set_up`` (this process's checks, plan and device, before
it meets the others), ``_process_group`` (the group and the data-parallel mesh), then
``open_session`` (``pipetrain.train.session``: the pipeline, data, optimizer, output and
checkpoints), ``_step_loop`` (the optimizer steps with their evaluations and
checkpoints) and ``_finish`` (summary, pictures and sample). An asynchronous schedule
hands the run to ``pipetrain.train.pipedream`` after the process group is made.

The same function runs every case: ``--pp 1`` (one stage, no process group), the
single-process debug mode (every rank's stages in this process), and one rank of a
process group started by ``pipetrain.launch`` or by torchrun. Only rank 0 reports; every
rank knows the loss, so every rank takes the same decisions.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist

from pipetrain.config.lock import RunLock
from pipetrain.config.run_folder import rank_zero_lock
from pipetrain.config.schema import (
    ConfigError,
    TrainConfig,
)
from pipetrain.data import load_tokenizer
from pipetrain.diagnose.profile import open_profiler, profiled_step
from pipetrain.heap import MAPPED_TENSORS, keep_heap, running_allocator
from pipetrain.launch.rendezvous import join_process_group, report_failure
from pipetrain.launch.role import ProcessRole
from pipetrain.parallel import Mesh, build_mesh, replica_mean, state_bytes
from pipetrain.parallel.expert_stats import ExpertStep, expert_summary
from pipetrain.runtime.device import gpu_identity, use_device
from pipetrain.runtime.timeline import simulated_bubble
from pipetrain.schedules.execution import Timeline
from pipetrain.train.grad_report import gradient_report
from pipetrain.train.memory_check import report_memory
from pipetrain.train.metrics import RunSummary, draw_timeline, measured_bubble
from pipetrain.train.microbatch_probe import MicrobatchProbe
from pipetrain.train.optim import StepOutcome
from pipetrain.train.pipedream.loop import train_async
from pipetrain.train.plan import (
    RunPlan,
    plan_run,
    threads_per_process,
)
from pipetrain.train.sample import gather_state_dict, sample_text
from pipetrain.train.session import Session, open_session
from pipetrain.train.shared import check_same_settings, peak_memory_per_rank, per_rank
from pipetrain.train.stage_options import first_step_guard

__all__ = ["resolve_device", "train"]

# Steps left out of the timing averages: the first runs allocations (and compilation).
_WARMUP_STEPS = 1


# ----------------------------------------------------------------------------- the run


def train(
    config: TrainConfig, role: ProcessRole, *, out: IO[str] | None = None, announced: bool = False
) -> RunSummary | None:
    """Train as one process of the run; returns the summary on rank 0 (None elsewhere).

    ``announced``: the launcher already printed and saved the resolved config.
    """
    out = sys.stdout if out is None else out
    started = time.perf_counter()
    plan, device, lock = _set_up(config, role, out, announced)
    with lock, _process_group(config, role, plan, device) as (group, mesh):
        if plan.schedule.asynchronous:  # pipedream, pipedream-2bw: weights change inside a step
            return train_async(config, role, plan, device, group, out, started)
        session = open_session(config, role, plan, device, group, out, mesh)
        try:
            trained = _step_loop(session)
            return None if trained is None else _finish(trained.session, trained, started)
        finally:
            session.output.close()  # also when the run fails: TensorBoard buffers its events


# ----------------------------------------------------------------------------- set-up


def _set_up(
    config: TrainConfig, role: ProcessRole, out: IO[str], announced: bool
) -> tuple[RunPlan, torch.device, RunLock]:
    """This process's checks and settings before it meets the others: the plan, the device,
    and the run's locks (``pipetrain.config.lock``), held where this process announces.

    A failure is reported before it is raised: under torchrun the other nodes would wait
    for this process until the timeout.
    """
    p = config.pipeline
    try:
        if role.distributed and role.world_size != p.processes:
            product, flags = (
                ("pipeline.pp x pipeline.dp", "--pp/--dp")
                if p.tp == 1
                else ("pipeline.pp x pipeline.dp x pipeline.tp", "--pp/--dp/--tp")
            )
            raise ConfigError(
                f"{role.world_size} processes were started but {product} is "
                f"{p.processes}: start {p.processes} processes in all (torchrun --nnodes x "
                f"--nproc-per-node) or change {flags}"
            )
        tokenizer = load_tokenizer(config.data.tokenizer)
        plan = plan_run(config, vocab_size=tokenizer.vocab_size, reporter=role.reporter)
        device = resolve_device(p.device, role.local_rank)
        # Before the process group: its object collectives on nccl use the current device.
        use_device(device)
        if device.type == "cpu":
            torch.set_num_threads(threads_per_process(p.threads, role.local_world_size))
        unused = tune_heap(device, config.run.map_tensors)
        if unused and role.reporter:
            print(unused, file=out, flush=True)
        lock = rank_zero_lock(config, out, announced=announced) if role.reporter else RunLock()
    except Exception as exc:
        report_failure(role, exc)
        raise
    return plan, device, lock


def tune_heap(device: torch.device, map_tensors: bool) -> str:
    """Set this process's C heap for ``device``; the line to print where ``map_tensors``
    was asked for and changed nothing (and why), else "".

    On a CPU activations live in the C heap: keep its freed pages for the next step, or map
    each tensor on its own where the memory is to be measured without holes (falling back
    to the kept heap where glibc refuses).
    """
    if device.type == "cpu":
        mapped = map_tensors and keep_heap(MAPPED_TENSORS)
        if not mapped:
            keep_heap()  # glibc's only: tcmalloc and jemalloc reuse freed pages already
        allocator = running_allocator()
        why = (
            "the C library took no mmap threshold (it tunes glibc's malloc)"
            if allocator == "glibc"
            else f"this process allocates with {allocator}, not glibc's malloc"
        )
    else:
        mapped = False
        why = f"on {device.type}, whose measured peak is the allocator's tensor bytes already"
    if not map_tensors or mapped:
        return ""
    return f"note: run.map_tensors has no effect here: {why}"


def resolve_device(setting: str, local_rank: int) -> torch.device:
    """``cuda:<local rank>`` when asked for (or ``auto`` and present), else the CPU.

    Two processes on one GPU (more processes on a node than it has GPUs) are named at the
    rendezvous, which compares the processes' GPUs (``rendezvous._shared_gpu``): counting
    here could not tell a node that shares GPUs from one whose launcher gives each
    process its own (each then sees one GPU).
    """
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(
                "pipeline.device is 'cuda' but no CUDA device is available: use --device cpu"
            )
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


@contextlib.contextmanager
def _process_group(
    config: TrainConfig, role: ProcessRole, plan: RunPlan, device: torch.device
) -> Iterator[tuple[Any, Mesh | None]]:
    """The pipeline group and the mesh of a distributed run, (None, None) in one process;
    the process group is destroyed when the run ends, also when it fails."""
    p = config.pipeline
    if role.distributed and not dist.is_initialized():
        join_process_group(
            role, "nccl" if device.type == "cuda" else "gloo", p.timeout_s, gpu_identity(device)
        )
    try:
        if not role.distributed:
            yield None, None
            return
        # Before the groups are made: ranks that disagree on pp, dp or tp would hang there.
        check_same_settings(config, plan)
        mesh = build_mesh(device.type, p.pp, p.dp, p.tp)
        # One pipeline rank (--pp 1 --dp N) runs its single stage without a pipeline group.
        yield (mesh.pp_group if p.pp > 1 else None), mesh
    finally:
        if role.distributed and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- the steps


@dataclass(frozen=True)
class Trained:
    """What the step loop leaves to the finish."""

    records: list[StepRecord]  # one per step this session trained
    first_eval: float  # before the first step (NaN when evaluation is off)
    final_eval: float
    session: Session  # as the steps left it: --microbatches auto's count in its plan


def _step_loop(session: Session) -> Trained | None:
    """The optimizer steps from where the checkpoints resume, with their evaluations and
    saves; None when a finished run is resumed as it was."""
    run = session.config.run
    start = session.checkpoints.resume()
    if start and start == run.steps:
        # A finished run resumed as it was: its metrics end with its own summary, which an
        # evaluation and a summary of 0 steps (and nan tokens/s) would have followed.
        session.output.say(
            f"the run is already at step {start} of {run.steps}: nothing to train "
            f"(pass a larger --steps to continue it)"
        )
        session.checkpoints.close()
        return None
    session.output.resume_from(start)
    first_eval = session.evaluate(start)
    records: list[StepRecord] = []
    done = start
    loop_started = time.perf_counter()
    profiler = open_profiler(
        session.config,
        rank=session.role.rank,
        world_size=session.role.world_size,
        device=session.device,
        schedule=session.plan.schedule,
        say=session.output.say,
    )
    probe = MicrobatchProbe(session, start)  # --microbatches auto: the first steps try counts
    for step in range(start, run.steps):
        probe.before(step)
        with profiled_step(profiler, step + 1) as ranges:  # --profile: ranges on those steps
            records.append(_step(session, step, loop_started, ranges=ranges))
        probe.after(step, records[-1].elapsed)
        done = step + 1
        if run.eval_every and done % run.eval_every == 0 and done < run.steps:
            session.evaluate(done)
        if session.checkpoints.after_step(done):
            break
    session.checkpoints.close()
    final_eval = session.evaluate(done if session.checkpoints.stopped else run.steps)
    return Trained(records, first_eval, final_eval, probe.settled())


# ----------------------------------------------------------------------------- a step


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step did, as this process measured it."""

    loss: float  # mean over the accumulated pipeline steps (and the replicas)
    tokens: int  # target tokens of the whole step, every replica's
    elapsed: float  # seconds, from the first forward to the end of the update
    timeline: Timeline  # of the last pipeline step
    bubble: float  # measured idle share; NaN when every rank ran in this one process
    outcome: StepOutcome
    stage_norms: dict[str, float | None]  # each stage's gradient norm, as the update saw it
    moe: ExpertStep | None = None  # a MoE model's aux loss and expert loads
    microbatches: int = 0  # the count the step ran (--microbatches auto changes it)


def _step(session: Session, step: int, loop_started: float, *, ranges: bool = False) -> StepRecord:
    """One optimizer step: ``grad_accum`` pipeline steps, the dp reduction, the update, and
    its report; ``ranges``: its actions run inside profiler ranges (--profile)."""
    config, pipeline, replicas = session.config, session.pipeline, session.replicas
    accum = config.optim.grad_accum
    t0 = time.perf_counter()
    losses: list[float] = []
    tokens = 0
    timeline: Timeline | None = None
    if session.experts is not None:
        session.experts.clear()  # what an evaluation or a failed pass left
    for micro in range(accum):
        inputs, targets, denominator = session.micro_batch(step * accum + micro)
        if replicas is not None:
            replicas.begin(sync=micro == accum - 1)
        result = first_step_guard(
            pipeline,
            inputs,
            targets,
            compiled=config.pipeline.compile and step == 0 and micro == 0,
            ranges=ranges,
            denominator=denominator,
            # Errors count steps as the progress does, a resumed run's included.
            label=f"training step {step + 1}"
            + (f" (accumulation {micro + 1} of {accum})" if accum > 1 else ""),
        )
        losses.append(result.loss)
        tokens += result.tokens
        timeline = result.timeline
    loss = sum(losses) / len(losses)
    if replicas is not None and session.mesh is not None:
        replicas.finish(step)
        loss, mean_tokens = replica_mean([loss, float(tokens)], session.mesh, session.device)
        tokens = round(mean_tokens * session.mesh.dp)
    moe = session.experts.collect(accum) if session.experts is not None else None
    stage_norms = gradient_report(session, step)  # per-stage norms; --grad-report's rows
    outcome = session.update.apply(step, session.grads, loss, accumulated=accum)
    if moe is not None and session.experts is not None and not outcome.skipped:
        session.experts.update_bias(moe)
    elapsed = time.perf_counter() - t0
    assert timeline is not None
    # In one process the ranks take turns: their idle time says nothing of a pipeline.
    bubble = measured_bubble(timeline) if session.role.distributed else math.nan
    record = StepRecord(
        loss, tokens, elapsed, timeline, bubble, outcome, stage_norms, moe,
        microbatches=pipeline.schedule.microbatches,
    )  # fmt: skip
    _report(session, step, record, loop_started)
    return record


def _report(session: Session, step: int, record: StepRecord, loop_started: float) -> None:
    """The step's metrics record and progress line (rank 0 only writes them)."""
    outcome = record.outcome
    tokens_per_s = record.tokens / record.elapsed if record.elapsed > 0 else math.nan
    session.output.report(
        {
            "step": step + 1,
            "loss": record.loss,
            "lr": outcome.lr,
            "grad_norm": outcome.grad_norm,
            "clip_factor": outcome.clip_factor,
            "skipped": outcome.skipped,
            "tokens": record.tokens,
            "tokens_per_s": tokens_per_s,
            "step_time_s": record.elapsed,
            "bubble": record.bubble,
            "microbatches": record.microbatches,
            "grad_norm_stage": record.stage_norms,
            **(record.moe.metrics() if record.moe is not None else {}),
        }
    )
    progress = session.output.progress
    if progress is not None:
        note = (
            f"skipped: non-finite loss or gradient ({outcome.bad_in_row} in a row)"
            if outcome.skipped
            else ""
        )
        progress.update(
            step,
            loss=record.loss,
            tokens_per_s=tokens_per_s,
            elapsed_s=time.perf_counter() - loop_started,
            note=note,
        )


# ----------------------------------------------------------------------------- the finish


def _finish(session: Session, trained: Trained, started: float) -> RunSummary | None:
    """Timeline picture, summary, data-parallel statistics and sample; the summary on rank 0."""
    config, role, mesh, say = session.config, session.role, session.mesh, session.output.say
    r = config.run
    records = trained.records
    summary = _summary(session, trained, started)
    report_memory(session)  # predicted against measured peak per process (a collective)
    if records and records[0].moe is not None:  # a MoE model: its most imbalanced layer
        moe_record, moe_line = expert_summary([m.moe for m in records if m.moe is not None])
        session.output.record(moe_record)
        say(moe_line)
    # The summary closes the run's records; before a picture or a sample that might fail.
    session.output.record(summary.to_json())
    if role.reporter:
        say(summary.format())
    replicas = session.replicas
    dp_stats = (
        replicas.stats(
            _WARMUP_STEPS,
            state_bytes=state_bytes(session.pipeline.parameters(), session.optimizer),
        )
        if replicas is not None
        else None
    )
    if dp_stats is not None:
        session.output.record(dp_stats.to_json())
        say(dp_stats.format())
    if r.timeline and role.reporter and records:
        draw_timeline(
            records[-1].timeline, r.timeline, say, taking_turns=not role.distributed, what="step"
        )
    # The replicas hold the same weights: the first one samples. Sharded, every replica
    # takes part in gathering the full weights, as every tp rank does for its slices.
    first_replica = mesh is None or mesh.dp_rank == 0
    here = first_replica and (mesh is None or mesh.tp_rank == 0)
    # Under expert parallelism the first ep group's ranks hold every expert between them.
    ep_group = session.experts.sampling_group() if session.experts is not None else None
    if r.sample_tokens and (first_replica or session.sharded or ep_group is not None):
        _sample(session, say, here=here, experts_group=ep_group)
    session.output.close()
    return summary if role.reporter else None


def _summary(session: Session, trained: Trained, started: float) -> RunSummary:
    """The run's numbers; every rank takes part in gathering the peak memory."""
    role, records = session.role, trained.records
    peaks = peak_memory_per_rank(role, session.device)
    held = per_rank(role, state_bytes(session.pipeline.parameters(), session.optimizer))
    # Timing leaves out the warm-up steps, unless there is nothing else.
    timed = records[_WARMUP_STEPS:] or records
    train_time = sum(m.elapsed for m in timed)
    # The simulator replays the schedule the run ended with, on the steps that ran it.
    count = session.pipeline.schedule.microbatches
    replayed = [m.timeline for m in timed if m.microbatches == count]
    return RunSummary(
        steps=len(records),
        wall_s=time.perf_counter() - started,
        tokens=sum(m.tokens for m in records),
        tokens_per_s=sum(m.tokens for m in timed) / train_time if train_time > 0 else math.nan,
        measured_bubble=statistics.mean(m.bubble for m in timed)
        if role.distributed and timed
        else None,
        simulated_bubble=simulated_bubble(replayed, session.plan.schedule)
        if session.config.pipeline.pp > 1
        else None,
        first_eval_loss=trained.first_eval,
        final_eval_loss=trained.final_eval,
        peak_memory=peaks,
        state_bytes=held,
        skipped_steps=sum(int(m.outcome.skipped) for m in records),
        untimed_steps=len(records) - len(timed),
        microbatches=count,
    )


def _sample(session: Session, say: Any, *, here: bool = True, experts_group: Any = None) -> None:
    """Rank 0 prints text generated by the model assembled from every stage's weights.

    ``here`` false: this process only helps gather the weights (another replica samples).
    """
    state = gather_state_dict(session.pipeline.modules, session.group, experts_group=experts_group)
    if state is None or session.corpus is None or not here:
        return
    say(sample_text(session.config, session.plan.model, state, session.corpus.tokenizer))
