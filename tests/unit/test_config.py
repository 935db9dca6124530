"""Config: defaults, TOML file, overrides, round trip, and one-line rejections."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pipetrain.config import (
    ConfigError,
    TrainConfig,
    config_to_dict,
    config_to_toml,
    load_config,
    parse_override,
    settings_disagree,
)
from pipetrain.errors import InputError


def test_defaults_are_the_main_job() -> None:
    config = load_config(overrides={"run.name": "x"})
    assert config.model.name == "llama-default"
    assert (config.pipeline.pp, config.pipeline.schedule, config.pipeline.microbatches) == (
        3,
        "1f1b",
        8,
    )
    assert (config.data.batch_size, config.data.seq_len) == (32, 128)
    assert config.microbatch_size == 4
    assert config.metrics_path == Path("runs/x/metrics.jsonl")


def test_default_run_name_names_the_run() -> None:
    name = load_config().run.name
    assert name.startswith("llama-default-1f1b-pp3-")


def test_runs_started_in_the_same_second_get_folders_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A sweep started in parallel: one folder would take both runs' config.toml and metrics.
    monkeypatch.setattr(time, "strftime", lambda *args: "20260101-120000")
    names = set()
    for pid in (4242, 4243):
        monkeypatch.setattr(os, "getpid", lambda *args, pid=pid: pid)
        names.add(load_config().run.name)
    assert names == {
        "llama-default-1f1b-pp3-20260101-120000-4242",
        "llama-default-1f1b-pp3-20260101-120000-4243",
    }


def test_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[pipeline]\npp = 2\nschedule = "gpipe"\n[optim]\nlr = 1\n[run]\nname = "a"\n')
    config = load_config(path, {"pipeline.pp": 4, "run.steps": 5, "optim.warmup_steps": 1})
    assert config.pipeline.pp == 4
    assert config.pipeline.schedule == "gpipe"
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)
    assert config.run.steps == 5


def test_toml_round_trip(tmp_path: Path) -> None:
    config = load_config(
        overrides={
            "run.name": "rt",
            "data.path": "",
            "pipeline.precision": "bf16",
            "optim.lr": 1e-4,
        }
    )
    path = tmp_path / "resolved.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config


def test_parse_override_reads_toml_values() -> None:
    assert parse_override("optim.lr=1e-3") == ("optim.lr", 0.001)
    assert parse_override("pipeline.recompute=true") == ("pipeline.recompute", True)
    assert parse_override("run.name=hello") == ("run.name", "hello")
    assert parse_override("pipeline.pp = 4") == ("pipeline.pp", 4)


def test_config_error_is_an_input_error() -> None:
    assert issubclass(ConfigError, InputError)
    assert isinstance(TrainConfig(), TrainConfig)


# Each bad input, and words its one-line message must contain (field and fix).
BAD_OVERRIDES: list[tuple[dict[str, object], tuple[str, ...]]] = [
    ({"pipeline.pp": 0}, ("pipeline.pp is 0", "at least 1")),
    ({"pipeline.chunks": 0}, ("pipeline.chunks", "at least 1")),
    ({"pipeline.microbatches": 0}, ("pipeline.microbatches", "at least 1")),
    (
        {"pipeline.microbatches": 5},
        ("data.batch_size 32", "multiple of pipeline.microbatches 5", "30"),
    ),
    ({"pipeline.device": "tpu"}, ("pipeline.device", "auto, cpu, cuda")),
    ({"pipeline.precision": "fp16"}, ("pipeline.precision", "fp32 or bf16")),
    ({"pipeline.pp": "four"}, ("pipeline.pp must be an int", "'four'")),
    ({"pipeline.recompute": 1}, ("pipeline.recompute must be a bool",)),
    ({"pipeline.single_process": True, "pipeline.pp": 1}, ("pipeline.single_process", "--pp 2")),
    ({"pipeline.timeout_s": 0}, ("pipeline.timeout_s", "positive")),
    ({"pipeline.schedule": ""}, ("pipeline.schedule is empty",)),
    ({"data.seq_len": 0}, ("data.seq_len", "at least 1")),
    ({"data.eval_fraction": 0.9}, ("data.eval_fraction", "(0, 0.5]")),
    ({"data.path": "/nonexistent/corpus.txt"}, ("data.path", "does not exist", "built-in corpus")),
    ({"data.tokenizer": "/nonexistent/tokenizer.json"}, ("data.tokenizer", "tokenizer.json")),
    ({"optim.lr": -1.0}, ("optim.lr", "positive learning rate")),
    ({"optim.lr": float("nan")}, ("optim.lr", "positive learning rate")),
    ({"optim.warmup_steps": 200}, ("optim.warmup_steps 200", "fewer warm-up steps than run.steps")),
    ({"optim.beta2": 1.0}, ("optim.beta2", "[0, 1)")),
    ({"optim.grad_clip": -1.0}, ("optim.grad_clip", "0 to turn clipping off")),
    ({"optim.grad_accum": 0}, ("optim.grad_accum", "at least 1")),
    ({"optim.max_bad_steps": 0}, ("optim.max_bad_steps", "at least 1")),
    ({"optim.min_lr_ratio": 2.0}, ("optim.min_lr_ratio", "[0, 1]")),
    ({"run.steps": 0, "optim.warmup_steps": 0}, ("run.steps", "at least 1")),
    ({"run.name": "../escape"}, ("run.name", "plain folder name")),
    ({"run.timeline": "t.svg"}, ("run.timeline", ".png")),
    ({"run.seed": -3}, ("run.seed", "at least 0")),
    ({"optim.learning_rate": 1.0}, ("unknown config field optim.learning_rate", "[optim] has")),
    ({"optimizer.lr": 1.0}, ("unknown config key 'optimizer.lr'", "SECTION.FIELD")),
    ({"lr": 1.0}, ("unknown config key 'lr'", "did you mean 'optim.lr'")),
]


@pytest.mark.parametrize(
    ("overrides", "words"), BAD_OVERRIDES, ids=[str(o) for o, _ in BAD_OVERRIDES]
)
def test_bad_override_is_one_line_naming_field_and_fix(
    overrides: dict[str, object], words: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


BAD_FILES: list[tuple[str, tuple[str, ...]]] = [
    ("[pipelin]\npp = 2\n", ("unknown config section [pipelin]", "did you mean 'pipeline'")),
    ("[pipeline]\nsteps = 2\n", ("unknown config field pipeline.steps", "[pipeline] has")),
    ("[pipeline\npp = 2\n", ("not valid TOML", "fix the syntax")),
    ("pipeline = 3\n", ("'pipeline' must be a table",)),
    ("[data]\nbatch_size = 2.5\n", ("data.batch_size must be an int", "2.5")),
]


@pytest.mark.parametrize(("text", "words"), BAD_FILES, ids=[t.split("\n")[0] for t, _ in BAD_FILES])
def test_bad_file_is_one_line_naming_field_and_fix(
    tmp_path: Path, text: str, words: tuple[str, ...]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_missing_file_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"does not exist: give the path of a TOML file to --config"
    ):
        load_config(tmp_path / "nope.toml")


def test_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match=r"SECTION.FIELD=VALUE"):
        parse_override("optim.lr")


def test_shipped_configs_load() -> None:
    folder = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(folder.glob("*.toml"))
    assert files
    for path in files:
        load_config(path, {"run.name": "check"})
    # configs/default.toml is the main job: the same as no flags at all.
    assert load_config(folder / "default.toml", {"run.name": "x"}) == load_config(
        overrides={"run.name": "x"}
    )


def test_processes_that_resolved_different_settings_are_named() -> None:
    """Under torchrun each process resolves its own flags: a node started with another
    seed would train on targets that are not its inputs' (silently)."""
    base = {"run.name": "a", "pipeline.pp": 2}
    ranks = [config_to_dict(load_config(overrides=base)) for _ in range(3)]
    assert settings_disagree(ranks) is None
    seeded = config_to_dict(load_config(overrides={**base, "run.seed": 7, "optim.lr": 0.1}))
    problem = settings_disagree([*ranks[:2], seeded])
    assert problem is not None and "\n" not in problem
    assert "optim.lr is 0.003 on rank 0 but 0.1 on rank 2 (also run.seed)" in problem, problem
    assert "start every process with the same --config file and flags" in problem


def test_settings_of_one_process_may_differ_where_only_rank_0_writes() -> None:
    # The default run name has the second it was resolved in, which ranks may straddle;
    # only rank 0 writes into the run folder. Threads and timeouts are per machine.
    one = load_config(overrides={"run.name": "a", "pipeline.threads": 1})
    other = load_config(
        overrides={
            "run.name": "b",
            "run.metrics": "m.jsonl",
            "run.out_dir": "elsewhere",
            "pipeline.threads": 2,
            "pipeline.timeout_s": 60.0,
        }
    )
    assert settings_disagree([config_to_dict(one), config_to_dict(other)]) is None
