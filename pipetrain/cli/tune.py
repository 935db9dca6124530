"""``pipetrain tune``: measure tokens/s and peak memory for several micro-batch counts.

    pipetrain tune --pp 2 --schedule 1f1b --microbatches 2,4,8,16 [--steps 4] [train flags]

The last step in choosing a micro-batch size: after the memory estimate of
``pipetrain plan``, run a few real steps of each candidate and keep the fastest. Each
candidate is a short ``pipetrain train`` run without evaluation, sample or checkpoints
(a train command line's --checkpoint-dir, --resume and --keep are ignored: candidates
would resume from, or save among and prune, that run's checkpoints); its tokens/s leaves
out the first step (allocations; not with --steps 1, which a note under the table says).
Candidates are named ``<name>-m<count>`` (the run name of --name, --set run.name or
--config; else ``tune-<date-time>-<process id>``, which keeps
tunings started in the same second apart) and write their metrics in their own run
folders; a --timeline picture gets the count too (``step.png``: ``step-m4.png``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipetrain.cli.errors import UsageError
from pipetrain.cli.train import add_config_flags, config_from_args, run_config
from pipetrain.config import TrainConfig, parse_override
from pipetrain.errors import InputError

__all__ = ["Candidate", "add_parser", "format_table", "parse_counts", "run"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One micro-batch count and what it measured (or why it could not run)."""

    microbatches: int
    microbatch_size: int
    tokens_per_s: float = math.nan
    peak_memory: int = 0  # bytes, the largest of the ranks
    error: str = ""
    exit_code: int = 0  # of the candidate's run; 2 is bad input
    stopped: bool = False  # by SIGINT/SIGTERM: the tuning stops with it


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tune",
        help="run a few steps per micro-batch count; tokens/s and peak memory, best marked",
        description="Run a few training steps for each micro-batch count and print tokens/s "
        "and peak memory per candidate, marking the fastest. Takes every flag of "
        "'pipetrain train'; candidates save no checkpoints and never resume, and each "
        "writes its metrics in its own run folder, <out_dir>/<name>-m<count> (--metrics "
        "does not apply); --timeline step.png draws each candidate's last step to "
        "step-m<count>.png.",
    )
    p.add_argument(
        "--microbatches",
        dest="tune_microbatches",
        default="2,4,8,16",
        metavar="M1,M2,...",
        help="micro-batch counts to try (default 2,4,8,16)",
    )
    add_config_flags(p, skip=frozenset({"--microbatches"}))
    p.set_defaults(run=run)


def parse_counts(text: str) -> list[int]:
    """``"2,4,8"`` -> ``[2, 4, 8]``; anything else is a one-line usage error."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(
            f"--microbatches {text!r} is not a list of integers: write e.g. 2,4,8,16"
        ) from None
    if not counts or any(c < 1 for c in counts):
        raise UsageError(f"--microbatches {text!r}: give positive counts, e.g. 2,4,8,16")
    return sorted(set(counts))


def _resolve(args: argparse.Namespace, count: int, stamp: str) -> TrainConfig:
    """The config of one candidate, checked as ``pipetrain train`` checks it before starting."""
    from pipetrain.data import load_tokenizer
    from pipetrain.train.plan import plan_run

    extra: dict[str, Any] = {
        "pipeline.microbatches": count,
        "run.evaluate": False,
        "run.sample_tokens": 0,
        "optim.warmup_steps": 0,
        "run.checkpoint_dir": "",
        "run.resume": False,
        "run.checkpoint_every": 0,
        "run.keep": 0,
    }
    # A config file's steps are a training run's; --steps or --set run.steps are this tuning's.
    asked = {parse_override(text)[0] for text in args.cfg_set}
    if args.cfg_steps is None and "run.steps" not in asked:
        extra["run.steps"] = 4
    config = config_from_args(args, extra, default_name=f"tune-{stamp}")
    # Each candidate is a run of its own, with its own metrics: the tuning's name gets the
    # count appended (the runs would otherwise meet in one folder and file).
    run = dataclasses.replace(config.run, name=f"{config.run.name}-m{count}", metrics="")
    if run.timeline:
        # One picture per candidate: in one file each would replace the one before.
        picture = Path(run.timeline)
        run = dataclasses.replace(
            run, timeline=str(picture.with_name(f"{picture.stem}-m{count}{picture.suffix}"))
        )
    config = dataclasses.replace(config, run=run)
    plan_run(config, vocab_size=load_tokenizer(config.data.tokenizer).vocab_size)
    return config


def _measure(count: int, config: TrainConfig) -> Candidate:
    from pipetrain.train.metrics import reset_peak_memory

    sys.stdout.write(f"--- micro-batches {count} (micro-batch size {config.microbatch_size})\n")
    sys.stdout.flush()
    # A candidate with one process trains in this one, after the earlier candidates: its
    # peak must not be theirs.
    reset_peak_memory()
    code = run_config(config)
    summary = _summary_line(config.metrics_path) if code == 0 else None
    if code == 0 and (summary is None or summary["steps"] < config.run.steps):
        # A stop signal ends a run early with status 0 (at its start: no summary at all).
        return Candidate(count, config.microbatch_size, error="stopped by a signal", stopped=True)
    if summary is None:
        return Candidate(
            count,
            config.microbatch_size,
            error=f"the run failed (exit status {code})",
            exit_code=code,
        )
    return Candidate(
        count, config.microbatch_size, float(summary["tokens_per_s"]), max(summary["peak_memory"])
    )


def _refused(refusals: dict[int, str]) -> InputError:
    """One line for candidates that were all refused: the reason, or each count's own."""
    reasons = set(refusals.values())
    if len(reasons) == 1:
        return UsageError(reasons.pop())
    each = "; ".join(f"{count}: {reason}" for count, reason in refusals.items())
    return UsageError(f"no --microbatches count can run ({each})")


def _refuse_earlier_tuning(configs: Iterable[TrainConfig]) -> None:
    """A tuning whose candidates' run folders an earlier tuning of the same --name left
    is refused before any candidate runs (one would be refused at its start, after the
    others had run, and with a train run's advice: --resume does not apply here)."""
    from pipetrain.config.run_folder import earlier_run_error

    for config in configs:
        if earlier_run_error(config) is not None:
            raise UsageError(
                f"{config.run_dir} already holds a candidate run of an earlier tuning (its "
                f"{config.metrics_path.name}): choose another --name for this tuning "
                f"(candidates are named <name>-m<count>), or move that folder away"
            )


def _summary_line(path: Any) -> dict[str, Any] | None:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        record = json.loads(line)
        if record.get("summary"):
            return dict(record)
    return None


def format_table(candidates: list[Candidate]) -> str:
    """The candidates, fastest marked with '*'."""
    ran = [c for c in candidates if not c.error and math.isfinite(c.tokens_per_s)]
    best = max(ran, key=lambda c: c.tokens_per_s) if ran else None
    lines = [f"{'micro-batches':>13}  {'size':>5}  {'tokens/s':>10}  {'peak memory':>12}"]
    for c in candidates:
        if c.error:
            said = c.error if c.stopped else f"skipped: {c.error}"
            lines.append(f"{c.microbatches:>13}  {'':>5}  {said}")
            continue
        mark = " *" if c is best else ""
        lines.append(
            f"{c.microbatches:>13}  {c.microbatch_size:>5}  {c.tokens_per_s:>10,.0f}  "
            f"{c.peak_memory / 2**20:>8,.0f} MiB{mark}"
        )
    if best is not None:
        lines.append(
            f"best: --microbatches {best.microbatches} ({best.tokens_per_s:,.0f} tokens/s)"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    counts = parse_counts(args.tune_microbatches)
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    # Every candidate is checked before any runs: a count the schedule refuses (1F1B's
    # m >= pp) is skipped like one that does not divide the batch, and a setting that no
    # count can run with is one line and exit status 2, not a table of the same error.
    configs: dict[int, TrainConfig] = {}
    refusals: dict[int, str] = {}
    for count in counts:
        try:
            configs[count] = _resolve(args, count, stamp)
        except InputError as exc:
            refusals[count] = str(exc)
    if not configs:
        raise _refused(refusals)
    _refuse_earlier_tuning(configs.values())
    candidates = _measure_all(counts, configs, refusals)
    if candidates is None:
        return 2
    sys.stdout.write(format_table(candidates) + "\n")
    if next(iter(configs.values())).run.steps == 1:
        sys.stdout.write(
            "note: with --steps 1 tokens/s times each candidate's first step, allocations "
            "included: use --steps 2 or more to leave it out\n"
        )
    if any(c.stopped for c in candidates):
        # As for 'pipetrain train', a stop asked for is not a failure.
        sys.stderr.write(
            "pipetrain tune: stopped by a signal; the counts after the stopped one did not run\n"
        )
        return 0
    return 0 if any(not c.error for c in candidates) else 1


def _measure_all(
    counts: list[int], configs: dict[int, TrainConfig], refusals: dict[int, str]
) -> list[Candidate] | None:
    """Each count's candidate, in order, until a stop signal; None after bad input."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    candidates: list[Candidate] = []
    for count in counts:
        if any(c.stopped for c in candidates):
            candidates.append(Candidate(count, 0, error="the tuning was stopped before it"))
            continue
        if count not in configs:
            candidates.append(Candidate(count, 0, error=refusals[count]))
            continue
        try:
            candidate = _measure(count, configs[count])
        except (KeyboardInterrupt, SignalException):
            # Between a run's end and the next one's start: torch's launcher left its
            # handler, which raises, in this process; before any launch, Python's.
            candidate = Candidate(count, 0, error="stopped by a signal", stopped=True)
        if candidate.exit_code == 2:
            # Bad input only the run could check (an empty corpus, say), which its ranks
            # printed: every other count would start processes only to hit it again.
            return None
        candidates.append(candidate)
    return candidates
