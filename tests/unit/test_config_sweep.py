"""Config inputs found by a sweep as a user: each used to crash, hang or fail late.

Every case must end in one ``ConfigError`` line naming the field and the fix, raised by
``load_config`` before any process starts (not a traceback, nor an error after training).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipetrain.config import (
    ConfigError,
    TrainConfig,
    config_to_toml,
    load_config,
    parse_override,
)


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
    message = _message({"run.steps": 5})
    assert "optim.warmup_steps 10" in message and "--set optim.warmup_steps=4" in message


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
