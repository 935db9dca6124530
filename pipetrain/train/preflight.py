"""What the launching process checks before it starts any rank: the data, the checkpoint a
``--resume`` continues from, and settings that a schedule would silently override.

``plan_run`` checks the model, schedule and split; these checks read files (the corpus,
a checkpoint's manifest), so they run once, in the process that launches the ranks, and
a problem is one line and exit status 2 there: without them every rank found it again,
each printed it after the resolved config, and torch's launcher added a log line. The
ranks keep their own checks for torchrun launches, where no launcher of ours runs; there
they decide together and the first rank of each node prints the one line
(``pipetrain.errors.on_every_rank``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipetrain.checkpoint.directory import list_checkpoints
from pipetrain.checkpoint.errors import CheckpointIncompatibleError
from pipetrain.checkpoint.load import check_model
from pipetrain.checkpoint.manifest import FORMAT_VERSION, verify_checkpoint
from pipetrain.checkpoint.trainer import past_the_end_error
from pipetrain.config.schema import ConfigError, TrainConfig
from pipetrain.data import load_corpus
from pipetrain.schedules.prepare import is_schedule_file
from pipetrain.schedules.registry import get_spec
from pipetrain.train.plan import RunPlan

__all__ = ["check_chunks_given", "checkpoint_model_fields", "preflight"]


def preflight(config: TrainConfig, plan: RunPlan) -> None:
    """The checks that read files, before any rank starts; ``InputError`` names the fix."""
    load_corpus(config.data)  # DataError: no text, not UTF-8, a JSONL line without "text"
    _check_resume(config, plan)


def checkpoint_model_fields(plan: RunPlan) -> dict[str, Any]:
    """The model as a checkpoint records it: the preset's name is a label, not a setting
    (the same weights load whatever the preset was called)."""
    fields = dataclasses.asdict(plan.model)
    fields.pop("name")
    return fields


def _check_resume(config: TrainConfig, plan: RunPlan) -> None:
    """The checkpoint a ``--resume`` would most likely continue from: the newest one whose
    manifest and file sizes check out (the ranks hash every file too, and fall back past
    a damaged one with a warning). Another model, another format or a step past the run's
    end is refused here; the ranks refuse the same again if the choice differs."""
    r = config.run
    if not (r.resume and r.checkpoint_dir):
        return
    for step, path in reversed(list_checkpoints(r.checkpoint_dir).complete):
        verification = verify_checkpoint(path, checksums=False)
        manifest = verification.manifest
        if not verification.ok or manifest is None:
            continue
        if manifest.format_version != FORMAT_VERSION:
            raise CheckpointIncompatibleError(
                f"{path} has format_version {manifest.format_version} but this pipetrain reads "
                f"version {FORMAT_VERSION}; load it with the pipetrain that wrote it"
            )
        check_model(manifest, checkpoint_model_fields(plan), path)
        if step > r.steps:
            raise past_the_end_error(path, step, r.steps)
        return


def check_chunks_given(config: TrainConfig) -> None:
    """Refuse a ``pipeline.chunks`` set by the user that the schedule would not use as
    given: ``--chunks 1`` with interleaved-1f1b ran 2 stages per rank without a word.

    Call it only when the user set the field (its default, 1, means "the schedule's")."""
    p = config.pipeline
    if is_schedule_file(p.schedule):
        return  # plan_run refuses --chunks with a file; a file fixes the stages per rank
    spec = get_spec(p.schedule)
    # As plan_run asks for it: 1 stands for "the schedule's own number".
    if spec.chunks(p.chunks if p.chunks > 1 else None) == p.chunks:
        return
    if spec.uses_chunks:
        raise ConfigError(
            f"pipeline.chunks {p.chunks}: {p.schedule} runs {spec.default_chunks} or more "
            f"stages per rank (with 1 it would be 1f1b): use --chunks {spec.default_chunks} or "
            f"more, or --schedule 1f1b"
        )
    raise ConfigError(
        f"pipeline.chunks {p.chunks}: {p.schedule} runs {spec.default_chunks} stages per rank "
        f"whatever --chunks says: drop --chunks"
    )
