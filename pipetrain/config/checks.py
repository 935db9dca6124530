"""The checks of a whole training config: values of different sections that contradict
each other, and the files and folders the run reads and writes on this machine.

Each section checks its own fields when it is built (``pipetrain.config.schema``);
``load_config`` (``pipetrain.config.load``) calls ``validate`` on the assembled config.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipetrain.config.errors import ConfigError
from pipetrain.config.schema import TrainConfig
from pipetrain.config.values import run_name_error

__all__ = ["ConfigError", "validate"]

# Files of one checkpoint (pipetrain.checkpoint.manifest's MANIFEST_NAME and
# COMPLETE_MARKER, named here because importing that package imports torch).
_CHECKPOINT_FILES = ("manifest.json", "COMPLETE")


def validate(config: TrainConfig, *, check_paths: bool = True) -> None:
    """Raise ``ConfigError`` for the first value that contradicts one of another section.

    ``check_paths`` also checks what the run reads and writes on this machine.
    """
    if not config.run.name:
        # load_config names every run; a config assembled without one has no folder.
        raise ConfigError(run_name_error(config.run.name))
    _check_batches(config)
    if check_paths:
        _check_inputs(config)
    _check_warmup(config)
    if check_paths:
        _check_outputs(config)


def _check_batches(config: TrainConfig) -> None:
    """A batch splits into equal micro-batches, on every data-parallel replica."""
    p, d = config.pipeline, config.data
    if p.dp > 1 and d.batch_size % (p.dp * p.microbatches):
        raise ConfigError(
            f"data.batch_size {d.batch_size} does not split into pipeline.dp {p.dp} replicas of "
            f"pipeline.microbatches {p.microbatches} equal micro-batches: use a batch size like "
            f"{_multiple_near(d.batch_size, p.dp * p.microbatches)}"
        )
    if d.batch_size % p.microbatches:
        raise ConfigError(
            f"data.batch_size {d.batch_size} is not a multiple of pipeline.microbatches {p.microbatches}: "
            f"use a batch size like {_multiple_near(d.batch_size, p.microbatches)} or fewer micro-batches"
        )


def _check_warmup(config: TrainConfig) -> None:
    o, r = config.optim, config.run
    if o.warmup_steps >= r.steps:
        raise ConfigError(
            f"optim.warmup_steps {o.warmup_steps} leaves no step after the warm-up of a "
            f"{r.steps}-step run: use fewer warm-up steps than run.steps "
            f"(--set optim.warmup_steps={r.steps - 1}) or more --steps"
        )


def _check_inputs(config: TrainConfig) -> None:
    """Files the run reads, checked on this machine."""
    d = config.data
    if d.path and not Path(d.path).exists():
        raise ConfigError(
            f"data.path {d.path!r} does not exist: give a text file, a folder of text files or a "
            f".jsonl file, or leave it empty for the built-in corpus"
        )
    if d.tokenizer and not Path(d.tokenizer).is_file():
        raise ConfigError(
            f"data.tokenizer {d.tokenizer!r} is not a file: give the path of a tokenizer.json"
        )


def _check_outputs(config: TrainConfig) -> None:
    """Folders the run writes into, checked now rather than when the run first writes there.

    A checkpoint directory that is a file would otherwise fail only at the first save,
    after the steps before it were trained; a timeline's folder only after the last step.
    """
    r = config.run
    if config.run_dir.exists() and not config.run_dir.is_dir():
        raise ConfigError(
            f"run.name {r.name!r}: {str(config.run_dir)!r} is a file, not a run folder: "
            f"pass another --name"
        )
    _writable_folder("run.out_dir", config.run_dir, "--set run.out_dir=DIR")
    if r.checkpoint_dir:
        folder = Path(r.checkpoint_dir)
        _writable_folder("run.checkpoint_dir", folder, "--checkpoint-dir DIR")
        if any((folder / name).is_file() for name in _CHECKPOINT_FILES):
            # Given one checkpoint (ck/step_000020), --resume found none inside it, started
            # from step 0 and saved new checkpoints inside the old one.
            raise ConfigError(
                f"run.checkpoint_dir {r.checkpoint_dir!r} is one checkpoint, not a folder of "
                f"them: pass the folder that holds it, --checkpoint-dir {str(folder.parent)!r}"
            )
    if r.timeline:
        folder = Path(r.timeline).parent
        if not folder.is_dir():
            raise ConfigError(
                f"run.timeline {r.timeline!r}: folder {str(folder)!r} does not exist: create it "
                f"or pick another --timeline path"
            )
        if Path(r.timeline).is_dir():
            # Found only when the picture is drawn, after the last step: the run's summary
            # and sample were lost to the error.
            raise ConfigError(
                f"run.timeline {r.timeline!r} is a folder: name a .png file, e.g. "
                f"--timeline {str(Path(r.timeline) / 'step.png')!r}"
            )


def _writable_folder(key: str, path: Path, flag: str) -> None:
    """``path`` is a folder that can be written, or one that can be created."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"{key} {str(path)!r}: {str(existing)!r} is not a folder: pass another {flag}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key} {str(path)!r}: folder {str(existing)!r} is not writable: pass another {flag}"
        )


def _multiple_near(value: int, factor: int) -> int:
    return max(factor, round(value / factor) * factor)
