"""`train`, `tune`, `plan` and `generate` given input a user sweep found mishandled.

Each used to give a traceback, a table of nan, an abort of a whole tune, or an error only
after training; now bad input is one line and exit status 2 before anything runs. All in
this process: only one case trains (a few steps of the tiny model).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.config.schema import TrainConfig

pytestmark = pytest.mark.e2e


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert captured.out == ""
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--flops", "nan"], "--flops is nan: give a finite number > 0"),
        (["--flops", "inf"], "--flops is inf"),
        (["--overhead-ms", "nan"], "--overhead-ms is nan"),
        (["--latency-ms", "inf"], "--latency-ms is inf"),
        (["--chunks", "2"], "--chunks 2 needs a schedule with several stages per rank"),
    ],
)
def test_plan_refuses_what_it_used_to_plan_as_nan_or_ignore(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_line_error(["plan", "--model", "llama-tiny", "--pp", "2", *flags], capsys)
    assert words in line


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_generate_refuses_a_non_finite_temperature(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # nan crashed torch.multinomial after loading the model; inf ignored the model.
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--temperature", value]
    assert f"--temperature is {value}" in _one_line_error(argv, capsys)


def test_train_checks_its_outputs_and_config_file_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "ckpt"
    a_file.write_text("")
    runs = tmp_path / "runs"
    base = ["train", "--model", "llama-tiny", "--pp", "1", "--set", f"run.out_dir={json.dumps(str(runs))}"]  # fmt: skip
    # Used to train every step, then fail at the first save.
    line = _one_line_error([*base, "--checkpoint-dir", str(a_file)], capsys)
    assert "run.checkpoint_dir" in line and "is not a folder" in line
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[run]\n")
    line = _one_line_error([*base, "--config", str(binary)], capsys)
    assert "is not UTF-8 text" in line
    line = _one_line_error([*base, "--model", ""], capsys)
    assert line.startswith("pipetrain train: error: model.name '' is not a model preset")
    assert not runs.exists()


def test_tune_skips_a_count_the_schedule_refuses_and_runs_the_others(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1F1B on 4 ranks refuses m=2: that used to end the whole tune at its first candidate.
    code = main(
        [
            "tune", "--pp", "4", "--single-process", "--microbatches", "2,4", "--steps", "2",
            "--model", "llama-tiny", "--batch-size", "4", "--seq-len", "16",
            "--data", str(work / "data"), "--set", "pipeline.threads=1",
            "--set", f"run.out_dir={json.dumps(str(tmp_path))}",
        ]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    table = out[out.index("micro-batches   size") :]
    assert re.search(r"^\s+2\s+skipped: pipeline: 1f1b needs --microbatches >= --pp", table, re.M)
    assert re.search(r"^\s+4\s+1\s+[\d,]+\s+[\d,]+ MiB \*$", table, re.M)
    assert "--- micro-batches 2" not in out


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        # The same reason for every count: that reason alone, not a table of it.
        (["--microbatches", "2,4", "--set", "optim.lr=-1"], "error: optim.lr is -1.0"),
        (["--microbatches", "2,4", "--schedule", "1fb1"], "error: pipeline.schedule: unknown"),
        # Each count refused for its own reason.
        (["--microbatches", "3,5"], "no --microbatches count can run (3: data.batch_size 4"),
    ],
)
def test_tune_with_no_count_that_can_run_is_one_line(
    flags: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["tune", "--model", "llama-tiny", "--pp", "1", "--batch-size", "4", "--seq-len", "16"]
    argv += ["--set", f"run.out_dir={json.dumps(str(tmp_path))}", *flags]
    assert words in _one_line_error(argv, capsys)


def test_tune_stops_at_the_first_run_that_exits_with_bad_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Launched ranks that find bad input (an empty corpus) exit 2, which used to be one
    # skipped row per count, each starting its processes again, and exit status 1.
    from pipetrain.cli import tune

    started: list[int] = []

    def bad_input_run(config: TrainConfig) -> int:
        started.append(config.pipeline.microbatches)
        return 2

    monkeypatch.setattr(tune, "run_config", bad_input_run)
    argv = ["tune", "--model", "llama-tiny", "--pp", "1", "--batch-size", "4", "--seq-len", "16"]
    argv += ["--set", f"run.out_dir={json.dumps(str(tmp_path))}", "--microbatches", "1,2,4"]
    assert main(argv) == 2
    assert started == [1]
    assert "micro-batches   size" not in capsys.readouterr().out


def test_plan_takes_the_memory_limit_its_error_suggests(capsys: pytest.CaptureFixture[str]) -> None:
    # "--memory-limit 2e9" was refused with "write e.g. 16GiB, 512MiB or 2e9".
    argv = ["plan", "--model", "llama-tiny", "--pp", "2", "--memory-limit", "2e9", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["memory_limit"] == 2e9
    line = _one_line_error([*argv[:-2], "1e400", "--json"], capsys)
    assert "--memory-limit '1e400' is not a size" in line


def _tuned_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str
) -> list[TrainConfig]:
    """The candidate configs `pipetrain tune --microbatches 1,2 FLAGS` runs (each candidate
    recorded instead of run, and reported failed)."""
    from pipetrain.cli import tune

    ran: list[TrainConfig] = []

    def record(config: TrainConfig) -> int:
        ran.append(config)
        return 1

    monkeypatch.setattr(tune, "run_config", record)
    argv = ["tune", "--model", "llama-tiny", "--pp", "1", "--batch-size", "4", "--seq-len", "16"]
    argv += ["--set", f"run.out_dir={json.dumps(str(tmp_path))}", "--microbatches", "1,2"]
    assert main([*argv, *flags]) == 1
    assert [c.pipeline.microbatches for c in ran] == [1, 2]
    return ran


def test_tune_leaves_the_checkpoints_of_a_train_command_line_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A train command line with its checkpoint flags used to make every candidate resume
    # from that run's checkpoints (refused: past the candidate's steps) or save and prune
    # among them.
    flags = ["--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--keep", "2"]
    ran = _tuned_configs(tmp_path, monkeypatch, *flags)
    assert all(
        (c.run.checkpoint_dir, c.run.resume, c.run.keep, c.run.checkpoint_every)
        == ("", False, 0, 0)
        for c in ran
    )


def test_tune_candidates_of_a_named_tuning_are_runs_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With --name (or --metrics) every candidate wrote the same metrics file, each run
    # replacing the last one's; a run no longer replaces an earlier run's metrics, so the
    # second candidate would be refused.
    flags = ["--name", "sweep", "--metrics", str(tmp_path / "one.jsonl")]
    ran = _tuned_configs(tmp_path, monkeypatch, *flags)
    assert [c.run.name for c in ran] == ["sweep-m1", "sweep-m2"]
    assert [c.metrics_path for c in ran] == [
        tmp_path / "sweep-m1" / "metrics.jsonl",
        tmp_path / "sweep-m2" / "metrics.jsonl",
    ]


def test_tune_named_as_an_earlier_tuning_is_refused_before_any_candidate_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The candidate whose run folder an earlier tuning left was refused only at its start,
    # after the others had run, with a train run's advice (--resume, ignored by tune).
    earlier = tmp_path / "sweep-m2" / "metrics.jsonl"
    earlier.parent.mkdir()
    earlier.write_text('{"step": 1, "loss": 5.0}\n', encoding="utf-8")
    from pipetrain.cli import tune

    ran: list[TrainConfig] = []
    monkeypatch.setattr(tune, "run_config", lambda config: ran.append(config) or 0)
    argv = ["tune", "--model", "llama-tiny", "--pp", "1", "--batch-size", "4", "--seq-len", "16"]
    argv += ["--set", f"run.out_dir={json.dumps(str(tmp_path))}", "--microbatches", "1,2"]
    err = _one_line_error([*argv, "--name", "sweep"], capsys)
    assert ran == []
    assert f"{earlier.parent} already holds a candidate run of an earlier tuning" in err
    assert "choose another --name" in err and "--resume" not in err
    assert earlier.read_text(encoding="utf-8") == '{"step": 1, "loss": 5.0}\n'


def test_tune_takes_the_run_name_from_set_or_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only --name counted: a name given by --set run.name=... or the --config file was
    # replaced by tune-<date-time>, and the candidates' metrics went where the user did not
    # look.
    ran = _tuned_configs(tmp_path, monkeypatch, "--set", "run.name=mine")
    assert [c.run.name for c in ran] == ["mine-m1", "mine-m2"]
    config = tmp_path / "tune.toml"
    config.write_text('[run]\nname = "fromfile"\n', encoding="utf-8")
    ran = _tuned_configs(tmp_path, monkeypatch, "--config", str(config))
    assert [c.run.name for c in ran] == ["fromfile-m1", "fromfile-m2"]
    unnamed = [c.run.name for c in _tuned_configs(tmp_path, monkeypatch)]
    assert re.fullmatch(rf"tune-\d{{8}}-\d{{6}}-{os.getpid()}-m1", unnamed[0]), unnamed
    assert unnamed[1] == unnamed[0][:-1] + "2"


@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_split_that_starts_with_a_dash_gets_its_own_error(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse took "-1,3,2" for an option and said "expected one argument".
    argv = [command, "--model", "llama-tiny", "--pp", "3", "--split", "-1,3,2"]
    if command == "train":
        argv += ["--steps", "20", "--seq-len", "16", "--set", f"run.out_dir={tmp_path}"]
    assert "--split '-1,3,2' has a negative count" in _one_line_error(argv, capsys)


def test_an_option_with_its_value_missing_is_still_said_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--model", "llama-tiny", "--split", "--pp", "3"])
    assert stopped.value.code == 2
    assert "argument --split: expected one argument" in capsys.readouterr().err
