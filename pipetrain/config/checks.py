"""The cross-field checks of a training config, and ``ConfigError``, the error they raise.

``pipetrain.config.schema`` declares the config and loads it; ``load_config`` calls
``validate`` on the result, and re-exports both names.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from pipetrain.errors import InputError
from pipetrain.models.config import PRESETS

if TYPE_CHECKING:  # config imports this module for ConfigError and validate
    from pipetrain.config.schema import TrainConfig

__all__ = ["ConfigError", "validate"]


class ConfigError(InputError):
    """A config value that is unknown, of the wrong type, or contradicts another one."""


_PRECISIONS = ("fp32", "bf16")
_DEVICES = ("auto", "cpu", "cuda")
_BALANCES = ("uniform", "params", "cost")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Files of one checkpoint (pipetrain.checkpoint.manifest's MANIFEST_NAME and
# COMPLETE_MARKER, named here because importing that package imports torch).
_CHECKPOINT_FILES = ("manifest.json", "COMPLETE")
_MAX_BATCH_TOKENS = 1 << 31
# Longer waits are hangs; torch's process-group timeout (a timedelta) overflows far above it.
_MAX_TIMEOUT_S = 365 * 24 * 3600.0


def validate(config: TrainConfig, *, check_paths: bool = True) -> None:
    """Raise ``ConfigError`` for the first value that is out of range or contradicts another.

    ``check_paths`` also checks what the run reads and writes on this machine.
    """
    p, d, o, r = config.pipeline, config.data, config.optim, config.run
    if config.model.name not in PRESETS:
        raise ConfigError(
            f"model.name {config.model.name!r} is not a model preset: use one of {', '.join(PRESETS)}"
        )
    _at_least("pipeline.pp", p.pp, 1)
    _at_least("pipeline.dp", p.dp, 1)
    _at_least("pipeline.chunks", p.chunks, 1)
    _at_least("pipeline.microbatches", p.microbatches, 1)
    _at_least("pipeline.threads", p.threads, 0)
    _at_least("pipeline.stream_steps", p.stream_steps, 0)
    if not p.schedule:
        raise ConfigError("pipeline.schedule is empty: name a schedule, e.g. --schedule 1f1b")
    if p.device not in _DEVICES:
        raise ConfigError(f"pipeline.device is {p.device!r}: use one of {', '.join(_DEVICES)}")
    if p.precision not in _PRECISIONS:
        raise ConfigError(f"pipeline.precision is {p.precision!r}: use fp32 or bf16")
    if p.balance not in _BALANCES:
        raise ConfigError(
            f"pipeline.balance is {p.balance!r}: use one of {', '.join(_BALANCES)} (or give "
            f"blocks per stage with --split, e.g. 4,3,5)"
        )
    if p.split and p.balance != "uniform":
        raise ConfigError(
            f"pipeline.split {p.split!r} and pipeline.balance {p.balance!r} both choose the "
            f"split: drop one of --split and --balance"
        )
    if not 0 < p.timeout_s <= _MAX_TIMEOUT_S:
        raise ConfigError(
            f"pipeline.timeout_s is {p.timeout_s}: give a positive number of seconds up to "
            f"{_MAX_TIMEOUT_S:.0f} (a year), e.g. 300"
        )
    if p.single_process and p.pp == 1:
        raise ConfigError(
            "pipeline.single_process needs several pipeline ranks to simulate: set --pp 2 or more, "
            "or drop --single-process"
        )

    _at_least("data.batch_size", d.batch_size, 1)
    _at_least("data.seq_len", d.seq_len, 1)
    if d.batch_size * (d.seq_len + 1) > _MAX_BATCH_TOKENS:
        # Batches are built as one index array: far past this, numpy fails for memory.
        raise ConfigError(
            f"data.batch_size {d.batch_size} x data.seq_len {d.seq_len} is over "
            f"{_MAX_BATCH_TOKENS:,} tokens per batch: use a smaller --batch-size (and "
            f"optim.grad_accum for a larger effective batch)"
        )
    _at_least("data.eval_batches", d.eval_batches, 1)
    _at_least("data.max_bytes", d.max_bytes, 1024)
    if p.shard and p.dp < 2:
        raise ConfigError(
            f"pipeline.shard shards each stage over data-parallel replicas but pipeline.dp is "
            f"{p.dp}: add --dp 2 (or more) or drop --shard"
        )
    if p.shard and p.compile:
        raise ConfigError(
            "pipeline.shard with pipeline.compile is not supported: drop --compile or --shard"
        )
    if p.dp > 1 and p.single_process:
        raise ConfigError(
            "pipeline.single_process runs one pipeline in one process: drop --single-process "
            "or use --dp 1"
        )
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
    if not 0.0 < d.eval_fraction <= 0.5:
        raise ConfigError(
            f"data.eval_fraction is {d.eval_fraction}: hold out a share in (0, 0.5], e.g. 0.05"
        )
    if check_paths and d.path and not Path(d.path).exists():
        raise ConfigError(
            f"data.path {d.path!r} does not exist: give a text file, a folder of text files or a "
            f".jsonl file, or leave it empty for the built-in corpus"
        )
    if check_paths and d.tokenizer and not Path(d.tokenizer).is_file():
        raise ConfigError(
            f"data.tokenizer {d.tokenizer!r} is not a file: give the path of a tokenizer.json"
        )

    if not (o.lr > 0 and math.isfinite(o.lr)):
        raise ConfigError(f"optim.lr is {o.lr}: give a positive learning rate, e.g. 3e-3")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio is {o.min_lr_ratio}: use a fraction in [0, 1]")
    _at_least("optim.warmup_steps", o.warmup_steps, 0)
    _at_least("run.steps", r.steps, 1)
    if o.warmup_steps >= r.steps:
        raise ConfigError(
            f"optim.warmup_steps {o.warmup_steps} leaves no step after the warm-up of a "
            f"{r.steps}-step run: use fewer warm-up steps than run.steps "
            f"(--set optim.warmup_steps={r.steps - 1}) or more --steps"
        )
    if o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay is {o.weight_decay}: use 0 or more")
    for name, beta in (("beta1", o.beta1), ("beta2", o.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"optim.{name} is {beta}: use a value in [0, 1), e.g. 0.9")
    if not o.eps > 0:
        raise ConfigError(f"optim.eps is {o.eps}: use a small positive number, e.g. 1e-8")
    if o.grad_clip < 0:
        raise ConfigError(
            f"optim.grad_clip is {o.grad_clip}: give a positive norm, or 0 to turn clipping off"
        )
    _at_least("optim.grad_accum", o.grad_accum, 1)
    _at_least("optim.max_bad_steps", o.max_bad_steps, 1)

    _at_least("run.seed", r.seed, 0)
    if r.seed > _MAX_SEED:
        # torch.Generator.manual_seed takes 64 bits: the sample after the last step was a
        # ValueError traceback ("Overflow when unpacking long long").
        raise ConfigError(f"run.seed is {r.seed}: use 0 to {_MAX_SEED}")
    _at_least("run.eval_every", r.eval_every, 0)
    _at_least("run.sample_tokens", r.sample_tokens, 0)
    _at_least("run.checkpoint_every", r.checkpoint_every, 0)
    _at_least("run.keep", r.keep, 0)
    if (r.resume or r.checkpoint_every or r.keep) and not r.checkpoint_dir:
        # run.keep too: without a checkpoint directory it would be ignored without a word.
        raise ConfigError(
            "run.resume, run.checkpoint_every and run.keep need run.checkpoint_dir: "
            "add --checkpoint-dir DIR"
        )
    if r.sample_tokens and not r.sample_prompt:
        # The sample is drawn after the last step: an empty prompt crashed the run there.
        raise ConfigError(
            "run.sample_prompt is empty: give text for the sample to start from, "
            "or --set run.sample_tokens=0 for no sample"
        )
    if r.sample_temperature < 0:
        raise ConfigError(
            f"run.sample_temperature is {r.sample_temperature}: use 0 (greedy) or more"
        )
    if not _RUN_NAME.match(r.name):
        raise ConfigError(
            f"run.name {r.name!r} is not a plain folder name: use letters, digits, '.', '_' and '-'"
        )
    if r.timeline and not r.timeline.endswith((".png", ".json")):
        raise ConfigError(
            f"run.timeline {r.timeline!r} must name a .png picture or a .json Chrome/Perfetto "
            f"trace, e.g. --timeline step.png"
        )
    # After the checks above, whose messages are more specific for the fields they cover.
    _check_values(config)
    if check_paths:
        _check_outputs(config)


def _check_values(config: TrainConfig) -> None:
    """NaN or infinity in any float field: a run that would diverge, hang or crash late.

    Also text that is not Unicode (bytes that are not UTF-8 in an argument reach Python
    as lone surrogates): the config saved for a launched run could not hold it.
    """
    for section in dataclasses.fields(config):
        table = getattr(config, section.name)
        for f in dataclasses.fields(table):
            value = getattr(table, f.name)
            key = f"{section.name}.{f.name}"
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key} is {value}: give a finite number (default {f.default})")
            if isinstance(value, str) and not _is_unicode(value):
                raise ConfigError(f"{key} {value!r} is not valid UTF-8 text: fix its value")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_MAX_SEED = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


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


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{key} is {value}: it must be at least {low}")


def _multiple_near(value: int, factor: int) -> int:
    return max(factor, round(value / factor) * factor)
