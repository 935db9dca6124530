"""The trainer's configuration: frozen dataclasses, a TOML file, command-line overrides.

Every field is documented where it is declared. A config is built in three layers, each
overriding the one before: the defaults below, an optional TOML file (one table per
section: ``[model]``, ``[pipeline]``, ``[data]``, ``[optim]``, ``[run]``), and
``section.field=value`` overrides from the command line. ``load_config`` checks names,
types and the relations between fields and raises ``ConfigError`` (an ``InputError``)
with one line that names the field and the fix.

``validate`` and ``ConfigError`` live in ``pipetrain.config.checks`` and are
re-exported here.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import time
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

from pipetrain.config.checks import ConfigError, validate

__all__ = [
    "ConfigError",
    "DataConfig",
    "ModelSection",
    "OptimConfig",
    "PipelineConfig",
    "RunConfig",
    "TrainConfig",
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "parse_override",
    "settings_disagree",
    "validate",
]


@dataclass(frozen=True)
class ModelSection:
    """Which model to train."""

    # Preset of pipetrain.models (`llama-default`, `llama-tiny`, `gpt2-tiny`, ...).
    name: str = "llama-default"


@dataclass(frozen=True)
class PipelineConfig:
    """How the model is cut and scheduled."""

    # Pipeline ranks (processes). 1 trains one stage in one process through the same code.
    pp: int = 3
    # Data-parallel replicas of the pipeline: pp x dp processes, each replica reads 1/dp of
    # every batch and gradients are averaged over the replicas (pipetrain.parallel.mesh).
    dp: int = 1
    # Shard each stage's parameters, gradients and optimizer state over the dp replicas
    # (FSDP2's fully_shard; pipetrain.parallel.sharded) instead of replicating them. Needs dp > 1.
    shard: bool = False
    # Stages per rank (virtual stages): >1 only for schedules that loop over the ranks.
    chunks: int = 1
    # Schedule name from pipetrain.schedules.registry (`1f1b`, `gpipe`, `interleaved-1f1b`,
    # `zb-h1`, ...), or a synchronous schedule file ending in .csv or .json
    # (pipetrain.schedules.io; `pipetrain simulate --save` writes one), read on every rank.
    schedule: str = "1f1b"
    # Micro-batches per pipeline step; data.batch_size must be a multiple of it.
    microbatches: int = 8
    # Blocks per model stage, e.g. "4,3,5" (the embedding goes with the first stage, the
    # head with the last; `pipetrain plan` prints a balanced one). Empty: by `balance`.
    split: str = ""
    # How to split when `split` is empty: `uniform` (even blocks), `params` (even
    # parameters), `cost` (even compute time, estimated from each layer's FLOPs at
    # data.seq_len: a large vocabulary's head weighs on the last stage).
    balance: str = "uniform"
    # Run every rank inside one process (the runtime's debug mode; no process group).
    single_process: bool = False
    # `auto` picks cuda when available, else cpu; `cpu` or `cuda` force one.
    device: str = "auto"
    # `fp32`, or `bf16` autocast with fp32 master weights and fp32 reductions.
    precision: str = "fp32"
    # Recompute each block's activations in backward (torch.utils.checkpoint per block).
    recompute: bool = False
    # torch.compile each stage module.
    compile: bool = False
    # Seconds any blocking wait of the runtime may take before it fails with an error.
    timeout_s: float = 300.0
    # Torch intra-op threads per process; 0 = the machine's cores / local processes (>= 1).
    threads: int = 0
    # Asynchronous schedules (pipedream, pipedream-2bw): training steps per stream; the
    # pipeline drains only between streams. 0 = as long as evaluation and checkpoints allow.
    stream_steps: int = 0
    # PipeDream: every stage uses the weight version the first stage chose for a micro-batch.
    vertical_sync: bool = False
    # A built-in schedule splits the backwards that another rank waits for into I and W
    # and sends the input gradient between them (pipetrain.schedules.early_grads): the
    # same order of work (a W may move to the end of its rank) and gradients, a shorter
    # 1F1B cool-down and GPipe turn. False: the Bs run whole.
    early_grads: bool = True


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how batches are cut."""

    # Text file, folder of text files, or JSONL with a "text" field; "" = the Python
    # standard library's source files on this machine.
    path: str = ""
    # Optional local Hugging Face tokenizer.json ("" = bytes, vocabulary 256).
    tokenizer: str = ""
    # Sequences per pipeline step (all micro-batches together).
    batch_size: int = 32
    # Tokens per sequence.
    seq_len: int = 128
    # Share of the text held out for eval: whole documents chosen by a fixed hash of their
    # name, or the tail of the text read when too few documents make that split lopsided.
    eval_fraction: float = 0.05
    # Batches of data.batch_size sequences in each evaluation.
    eval_batches: int = 2
    # Read at most this many characters of text (the default corpus has ~30 million).
    max_bytes: int = 8_000_000


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, the learning-rate schedule, clipping, accumulation and the NaN guard."""

    # Peak learning rate, reached after the warm-up.
    lr: float = 3e-3
    # Final learning rate of the cosine decay, as a fraction of optim.lr.
    min_lr_ratio: float = 0.1
    # Optimizer steps of linear warm-up from 0 to optim.lr.
    warmup_steps: int = 10
    # AdamW decoupled weight decay; never applied to norms, biases or other 1-D tensors.
    weight_decay: float = 0.1
    # AdamW first-moment decay.
    beta1: float = 0.9
    # AdamW second-moment decay.
    beta2: float = 0.95
    # AdamW denominator epsilon.
    eps: float = 1e-8
    # Clip the gradient to this global norm over all stages; 0 disables clipping.
    grad_clip: float = 1.0
    # Pipeline steps whose gradients are summed (averaged) into one optimizer step.
    grad_accum: int = 1
    # Stop the run after this many consecutive skipped (non-finite) updates.
    max_bad_steps: int = 3


@dataclass(frozen=True)
class RunConfig:
    """Length of the run, its outputs and its logging."""

    # Optimizer steps to train.
    steps: int = 120
    # Seed of the weights and of the batch order.
    seed: int = 0
    # Run directory name under run.out_dir ("" = model-schedule-ppP-date-time-pid: the
    # process id keeps apart runs started in the same second, as a sweep's are).
    name: str = ""
    # Folder that holds the run directories.
    out_dir: str = "runs"
    # Metrics JSONL file ("" = <run dir>/metrics.jsonl).
    metrics: str = ""
    # Evaluate at the start, at the end and every run.eval_every steps; false: never
    # (`pipetrain tune` measures throughput only).
    evaluate: bool = True
    # Evaluate every this many optimizer steps (and always at the start and the end); 0 = only then.
    eval_every: int = 40
    # Write TensorBoard logs to <run dir>/tensorboard (needs the tensorboard package).
    tensorboard: bool = False
    # Draw the measured timeline of the last step into this PNG, or write it as a Chrome /
    # Perfetto trace (.json, times in microseconds, a track per rank); "" = neither.
    timeline: str = ""
    # Bytes (tokens) of text to generate from the trained model at the end; 0 = none.
    sample_tokens: int = 200
    # Sampling temperature of that text; 0 = greedy.
    sample_temperature: float = 0.8
    # Text the sample starts from.
    sample_prompt: str = "def "
    # Directory of the run's checkpoints ("" = none); every rank must see the same one.
    checkpoint_dir: str = ""
    # Save a checkpoint every this many optimizer steps (0 = only at a stop signal and the end).
    checkpoint_every: int = 0
    # Complete checkpoints kept in run.checkpoint_dir, the newest ones (0 = all).
    keep: int = 0
    # Continue from the newest valid checkpoint in run.checkpoint_dir (step 0 if there is none).
    resume: bool = False


@dataclass(frozen=True)
class TrainConfig:
    """The whole resolved configuration of a training run."""

    model: ModelSection = field(default_factory=ModelSection)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def microbatch_size(self) -> int:
        return self.data.batch_size // self.pipeline.microbatches

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    @property
    def metrics_path(self) -> Path:
        return Path(self.run.metrics) if self.run.metrics else self.run_dir / "metrics.jsonl"


# Characters a default run name (a folder under run.out_dir) must not carry over.
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")

_SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "pipeline": PipelineConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "run": RunConfig,
}


# ----------------------------------------------------------------------------- loading


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    check_paths: bool = True,
    default_name: str = "",
) -> TrainConfig:
    """Defaults, then the TOML file at ``path``, then ``overrides`` ("section.field" keys).

    Fills in a run name where none is given (``default_name``, else model-schedule-ppP-
    date-time-pid) and validates the result. ``check_paths`` also checks
    that the data and tokenizer paths exist (off for configs resolved elsewhere).
    """
    values: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    if path is not None:
        _merge_tables(values, _read_toml(Path(path)), source=str(path))
    for key, value in (overrides or {}).items():
        section, name = _split_key(key)
        values[section][name] = value
    config = TrainConfig(
        **{
            section: _build_section(section, cls, values[section])
            for section, cls in _SECTIONS.items()
        }
    )
    config = _expand_home(config)
    if not config.run.name and default_name:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, name=default_name))
    if not config.run.name:
        parts = (config.model.name, config.pipeline.schedule, f"pp{config.pipeline.pp}")
        # A bad model or schedule name is reported by its own check, not as a bad run name.
        # Two runs started in the same second (a sweep started in parallel) got one folder,
        # each replacing the other's config.toml and mixing their metrics in one file.
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        default_name = "-".join((*(_UNSAFE_NAME_CHARS.sub("_", part) for part in parts), stamp))
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, name=default_name))
    validate(config, check_paths=check_paths)
    return config


# Text fields that name files or folders: "~" in them means the home folder, as in a
# shell (a TOML file or a quoted argument does not go through one).
_PATH_FIELDS = {
    "pipeline": ("schedule",),  # a schedule file; no built-in name starts with "~"
    "data": ("path", "tokenizer"),
    "run": ("out_dir", "metrics", "timeline", "checkpoint_dir"),
}


def _expand_home(config: TrainConfig) -> TrainConfig:
    for section, names in _PATH_FIELDS.items():
        table = getattr(config, section)
        changed = {
            name: os.path.expanduser(getattr(table, name))
            for name in names
            if getattr(table, name).startswith("~")
        }
        if changed:
            config = dataclasses.replace(config, **{section: dataclasses.replace(table, **changed)})
    return config


def parse_override(text: str) -> tuple[str, Any]:
    """``"optim.lr=1e-3"`` -> ``("optim.lr", 0.001)``; values are read as TOML, else as text.

    A text field takes the text as written unless it is a quoted TOML string:
    ``run.name=2024`` is the name "2024", not the integer TOML reads.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"override {text!r} is not SECTION.FIELD=VALUE: write e.g. --set optim.lr=1e-3"
        )
    section, name = _split_key(key)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    if typing.get_type_hints(_SECTIONS[section])[name] is str and not isinstance(value, str):
        value = raw.strip()
    return key, value


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text: give the path of a TOML file to --config"
        ) from None
    except FileNotFoundError:
        raise ConfigError(
            f"config file {str(path)!r} does not exist: give the path of a TOML file to --config"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"config file {str(path)!r} cannot be read ({exc.strerror}): check --config"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not valid TOML ({exc}): fix the syntax"
        ) from None


def _merge_tables(
    values: dict[str, dict[str, Any]], table: Mapping[str, Any], *, source: str
) -> None:
    for section, content in table.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"{source}: unknown config section [{section}]{_suggest(section, _SECTIONS)}: "
                f"use one of {', '.join(f'[{s}]' for s in _SECTIONS)}"
            )
        if not isinstance(content, dict):
            raise ConfigError(
                f"{source}: '{section}' must be a table ([{section}] followed by field = value lines), "
                f"not a single value"
            )
        for name, value in content.items():
            _check_field(section, name)
            values[section][name] = value


def _split_key(key: str) -> tuple[str, str]:
    section, dot, name = key.partition(".")
    if not dot or section not in _SECTIONS:
        raise ConfigError(
            f"unknown config key {key!r}{_suggest_key(key)}: keys are SECTION.FIELD with SECTION one of "
            f"{', '.join(_SECTIONS)}"
        )
    _check_field(section, name)
    return section, name


def _check_field(section: str, name: str) -> None:
    names = [f.name for f in dataclasses.fields(_SECTIONS[section])]
    if name not in names:
        raise ConfigError(
            f"unknown config field {section}.{name}{_suggest(name, names)}: "
            f"[{section}] has {', '.join(names)}"
        )


def _suggest(word: str, choices: Sequence[str] | Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _suggest_key(key: str) -> str:
    everything = [f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]
    # A bare field name ("lr") is matched against the field part of every key.
    by_field = [k for k in everything if k.split(".")[1] == key]
    if by_field:
        return f" (did you mean '{by_field[0]}'?)"
    return _suggest(key, everything)


def _build_section(section: str, cls: type, values: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    converted = {
        name: _convert(f"{section}.{name}", hints[name], value) for name, value in values.items()
    }
    return cls(**converted)


def _convert(key: str, hint: Any, value: Any) -> Any:
    """Check ``value`` against the field type; ints are accepted where floats are expected."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for kind in allowed:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, float):
            return value
        # An int beyond a float's range (TOML ints are unbounded here) falls to the error.
        if (
            kind is float
            and isinstance(value, int)
            and not isinstance(value, bool)
            and abs(value) <= sys.float_info.max
        ):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
    expected = " or ".join(getattr(k, "__name__", str(k)) for k in allowed)
    raise ConfigError(
        f"{key} must be {_article(expected)} {expected}, got {value!r}: fix its value"
    )


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


# ----------------------------------------------------------------------------- output


def config_to_dict(config: TrainConfig) -> dict[str, dict[str, Any]]:
    """The config as nested plain values (the shape of the TOML file)."""
    return {section: dataclasses.asdict(getattr(config, section)) for section in _SECTIONS}


def config_to_toml(config: TrainConfig) -> str:
    """A TOML text that ``load_config`` reads back into an equal config."""
    lines: list[str] = []
    for section, table in config_to_dict(config).items():
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        lines.extend(f"{name} = {_toml_value(value)}" for name, value in table.items())
    return "\n".join(lines) + "\n"


# Fields that may differ between the processes of one run: what only rank 0 writes (the
# run folder, metrics, pictures) and per-machine settings. Every other field shapes the
# work that the ranks share, so a difference would hang them, or worse, train on targets
# that do not belong to the inputs (another seed) or update stages differently.
_PER_PROCESS_FIELDS = frozenset(
    {
        "run.name",
        "run.out_dir",
        "run.metrics",
        "run.tensorboard",
        "run.timeline",
        "pipeline.threads",
        "pipeline.timeout_s",
    }
)


def settings_disagree(by_rank: Sequence[Mapping[str, Mapping[str, Any]]]) -> str | None:
    """Why the processes of a run (``config_to_dict`` of each, by rank) cannot train
    together; None when their shared settings agree. Under torchrun every process resolves
    its own flags, so one node started with other flags is caught here, in one line,
    rather than as a hang or a silently wrong run."""
    differing: list[tuple[str, int, Any, Any]] = []
    first = by_rank[0]
    for section, table in first.items():
        for name, value in table.items():
            key = f"{section}.{name}"
            if key in _PER_PROCESS_FIELDS:
                continue
            for rank, other in enumerate(by_rank[1:], start=1):
                theirs = other.get(section, {}).get(name)
                if theirs != value:
                    differing.append((key, rank, value, theirs))
                    break
    if not differing:
        return None
    key, rank, value, theirs = differing[0]
    more = [d[0] for d in differing[1:]]
    also = f" (also {', '.join(more)})" if more else ""
    return (
        f"the processes of this run were started with different settings: {key} is "
        f"{value!r} on rank 0 but {theirs!r} on rank {rank}{also}: start every process "
        f"with the same --config file and flags"
    )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return _toml_string(str(value))


def _toml_string(text: str) -> str:
    """``text`` as an ASCII TOML basic string.

    Not ``json.dumps``: it writes a character beyond U+FFFF as a surrogate pair
    (``"\\ud83d\\ude00"``), which TOML refuses, so a launched run's workers could not
    read the config it saved.
    """
    out: list[str] = []
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif 0x20 <= code < 0x7F:
            out.append(char)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'
