"""``pipetrain train --schedule pipedream`` (or ``pipedream-2bw``): the asynchronous run.

``pipetrain.train.loop`` hands a run over here when its schedule is asynchronous. The run
is a sequence of streams (``pipetrain.train.pipedream.trainer``): one ``train_stream`` call
trains ``stream_steps`` steps without a flush, and evaluation, logging of the steps'
losses, checkpoints and the stop signal are handled between streams, where the pipeline
is drained. The data, the optimizer (AdamW with the warm-up and cosine learning rate of
the config, per STEP by the step its micro-batch belongs to), the metrics records and the
summary are those of a synchronous run, so runs of both kinds compare line by line. Not
here: gradient clipping and the NaN guard (a global decision per STEP would be a
collective after every backward); recompute, compile and bf16 are refused by the plan.

``train_async`` reads like the synchronous ``train``: ``_set_up`` (the trainer, data,
output and checkpoints), ``_stream_loop`` (the streams, with evaluations and saves
between them) and ``_finish`` (weight versions, summary, pictures and sample).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist

from pipetrain.checkpoint import CheckpointPolicy, Layout, RunCheckpoints
from pipetrain.config import ConfigError, TrainConfig, config_to_dict
from pipetrain.data import Batch, Corpus, eval_batches, train_batch
from pipetrain.launch.role import ProcessRole
from pipetrain.models import model_spec
from pipetrain.runtime.timeline import simulated_bubble
from pipetrain.train.metrics import (
    RunOutput,
    RunSummary,
    draw_timeline,
    measured_bubble,
)
from pipetrain.train.optim import build_optimizer, lr_at
from pipetrain.train.pipedream.plan import stream_steps_for
from pipetrain.train.pipedream.trainer import AsyncTrainer, StreamResult, predicted_versions
from pipetrain.train.plan import RunPlan
from pipetrain.train.sample import gather_state_dict, sample_text
from pipetrain.train.shared import open_data, open_output, peak_memory_per_rank

__all__ = ["train_async", "versions_line"]


def train_async(
    config: TrainConfig,
    role: ProcessRole,
    plan: RunPlan,
    device: torch.device,
    group: Any,
    out: IO[str],
    started: float,
) -> RunSummary | None:
    """Train as one process of an asynchronous run; the summary on rank 0 (None elsewhere)."""
    session = _set_up(config, role, plan, device, group, out)
    try:
        streamed = _stream_loop(session)
        return None if streamed is None else _finish(session, streamed, started)
    finally:
        session.output.close()  # also when the run fails: TensorBoard buffers its events


# ----------------------------------------------------------------------------- set-up


@dataclass(frozen=True)
class StreamSession:
    """One process's asynchronous run, set up: what every stream and evaluation works with."""

    config: TrainConfig
    role: ProcessRole
    plan: RunPlan
    device: torch.device
    group: Any  # the pipeline group; None in one process
    trainer: AsyncTrainer
    stream: int  # steps per stream
    # Whether this process holds a first stage (feeds inputs) and a last one (targets).
    first: bool
    last: bool
    # The data, on processes that hold a first or last stage only.
    corpus: Corpus | None
    evals: list[Batch]
    output: RunOutput
    checkpoints: RunCheckpoints

    def batches(self, begin: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(inputs, targets) of the stream that starts at step ``begin``, its steps'
        batches one after the other: inputs on a first stage, targets on a last one."""
        d, r = self.config.data, self.config.run
        batches = (
            [
                train_batch(
                    self.corpus, step, seed=r.seed, batch_size=d.batch_size, seq_len=d.seq_len
                )
                for step in range(begin, begin + self.stream)
            ]
            if self.corpus is not None
            else []
        )
        inputs = torch.cat([b.inputs for b in batches]) if self.first and batches else None
        targets = torch.cat([b.targets for b in batches]) if self.last and batches else None
        return inputs, targets

    def evaluate(self, step: int) -> float:
        """The held-out loss, known on every rank and reported; NaN when evaluation is off."""
        d, r = self.config.data, self.config.run
        if not r.evaluate:
            return math.nan
        batches = [
            (b.inputs if self.first else None, b.targets if self.last else None) for b in self.evals
        ] or [(None, None)] * d.eval_batches
        value = self.trainer.eval_loss(batches)
        self.output.report({"step": step, "eval_loss": value})
        self.output.say(f"eval loss after {step} steps: {value:.4f}")
        return value


def _set_up(
    config: TrainConfig,
    role: ProcessRole,
    plan: RunPlan,
    device: torch.device,
    group: Any,
    out: IO[str],
) -> StreamSession:
    """Build this process's part of the run: the trainer, the data, the output and the
    checkpoints (the output is closed again if what follows it fails)."""
    p, d, r = config.pipeline, config.data, config.run
    stream = stream_steps_for(config)
    trainer = AsyncTrainer(
        model_spec(plan.model),
        schedule=p.schedule,
        pp=p.pp,
        microbatches=p.microbatches,
        stream_steps=stream,
        make_optimizer=lambda named: build_optimizer(named, config.optim),
        lr_at=lambda step: lr_at(step, config.optim, r.steps),
        vertical_sync=p.vertical_sync,
        group=group,
        device=device,
        seed=r.seed,
        split=plan.split,
        timeout_s=p.timeout_s,
    )
    first, last, corpus = open_data(config, trainer.pipeline, group)
    evals: list[Batch] = []
    if corpus is not None:
        evals = eval_batches(
            corpus, batch_size=d.batch_size, seq_len=d.seq_len, count=d.eval_batches
        )
    output = open_output(config, role, out)
    try:
        _describe(config, plan, device, stream, corpus, output.say)
        checkpoints = _checkpoints(config, plan, trainer, group, device, output.say)
    except BaseException:
        output.close()
        raise
    return StreamSession(
        config=config,
        role=role,
        plan=plan,
        device=device,
        group=group,
        trainer=trainer,
        stream=stream,
        first=first,
        last=last,
        corpus=corpus,
        evals=evals,
        output=output,
        checkpoints=checkpoints,
    )


def _describe(
    config: TrainConfig,
    plan: RunPlan,
    device: torch.device,
    stream: int,
    corpus: Corpus | None,
    say: Callable[[str], None],
) -> None:
    """The data, the model and the streams, in the run's first lines."""
    p, r = config.pipeline, config.run
    if corpus is not None:
        say(f"data: {corpus.description}")
    say(
        f"model {plan.model.name}: {plan.model.n_layers} blocks; schedule {p.schedule}"
        f"{' with vertical sync' if p.vertical_sync else ''} on {p.pp} ranks, streams of "
        f"{stream} steps x {p.microbatches} micro-batches (the pipeline drains between "
        f"streams), device {device}"
    )
    if r.checkpoint_dir and stream == r.steps and r.steps > 1:
        # A stop signal (SIGTERM, Ctrl-C) is obeyed between streams only, and the
        # launcher kills the ranks 30 s after it: here that would lose the whole run.
        say(
            "note: one stream is the whole run, so a stop signal would save nothing before "
            "the end; --checkpoint-every K (or --stream-steps K) makes streams of K steps "
            "to stop and save between"
        )


def _checkpoints(
    config: TrainConfig,
    plan: RunPlan,
    trainer: AsyncTrainer,
    group: Any,
    device: torch.device,
    say: Callable[[str], None],
) -> RunCheckpoints:
    """Saving, resuming and the stop signal, over the pipeline's processes."""
    p, r = config.pipeline, config.run
    model_fields = dataclasses.asdict(plan.model)
    model_fields.pop("name")
    return RunCheckpoints(
        CheckpointPolicy(r.checkpoint_dir, r.checkpoint_every, r.keep, r.resume, r.stop_grace_s),
        modules=trainer.pipeline.modules,
        optimizer=trainer.optimizer,
        model=model_fields,
        layout=Layout(
            p.pp, p.chunks, p.schedule, dist.get_world_size(group) if group else 1, plan.split
        ),
        config=config_to_dict(config),
        total_steps=r.steps,
        group=group,
        device=device,
        say=say,
        # Saved between streams, where nothing is in flight (a drain at save time): the
        # weights, the optimizer state and the step are all there is.
        state=lambda done: {"step": done, "data_position": done},
    )


# ----------------------------------------------------------------------------- the streams


@dataclass(frozen=True)
class Streamed:
    """What the stream loop leaves to the finish."""

    results: list[StreamResult]  # one per stream this session trained
    start: int  # the step the session resumed from (0 for a new run)
    done: int  # steps done when the loop ended (a stop signal ends it early)
    first_eval: float  # before the first stream (NaN when evaluation is off)
    final_eval: float


def _stream_loop(session: StreamSession) -> Streamed | None:
    """The streams from where the checkpoints resume, with evaluations and saves between
    them; None when a finished run is resumed as it was."""
    r, stream, checkpoints = session.config.run, session.stream, session.checkpoints
    start = _resume(session)
    if start and start == r.steps:
        # A finished run resumed as it was (as in the synchronous loop): an evaluation
        # and a summary of 0 steps would follow its own summary in the metrics.
        session.output.say(
            f"the run is already at step {start} of {r.steps}: nothing to train "
            f"(pass a larger --steps to continue it)"
        )
        checkpoints.close()
        return None
    session.output.resume_from(start)
    first_eval = session.evaluate(start)
    results: list[StreamResult] = []
    done = start
    # The progress line's ETA counts from here, as the synchronous loop's does: from the
    # process start it charged the start-up and first evaluation to every step.
    loop_started = time.perf_counter()
    for begin in range(start, r.steps, stream):
        inputs, targets = session.batches(begin)
        before = time.perf_counter() - loop_started
        result = session.trainer.train_stream(begin, inputs, targets)
        results.append(result)
        _report(session, begin, result, before)
        done = begin + stream
        if r.eval_every and done % r.eval_every == 0 and done < r.steps:
            session.evaluate(done)
        if checkpoints.after_step(done):
            break
    checkpoints.close()
    final_eval = session.evaluate(done)
    return Streamed(results, start, done, first_eval, final_eval)


def _resume(session: StreamSession) -> int:
    """The step the checkpoints resume from, which must be between two streams."""
    stream = session.stream
    start = session.checkpoints.resume()
    if start % stream:
        # A derived stream length changes with --checkpoint-every and --eval-every, so
        # the saved run's may be one the user never typed: name one that fits.
        derived = (
            ""
            if session.config.pipeline.stream_steps
            else " (from run.steps, eval_every, checkpoint_every)"
        )
        raise ConfigError(
            f"the checkpoint is at step {start}, not between two streams of {stream} "
            f"steps{derived}: pass --stream-steps {math.gcd(start, stream)}, or the "
            "--checkpoint-every and --eval-every of the saved run"
        )
    return start


def _report(session: StreamSession, begin: int, result: StreamResult, before: float) -> None:
    """Each step's metrics record and progress line of a stream that started at step
    ``begin``, ``before`` seconds into the loop (rank 0 only writes them)."""
    config, stream, progress = session.config, session.stream, session.output.progress
    bubble = measured_bubble(result.timeline) if session.role.distributed else math.nan
    tokens_per_s = result.tokens / result.wall_s if result.wall_s > 0 else math.nan
    for i, loss in enumerate(result.losses):
        step = begin + i
        session.output.report(
            {
                "step": step + 1,
                "loss": loss,
                "lr": lr_at(step, config.optim, config.run.steps),
                "tokens": result.tokens // stream,
                "tokens_per_s": tokens_per_s,
                "step_time_s": result.wall_s / stream,
                "bubble": bubble,  # of the whole stream, the unit that is timed
            }
        )
        if progress is not None:
            # The stream's steps finish together; spread its time over them so the
            # ETA of its first step does not charge it the whole stream.
            progress.update(
                step,
                loss=loss,
                tokens_per_s=tokens_per_s,
                elapsed_s=before + result.wall_s * (i + 1) / stream,
            )


# ----------------------------------------------------------------------------- the finish


def _finish(session: StreamSession, streamed: Streamed, started: float) -> RunSummary | None:
    """Weight versions, timeline picture, summary and sample; the summary on rank 0."""
    config, role, trainer, say = session.config, session.role, session.trainer, session.output.say
    p, r = config.pipeline, config.run
    results, done, stream = streamed.results, streamed.done, session.stream
    measured = trainer.rank_peaks()
    predicted = predicted_versions(p.schedule, p.pp, p.microbatches, stream)
    say(versions_line(p.schedule, measured, predicted, vertical_sync=p.vertical_sync))
    session.output.report(
        {"weight_versions": list(measured), "predicted_weight_versions": list(predicted)}
    )
    summary = _summary(session, streamed, started)
    if r.timeline and role.reporter and results:
        draw_timeline(
            results[-1].timeline,
            r.timeline,
            say,
            taking_turns=not role.distributed,
            what=f"stream (steps {done - stream + 1}-{done})",
        )
    if role.reporter:
        say(summary.format())
    if r.sample_tokens:
        # Rank 0 prints text from the model assembled from every stage's newest weights.
        state = gather_state_dict(trainer.pipeline.modules, session.group)
        if state is not None and session.corpus is not None:
            say(sample_text(config, session.plan.model, state, session.corpus.tokenizer))
    session.output.record(summary.to_json())
    return summary if role.reporter else None


def _summary(session: StreamSession, streamed: Streamed, started: float) -> RunSummary:
    """The run's numbers, timed as a synchronous run's are: after the first stream (its
    warm-up), unless there is no other; every rank takes part in gathering the peak memory."""
    results, schedule = streamed.results, session.trainer.pipeline.schedule
    distributed = session.role.distributed
    wall_s = time.perf_counter() - started
    peak_memory = peak_memory_per_rank(session.role, session.device)
    timed = results[1:] or results
    train_time = sum(r.wall_s for r in timed)
    return RunSummary(
        steps=streamed.done - streamed.start,  # those this session trained
        wall_s=wall_s,
        tokens=sum(r.tokens for r in results),
        tokens_per_s=sum(r.tokens for r in timed) / train_time if train_time > 0 else math.nan,
        measured_bubble=statistics.mean(measured_bubble(r.timeline) for r in timed)
        if distributed and timed
        else None,
        simulated_bubble=simulated_bubble([r.timeline for r in timed], schedule)
        if schedule.num_ranks > 1
        else None,
        first_eval_loss=streamed.first_eval,
        final_eval_loss=streamed.final_eval,
        peak_memory=peak_memory,
        skipped_steps=0,
        untimed_steps=sum(len(r.losses) for r in results) - sum(len(r.losses) for r in timed),
    )


def versions_line(
    schedule: str, measured: Sequence[int], predicted: Sequence[int], *, vertical_sync: bool
) -> str:
    """The run's most weight versions alive per rank, next to the simulator's."""
    # Where the simulator's rule differs from the run's, say how, or its numbers read as a
    # wrong count: its forwards take the stage's newest version, while 2BW's window w takes
    # version w - 1 on every stage (two alive even on the last).
    differs = {
        "pipedream": ", which has no vertical sync" if vertical_sync else "",
        "pipedream-2bw": ", whose forwards take the newest version, not the previous window's",
    }[schedule]
    return (
        f"weight versions per rank: at most {list(measured)} alive at once "
        f"(simulator{differs}: {list(predicted)})"
    )
