"""``--microbatches auto`` before the run: the counts it tries, and the one it keeps.

The counts are the divisors of the per-replica batch (``data.batch_size / pipeline.dp``)
that the schedule accepts, nearest to the configured ``pipeline.microbatches`` first: each
is prepared as the run prepares its own (``pipetrain.train.plan``'s checks, early input
gradients included), so a count the schedule refuses (fewer micro-batches than ranks for
1F1B, a count interleaving cannot spread over its chunks) is never tried, and no rule is
written twice. What cannot choose is refused here, before any process starts, in one line.
The probing itself, during the first steps, is ``pipetrain.train.microbatch_probe``.

No torch here: ``plan_run`` calls it in the launcher.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from pipetrain.config.schema import ConfigError, TrainConfig
from pipetrain.schedules.prepare import PreparedSchedule, is_schedule_file

__all__ = ["MOST_COUNTS", "STEPS_EACH", "auto_candidates", "choose", "nearest_counts"]

# At most this many counts are tried (the configured one among them), each for STEPS_EACH
# real optimizer steps; the faster of a count's steps is its time, which leaves out the
# first step after a switch (new shapes: the allocator's and the transport's first look).
MOST_COUNTS = 5
STEPS_EACH = 2

_KEY = "pipeline.microbatches_auto (--microbatches auto)"


def nearest_counts(start: int, counts: Sequence[int], most: int = MOST_COUNTS) -> list[int]:
    """``counts`` ordered by distance from ``start`` on a log scale (2 and 8 are as far
    from 4), the smaller first on a tie; ``most`` of them at most when ``most`` > 0."""
    ordered = sorted(counts, key=lambda c: (abs(math.log(c / start)), c))
    return ordered[:most] if most > 0 else ordered


def choose(times: Mapping[int, float], start: int) -> int:
    """The count with the shortest step time; on a tie the configured ``start``, then the
    fewer micro-batches (the fewer messages)."""
    return min(times, key=lambda m: (times[m], m != start, m))


def auto_candidates(
    config: TrainConfig,
    prepared: PreparedSchedule,
    prepare: Callable[[TrainConfig], PreparedSchedule],
) -> tuple[PreparedSchedule, ...]:
    """The schedules ``--microbatches auto`` tries, the configured one (``prepared``)
    first, the others by count; ``prepare`` is the run's own preparation of a config
    (raising ``ConfigError`` for a count it refuses). Raises ``ConfigError`` where there
    is nothing to choose."""
    p, d = config.pipeline, config.data
    _refuse_fixed(config, prepared)
    per_replica = d.batch_size // p.dp
    found: dict[int, PreparedSchedule] = {prepared.schedule.microbatches: prepared}
    divisors = [n for n in range(1, per_replica + 1) if per_replica % n == 0]
    for count in nearest_counts(p.microbatches, divisors, most=0):
        if len(found) == MOST_COUNTS:
            break
        try:
            candidate = prepare(
                dataclasses.replace(config, pipeline=dataclasses.replace(p, microbatches=count))
            )
        except ConfigError:
            continue  # the schedule's rules refuse this count
        # A whole-batch schedule (naive) runs 1 micro-batch whatever the count asked.
        found.setdefault(candidate.schedule.microbatches, candidate)
    if len(found) < 2:
        raise ConfigError(_only_one(config, per_replica, prepared.schedule.microbatches))
    first = prepared.schedule.microbatches
    return (prepared, *(found[m] for m in sorted(found) if m != first))


def _refuse_fixed(config: TrainConfig, prepared: PreparedSchedule) -> None:
    """Settings whose micro-batch count cannot change, or whose timings would mislead."""
    p = config.pipeline
    if is_schedule_file(p.schedule):
        raise ConfigError(
            f"{_KEY}: the schedule file {p.schedule!r} fixes its "
            f"{prepared.schedule.microbatches} micro-batches: name a built-in schedule or "
            f"give --microbatches {prepared.schedule.microbatches}"
        )
    if prepared.schedule.asynchronous:
        raise ConfigError(
            f"{_KEY}: {p.schedule} is asynchronous (its weight versions and streams are laid "
            f"out for one count): give a fixed --microbatches"
        )
    if p.compile:
        raise ConfigError(
            f"{_KEY}: torch.compile compiles each stage again for every micro-batch size tried, "
            f"and the probe would time the compilations: drop --compile or give a fixed "
            f"--microbatches"
        )


def _only_one(config: TrainConfig, per_replica: int, count: int) -> str:
    p = config.pipeline
    if count == 1 and per_replica > 1:
        return (
            f"{_KEY}: schedule {p.schedule} runs the whole batch as 1 micro-batch: nothing "
            f"to choose; drop --microbatches auto or pick another --schedule"
        )
    if per_replica == 1:
        return (
            f"{_KEY}: the per-replica batch of 1 sample (data.batch_size "
            f"{config.data.batch_size} over pipeline.dp {p.dp}) allows only 1 micro-batch: "
            f"use a larger --batch-size or drop --microbatches auto"
        )
    return (
        f"{_KEY}: schedule {p.schedule} on {p.pp} ranks takes only {count} micro-batch"
        f"{'' if count == 1 else 'es'} of a per-replica batch of {per_replica}: nothing to "
        f"choose; give --microbatches {count}, a larger --batch-size or another --schedule"
    )
