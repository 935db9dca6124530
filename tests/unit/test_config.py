"""Config: defaults, TOML file, overrides, round trip, the field docs, and one-line
rejections.

Every bad input must end in one ``ConfigError`` line naming the field and the fix, raised
by ``load_config`` before any process starts (not a traceback, nor an error after
training); the later cases were found by a sweep as a user, and each used to crash, hang
or fail late (a --timeline that is a folder or neither a .png picture nor a .json trace
was found only after the last step).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from pipetrain.cli.train import fields_help
from pipetrain.config import (
    ConfigError,
    TrainConfig,
    config_to_dict,
    config_to_toml,
    load_config,
    parse_override,
    settings_disagree,
)
from pipetrain.config.docs import config_fields
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


def _message(overrides: dict[str, object], path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


FLOAT_FIELDS = [
    f"{section.name}.{f.name}"
    for section in dataclasses.fields(TrainConfig)
    for f in dataclasses.fields(section.default_factory())  # type: ignore[misc]
    if f.type in ("float", float)
]


def test_every_float_field_is_swept() -> None:
    assert {"optim.grad_clip", "optim.weight_decay", "optim.eps", "pipeline.timeout_s"} <= set(
        FLOAT_FIELDS
    )
    assert "run.sample_temperature" in FLOAT_FIELDS


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("key", FLOAT_FIELDS)
def test_non_finite_floats_are_refused(key: str, value: float) -> None:
    # nan grad_clip / weight_decay, inf eps or temperature trained (or sampled) garbage
    # without a word; inf timeout_s crashed every rank with an OverflowError.
    message = _message({key: value})
    assert message.startswith(f"{key} is {value}: ")


def test_timeout_beyond_a_year_is_refused() -> None:
    # 1e14 s overflows the process group's timedelta in every rank.
    message = _message({"pipeline.timeout_s": 1e14})
    assert "pipeline.timeout_s" in message and "e.g. 300" in message
    assert load_config(overrides={"pipeline.timeout_s": 86400.0}).pipeline.timeout_s == 86400.0


def test_int_too_large_for_a_float_field(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_text("[optim]\nlr = 1" + "0" * 400 + "\n")
    message = _message({}, path)
    assert message.startswith("optim.lr must be a float") and "fix its value" in message


def test_config_file_that_is_not_text(tmp_path: Path) -> None:
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe\x00[run]\n")
    message = _message({}, path)
    assert "is not UTF-8 text" in message and "--config" in message


@pytest.mark.parametrize("name", ["", "llama/tiny", "llama-tny"])
def test_bad_model_name_is_named_as_such(name: str) -> None:
    # An empty name used to be reported as a bad run.name (the default name is built from it).
    message = _message({"model.name": name})
    assert message.startswith(f"model.name {name!r} is not a model preset")
    assert "llama-tiny" in message and "run.name" not in message


def test_default_run_name_is_a_folder_name_whatever_the_schedule() -> None:
    # The schedule is checked against the registry later (plan_run), with its own message.
    config = load_config(overrides={"pipeline.schedule": "my/sched ule"})
    assert config.run.name.startswith("llama-default-my_sched_ule-pp3-")


def test_warmup_message_gives_the_override_to_use() -> None:
    message = _message({"run.steps": 5, "optim.warmup_steps": 10})
    assert "optim.warmup_steps 10" in message and "--set optim.warmup_steps=4" in message


@pytest.mark.parametrize(("steps", "warmup"), [(1, 0), (5, 0), (10, 1), (11, 10), (120, 10)])
def test_a_default_warmup_longer_than_the_run_is_shortened_with_a_note(
    steps: int, warmup: int
) -> None:
    notes: list[str] = []
    config = load_config(overrides={"run.steps": steps}, notes=notes)
    assert config.optim.warmup_steps == warmup
    if warmup == 10:
        assert notes == []
    else:
        assert len(notes) == 1 and "default warm-up of 10 steps" in notes[0]
        assert f"{steps}-step run: warming up for {warmup}" in notes[0]


def test_a_warmup_given_in_the_file_is_not_shortened(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[optim]\nwarmup_steps = 10\n[run]\nsteps = 5\n")
    assert "optim.warmup_steps 10" in _message({}, path)
    # Given, and fitting: kept as it is, without a note.
    notes: list[str] = []
    assert load_config(path, {"optim.warmup_steps": 3}, notes=notes).optim.warmup_steps == 3
    assert notes == []


def test_output_folders_are_checked_before_the_run(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    base: dict[str, object] = {"run.name": "r", "run.out_dir": str(tmp_path / "runs")}
    # A checkpoint directory that is a file used to fail only at the first save.
    message = _message({**base, "run.checkpoint_dir": str(a_file)})
    assert message.startswith("run.checkpoint_dir") and "is not a folder" in message
    assert "--checkpoint-dir" in message
    # An output folder under a file was a NotADirectoryError traceback.
    message = _message({**base, "run.out_dir": str(a_file / "runs")})
    assert message.startswith("run.out_dir") and "is not a folder" in message
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r").write_text("")
    message = _message(base)
    assert message.startswith("run.name 'r'") and "pass another --name" in message
    (tmp_path / "runs" / "r").unlink()
    (tmp_path / "runs").rmdir()
    # A timeline in a missing folder failed after the last step.
    message = _message({**base, "run.timeline": str(tmp_path / "no" / "t.png")})
    assert message.startswith("run.timeline") and "does not exist" in message
    # Folders that do not exist yet but can be created are fine, and nothing is created.
    fine = {
        **base,
        "run.checkpoint_dir": str(tmp_path / "ck" / "deeper"),
        "run.timeline": str(tmp_path / "t.png"),
    }
    load_config(overrides=fine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    # Configs resolved elsewhere (check_paths=False) are not checked against this machine.
    load_config(overrides={**base, "run.checkpoint_dir": str(a_file)}, check_paths=False)


def test_keep_without_a_checkpoint_dir_is_refused() -> None:
    # --keep 3 alone used to be accepted and do nothing.
    message = _message({"run.keep": 3})
    assert "run.keep need run.checkpoint_dir" in message and "--checkpoint-dir" in message
    assert load_config(overrides={"run.keep": 3, "run.checkpoint_dir": "ck"}).run.keep == 3


def test_text_fields_take_set_values_as_written() -> None:
    # `--set run.name=2024` was "run.name must be a str, got 2024": TOML reads an integer.
    assert parse_override("run.name=2024") == ("run.name", "2024")
    assert parse_override("data.path=1e3") == ("data.path", "1e3")
    assert parse_override("run.sample_prompt=true") == ("run.sample_prompt", "true")
    assert parse_override('run.sample_prompt="def "') == ("run.sample_prompt", "def ")
    # Other fields still read TOML values.
    assert parse_override("run.steps=2024") == ("run.steps", 2024)
    assert load_config(overrides=dict([parse_override("run.name=2024")])).run.name == "2024"


def test_saved_config_reads_back_whatever_the_text(tmp_path: Path) -> None:
    # An emoji in the sample prompt was saved as a JSON surrogate pair, which TOML refuses:
    # every worker of a launched run failed on the config its launcher had just written.
    prompt = 'def 😀 "q" \\ é\t\x00\x7f\n'
    config = load_config(overrides={"run.sample_prompt": prompt, "run.name": "x"})
    path = tmp_path / "config.toml"
    text = config_to_toml(config)
    assert text.isascii()
    path.write_text(text, encoding="utf-8")
    assert load_config(path) == config


def test_text_that_is_not_unicode_is_refused() -> None:
    # Non-UTF-8 bytes in an argument arrive as lone surrogates, which no file can hold.
    message = _message({"run.sample_prompt": "def \udcff"})
    assert message.startswith("run.sample_prompt 'def \\udcff' is not valid UTF-8 text")


def test_a_single_checkpoint_as_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    # --checkpoint-dir ck/step_000005 --resume started from step 0 and saved inside it.
    from pipetrain.checkpoint.manifest import COMPLETE_MARKER, MANIFEST_NAME

    for name in (COMPLETE_MARKER, MANIFEST_NAME):
        step = tmp_path / name / "step_000005"
        step.mkdir(parents=True)
        (step / name).write_text("")
        message = _message({"run.checkpoint_dir": str(step), "run.resume": True})
        assert "is one checkpoint, not a folder of them" in message
        assert f"--checkpoint-dir {str(step.parent)!r}" in message


def test_an_empty_sample_prompt_is_refused_before_training() -> None:
    # It crashed the model's forward after the last step (a reshape of 0 tokens).
    message = _message({"run.sample_prompt": ""})
    assert message.startswith("run.sample_prompt is empty") and "run.sample_tokens=0" in message
    load_config(overrides={"run.sample_prompt": "", "run.sample_tokens": 0})


def test_a_home_folder_in_a_path_is_expanded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # "~/runs" in a TOML file or a quoted --set reached the run as a folder named "~".
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(
        overrides={"run.name": "r", "run.out_dir": "~/runs", "run.checkpoint_dir": "~/ck"}
    )
    assert config.run.out_dir == str(tmp_path / "runs")
    assert config.run.checkpoint_dir == str(tmp_path / "ck")
    assert config.run_dir == tmp_path / "runs" / "r"


def test_a_batch_too_large_to_index_is_refused() -> None:
    # Built as one index array of batch x (seq_len + 1) tokens: numpy failed for memory.
    with pytest.raises(ConfigError, match=r"data.batch_size 100000000000 x data.seq_len 128"):
        load_config(overrides={"run.name": "r", "data.batch_size": 100_000_000_000})


def test_every_field_is_documented_under_its_declaration() -> None:
    # The strings under the fields are what `pipetrain train --help` lists.
    fields = config_fields()
    assert len(fields) == sum(
        len(dataclasses.fields(section.default_factory()))  # type: ignore[misc]
        for section in dataclasses.fields(TrainConfig)
    )
    assert [f.key for f in fields if not f.doc] == []
    by_key = {f.key: f for f in fields}
    assert by_key["optim.lr"].default == 3e-3
    assert by_key["optim.lr"].doc == "Peak learning rate, reached after the warm-up."
    # A docstring over several lines reads as one.
    assert "\n" not in by_key["pipeline.early_grads"].doc


def test_train_help_lists_every_field_with_its_doc() -> None:
    text = fields_help()
    for f in config_fields():
        assert f"  {f.key} = " in text and f.doc in text
    assert '  run.sample_prompt = "def "' in text and "  pipeline.shard = false" in text


def test_a_timeline_path_that_is_a_folder_is_refused_before_training(tmp_path: Path) -> None:
    # It was found only when the picture was drawn, after the last step.
    folder = tmp_path / "step.png"
    folder.mkdir()
    overrides = {"run.out_dir": str(tmp_path / "runs"), "run.timeline": str(folder)}
    with pytest.raises(ConfigError, match=r"run.timeline .* is a folder: name a .png file"):
        load_config(overrides=overrides)


def test_a_timeline_is_a_png_picture_or_a_json_trace(tmp_path: Path) -> None:
    base = {"run.out_dir": str(tmp_path / "runs")}
    for name in ("step.png", "step.json"):
        path = str(tmp_path / name)
        assert load_config(overrides={**base, "run.timeline": path}).run.timeline == path
    with pytest.raises(ConfigError, match=r"must name a .png picture or a .json Chrome/Perfetto"):
        load_config(overrides={**base, "run.timeline": str(tmp_path / "step.txt")})
