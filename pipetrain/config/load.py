"""Loading a training config: defaults, a TOML file, ``--set`` overrides; and writing one.

A config is built in three layers, each overriding the one before: the defaults of
``pipetrain.config.schema``, an optional TOML file (one table per section: ``[model]``,
``[pipeline]``, ``[data]``, ``[optim]``, ``[run]``), and ``section.field=value``
overrides from the command line. ``load_config`` checks names and types here, each
section checks its own values as it is built, and ``validate`` the relations between
sections; each raises ``ConfigError`` with one line that names the field and the fix.
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
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

from pipetrain.config.checks import validate
from pipetrain.config.errors import ConfigError
from pipetrain.config.schema import (
    DataConfig,
    ModelSection,
    OptimConfig,
    PipelineConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "parse_override",
    "settings_disagree",
]


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


def _init_tokenizer(config: TrainConfig) -> TrainConfig:
    """A model imported with model.init_from reads text with its own tokenizer.json,
    unless data.tokenizer names another."""
    found = Path(config.model.init_from) / "tokenizer.json"
    if not config.model.init_from or config.data.tokenizer or not found.exists():
        return config
    return dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=str(found)))


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    check_paths: bool = True,
    default_name: str = "",
    notes: list[str] | None = None,
) -> TrainConfig:
    """Defaults, then the TOML file at ``path``, then ``overrides`` ("section.field" keys).

    Fills in a run name where none is given (``default_name``, else model-schedule-ppP-
    date-time-pid) and validates the result. ``check_paths`` also checks
    that the data and tokenizer paths exist (off for configs resolved elsewhere).
    A default adapted to the other values (a warm-up longer than a short run) is noted,
    in one line each, in ``notes``.
    """
    values: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    if path is not None:
        _merge_tables(values, _read_toml(Path(path)), source=str(path))
    for key, value in (overrides or {}).items():
        section, name = _split_key(key)
        name, value = _auto_field(section, name, value)
        values[section][name] = value
    _fit_default_warmup(values, notes)
    # Every type is checked before any section checks its values as it is built, so an
    # input with both reports the wrong type.
    converted = {
        section: _convert_section(section, cls, values[section])
        for section, cls in _SECTIONS.items()
    }
    config = TrainConfig(
        **{section: cls(**converted[section]) for section, cls in _SECTIONS.items()}
    )
    config = _expand_home(config)
    config = _init_tokenizer(config)
    if not config.run.name and default_name:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, name=default_name))
    if not config.run.name:
        model = Path(config.model.init_from).name if config.model.init_from else config.model.name
        parts = (model, config.pipeline.schedule, f"pp{config.pipeline.pp}")
        # A bad model or schedule name is reported by its own check, not as a bad run name.
        # Two runs started in the same second (a sweep started in parallel) got one folder,
        # each replacing the other's config.toml and mixing their metrics in one file.
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        default_name = "-".join((*(_UNSAFE_NAME_CHARS.sub("_", part) for part in parts), stamp))
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, name=default_name))
    config = _fit_auto_start(config, notes)
    validate(config, check_paths=check_paths)
    return config


def _fit_auto_start(config: TrainConfig, notes: list[str] | None) -> TrainConfig:
    """Under pipeline.microbatches_auto the count is where the probe starts, not a
    request: one that does not divide the per-replica batch (the default 8 of a batch of
    4) starts from the largest that does, noted."""
    p, batch = config.pipeline, config.data.batch_size
    if not p.microbatches_auto or batch % p.dp or (batch // p.dp) % p.microbatches == 0:
        return config  # a batch that dp does not split is validate's to report
    rows = batch // p.dp
    start = max(n for n in range(1, min(rows, p.microbatches) + 1) if rows % n == 0)
    if notes is not None:
        notes.append(
            f"note: --microbatches auto starts from {start} micro-batches: "
            f"{p.microbatches} does not divide the per-replica batch of {rows}"
        )
    return dataclasses.replace(config, pipeline=dataclasses.replace(p, microbatches=start))


def _fit_default_warmup(values: dict[str, dict[str, Any]], notes: list[str] | None) -> None:
    """A default warm-up as long as the run (``--steps 5``) becomes a tenth of it, noted.

    Only the default: a warm-up given in the file or by ``--set`` that leaves no step
    after it stays an error (``checks._check_warmup``), as the user asked for it.
    """
    if "warmup_steps" in values["optim"]:
        return
    steps = values["run"].get("steps", RunConfig.steps)
    default = OptimConfig.warmup_steps
    # A wrong type or a bad step count is reported by its own check.
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= default:
        return
    values["optim"]["warmup_steps"] = steps // 10
    if notes is not None:
        notes.append(
            f"note: the default warm-up of {default} steps does not fit a {steps}-step run: "
            f"warming up for {steps // 10} (--set optim.warmup_steps=N to choose)"
        )


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
            name, value = _auto_field(section, name, value)
            values[section][name] = value


def _auto_field(section: str, name: str, value: Any) -> tuple[str, Any]:
    """pipeline.microbatches = "auto" (in a file, by --set or --microbatches auto) is the
    switch pipeline.microbatches_auto: the count, where the probe starts, stays an int
    that every reader of the field can use, and the config saved holds both."""
    if (section, name, value) == ("pipeline", "microbatches", "auto"):
        return "microbatches_auto", True
    return name, value


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


def _convert_section(section: str, cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {
        name: _convert(f"{section}.{name}", hints[name], value) for name, value in values.items()
    }


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
