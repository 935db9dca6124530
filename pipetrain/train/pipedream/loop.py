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
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from typing import IO, Any

import torch
import torch.distributed as dist

from pipetrain.checkpoint import CheckpointPolicy, Layout, RunCheckpoints
from pipetrain.config import ConfigError, TrainConfig, config_to_dict
from pipetrain.models import build_full_model, model_spec
from pipetrain.runtime.timeline import simulated_bubble
from pipetrain.train.data import Batch, Corpus, eval_batches, train_batch
from pipetrain.train.metrics import (
    RunSummary,
    draw_timeline,
    measured_bubble,
)
from pipetrain.train.optim import build_optimizer, lr_at
from pipetrain.train.pipedream.plan import stream_steps_for
from pipetrain.train.pipedream.trainer import AsyncTrainer, StreamResult, predicted_versions
from pipetrain.train.plan import RunPlan
from pipetrain.train.sample import gather_state_dict, generate
from pipetrain.train.shared import open_data, open_output, peak_memory_per_rank

__all__ = ["train_async", "versions_line"]


def train_async(
    config: TrainConfig,
    role: Any,
    plan: RunPlan,
    device: torch.device,
    group: Any,
    out: IO[str],
    started: float,
) -> RunSummary | None:
    """Train as one process of an asynchronous run; the summary on rank 0 (None elsewhere)."""
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
    pipeline = trainer.pipeline
    first, last, corpus = open_data(config, pipeline, group)
    evals: list[Batch] = []
    if corpus is not None:
        evals = eval_batches(
            corpus, batch_size=d.batch_size, seq_len=d.seq_len, count=d.eval_batches
        )

    output = open_output(config, role, out)
    try:
        progress, report, say = output.progress, output.report, output.say

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

        def evaluate(step: int) -> float:
            if not r.evaluate:
                return math.nan
            batches = [
                (b.inputs if first else None, b.targets if last else None) for b in evals
            ] or [(None, None)] * d.eval_batches
            value = trainer.eval_loss(batches)
            report({"step": step, "eval_loss": value})
            say(f"eval loss after {step} steps: {value:.4f}")
            return value

        model_fields = dataclasses.asdict(plan.model)
        model_fields.pop("name")
        checkpoints = RunCheckpoints(
            CheckpointPolicy(r.checkpoint_dir, r.checkpoint_every, r.keep, r.resume),
            modules=pipeline.modules,
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
        start = checkpoints.resume()
        if start % stream:
            # A derived stream length changes with --checkpoint-every and --eval-every, so
            # the saved run's may be one the user never typed: name one that fits.
            derived = "" if p.stream_steps else " (from run.steps, eval_every, checkpoint_every)"
            raise ConfigError(
                f"the checkpoint is at step {start}, not between two streams of {stream} "
                f"steps{derived}: pass --stream-steps {math.gcd(start, stream)}, or the "
                "--checkpoint-every and --eval-every of the saved run"
            )
        if start and start == r.steps:
            # A finished run resumed as it was (as in the synchronous loop): an evaluation
            # and a summary of 0 steps would follow its own summary in the metrics.
            say(
                f"the run is already at step {start} of {r.steps}: nothing to train "
                f"(pass a larger --steps to continue it)"
            )
            checkpoints.close()
            return None
        output.resume_from(start)
        first_eval = evaluate(start)
        last_eval = first_eval
        results: list[StreamResult] = []
        done = start
        # The progress line's ETA counts from here, as the synchronous loop's does: from the
        # process start it charged the start-up and first evaluation to every step.
        loop_started = time.perf_counter()
        for begin in range(start, r.steps, stream):
            batches = (
                [
                    train_batch(
                        corpus, step, seed=r.seed, batch_size=d.batch_size, seq_len=d.seq_len
                    )
                    for step in range(begin, begin + stream)
                ]
                if corpus is not None
                else []
            )
            inputs = torch.cat([b.inputs for b in batches]) if first and batches else None
            targets = torch.cat([b.targets for b in batches]) if last and batches else None
            before = time.perf_counter() - loop_started
            result = trainer.train_stream(begin, inputs, targets)
            results.append(result)
            bubble = measured_bubble(result.timeline) if role.distributed else math.nan
            tokens_per_s = result.tokens / result.wall_s if result.wall_s > 0 else math.nan
            for i, loss in enumerate(result.losses):
                step = begin + i
                report(
                    {
                        "step": step + 1,
                        "loss": loss,
                        "lr": lr_at(step, config.optim, r.steps),
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
            done = begin + stream
            if r.eval_every and done % r.eval_every == 0 and done < r.steps:
                last_eval = evaluate(done)
            if checkpoints.after_step(done):
                break
        checkpoints.close()
        last_eval = evaluate(done)

        measured = trainer.rank_peaks()
        predicted = predicted_versions(p.schedule, p.pp, p.microbatches, stream)
        say(versions_line(p.schedule, measured, predicted, vertical_sync=p.vertical_sync))
        report({"weight_versions": list(measured), "predicted_weight_versions": list(predicted)})
        summary = _summary(
            results,
            trainer,
            steps=done - start,
            wall_s=time.perf_counter() - started,
            distributed=role.distributed,
            first_eval_loss=first_eval,
            final_eval_loss=last_eval,
            peak_memory=peak_memory_per_rank(role, device),
        )
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
            _sample(config, plan, trainer, group, corpus, say)
        output.record(summary.to_json())
        return summary if role.reporter else None
    finally:
        output.close()  # also when the run fails: TensorBoard buffers its events


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


def _summary(
    results: list[StreamResult],
    trainer: AsyncTrainer,
    *,
    steps: int,
    wall_s: float,
    distributed: bool,
    first_eval_loss: float,
    final_eval_loss: float,
    peak_memory: tuple[int, ...],
) -> RunSummary:
    """The run's numbers, timed as a synchronous run's are: after the first stream (its
    warm-up), unless there is no other. ``steps`` are those this session trained."""
    timed = results[1:] or results
    train_time = sum(r.wall_s for r in timed)
    pipelined = trainer.pipeline.schedule.num_ranks > 1
    return RunSummary(
        steps=steps,
        wall_s=wall_s,
        tokens=sum(r.tokens for r in results),
        tokens_per_s=sum(r.tokens for r in timed) / train_time if train_time > 0 else math.nan,
        measured_bubble=statistics.mean(measured_bubble(r.timeline) for r in timed)
        if distributed and timed
        else None,
        simulated_bubble=simulated_bubble([r.timeline for r in timed], trainer.pipeline.schedule)
        if pipelined
        else None,
        first_eval_loss=first_eval_loss,
        final_eval_loss=final_eval_loss,
        peak_memory=peak_memory,
        skipped_steps=0,
        untimed_steps=sum(len(r.losses) for r in results) - sum(len(r.losses) for r in timed),
    )


def _sample(
    config: TrainConfig,
    plan: RunPlan,
    trainer: AsyncTrainer,
    group: Any,
    corpus: Corpus | None,
    say: Any,
) -> None:
    """Rank 0 prints text from the model assembled from every stage's newest weights."""
    state = gather_state_dict(trainer.pipeline.modules, group)
    if state is None or corpus is None:
        return
    r = config.run
    model = build_full_model(model_spec(plan.model), seed=r.seed, device="cpu")
    model.load_state_dict(state)
    model.eval()
    ids = generate(
        model,
        corpus.tokenizer.encode(r.sample_prompt),
        new_tokens=r.sample_tokens,
        context=min(plan.model.max_seq_len, config.data.seq_len),
        temperature=r.sample_temperature,
        seed=r.seed,
    )
    say(
        f"sample (temperature {r.sample_temperature}):\n{r.sample_prompt}{corpus.tokenizer.decode(ids)}\n"
    )
