"""A run continued on another number of processes: the pipeline re-planned for them.

torchrun's elastic mode (``--nnodes MIN:MAX``) restarts a group on the nodes that are left
after one fails, so a run of pp x dp x tp processes may come back with fewer. With
``--resume`` it goes on there: ``fit_world`` keeps tp, keeps pp where the processes allow
(else the largest pp they divide by), gives the rest to dp, and keeps the global batch:
``data.batch_size`` rows a step, cut into micro-batches of the same size as before, so
each replica takes more of them and accumulates their gradients (4 processes as pp 2 x
dp 2 with 2 micro-batches of 2 rows each come back as pp 2 x dp 1 with 4 micro-batches of
2). Every step reads the same rows as before the restart; only the order of the sums
changes. Checkpoints are keyed by global names, so they load into the new split as they
are. Without ``--resume`` another process count stays an error (``pipetrain.train.loop._set_up``): a
new run should say what it wants. Design and measurements: docs/elastic.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipetrain.config.checks import validate
from pipetrain.config.schema import ConfigError, TrainConfig
from pipetrain.schedules.prepare import is_schedule_file

__all__ = ["Refit", "fit_world"]


@dataclass(frozen=True)
class Refit:
    """The config for the processes there are, and the line that says what changed
    (empty when nothing did)."""

    config: TrainConfig
    note: str = ""


def fit_world(config: TrainConfig, world_size: int) -> Refit:
    """``config`` re-planned for ``world_size`` processes when it continues a run
    (``run.resume``) on another number than pp x dp x tp; else ``config`` as it is."""
    p, d = config.pipeline, config.data
    if world_size == p.processes or not config.run.resume or p.single_process:
        return Refit(config)
    was = f"pp {p.pp} x dp {p.dp}{f' x tp {p.tp}' if p.tp > 1 else ''}"
    if world_size % p.tp:
        raise ConfigError(
            f"{world_size} processes were started to continue a run of {was}: tp {p.tp} "
            f"does not divide them; start a multiple of {p.tp} processes or change --tp"
        )
    if is_schedule_file(p.schedule):
        raise ConfigError(
            f"{world_size} processes were started to continue a run of {was} on the schedule "
            f"file {p.schedule!r}, which fixes its ranks: start {p.processes} processes, or "
            "resume with a schedule by name"
        )
    per_tp = world_size // p.tp
    pp = max(n for n in range(1, min(p.pp, per_tp) + 1) if per_tp % n == 0)
    dp = per_tp // pp
    # Micro-batches of as many rows as before: a replica's share of the batch grows by
    # p.dp / dp, its micro-batches with it (where the batch still splits evenly).
    rows = d.batch_size // (p.dp * p.microbatches)
    microbatches = (
        d.batch_size // (dp * rows) if d.batch_size % (dp * rows) == 0 else p.microbatches
    )
    pipeline = dataclasses.replace(
        p,
        pp=pp,
        dp=dp,
        microbatches=microbatches,
        shard=p.shard and dp > 1,
        # A split by hand names blocks per stage of the old pipeline.
        split=p.split if pp == p.pp else "",
    )
    refit = dataclasses.replace(config, pipeline=pipeline)
    validate(refit, check_paths=False)
    now = f"pp {pp} x dp {dp}{f' x tp {p.tp}' if p.tp > 1 else ''}"
    dropped = [
        text
        for text, gone in (
            ("--shard (one replica)", p.shard and not pipeline.shard),
            (f"--split {p.split} (blocks by --balance now)", p.split != pipeline.split),
        )
        if gone
    ]
    note = (
        f"elastic: {world_size} processes continue this run of {was} "
        f"({p.processes} processes): re-planned as {now}, {microbatches} micro-batches of "
        f"{d.batch_size // (dp * microbatches)} rows per replica (was {p.microbatches} of "
        f"{rows}), the same global batch of {d.batch_size} rows; the checkpoint is resharded "
        f"as it loads{'; dropped ' + ', '.join(dropped) if dropped else ''}"
    )
    return Refit(refit, note)
