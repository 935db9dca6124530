"""`pipetrain tune`: a few steps per micro-batch count, tokens/s and peak memory, best marked.

Input a user found mishandled: a count the schedule refuses is a skipped row and the
others run, no count that can run (or a run that exits with bad input) is one line and
exit status 2, and the candidates are runs of their own (named after the tuning, by
--name, --set run.name or the config file, without the checkpoints of a train command
line), an earlier tuning's name refused before any candidate runs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from cli_errors import one_line_error as _one_line_error

from pipetrain.cli import main
from pipetrain.cli.errors import UsageError
from pipetrain.cli.tune import Candidate, format_table, parse_counts
from pipetrain.config.schema import TrainConfig

pytestmark = pytest.mark.e2e


def test_tune_measures_each_candidate_and_marks_the_fastest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "tune", "--pp", "2", "--single-process", "--microbatches", "2,4,3", "--steps", "3",
            "--model", "llama-tiny", "--batch-size", "8", "--seq-len", "32",
            "--set", "data.max_bytes=100000", "--set", "pipeline.threads=1",
            "--set", f"run.out_dir={json.dumps(str(tmp_path))}",
        ]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    table = out[out.index("micro-batches   size") :]
    rows = {int(m.group(1)): m.group(0) for m in re.finditer(r"^\s+(\d+)\s+.*$", table, re.M)}
    assert set(rows) == {2, 3, 4}
    assert "skipped: data.batch_size 8 is not a multiple of pipeline.microbatches 3" in rows[3]
    assert re.search(r"^\s+2\s+4\s+[\d,]+\s+[\d,]+ MiB", rows[2])
    assert re.search(r"^\s+4\s+2\s+[\d,]+\s+[\d,]+ MiB", rows[4])
    assert sum(row.endswith(" *") for row in rows.values()) == 1
    best = next(m for m, row in rows.items() if row.endswith(" *"))
    assert f"best: --microbatches {best} (" in table
    # Candidates are short runs: no evaluation, no sample.
    assert "eval loss" not in out and "sample (" not in out


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_a_candidate_in_this_process_reports_its_own_peak_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With one process, candidates train one after another in the tuning's own process:
    # the peak of an earlier, larger candidate (here 400 MiB) is not the next one's.
    import dataclasses

    from pipetrain.cli import tune
    from pipetrain.config.schema import TrainConfig
    from pipetrain.train.metrics import peak_memory_bytes, reset_peak_memory

    reset_peak_memory()
    before = peak_memory_bytes("cpu")
    block = bytearray(400 * 2**20)
    block[::4096] = b"\1" * len(block[::4096])
    del block
    config = TrainConfig()
    config = dataclasses.replace(
        config, run=dataclasses.replace(config.run, out_dir=str(tmp_path), name="tune-m4")
    )

    def run_config(candidate: TrainConfig) -> int:
        record = {
            "summary": True,
            "steps": candidate.run.steps,
            "tokens_per_s": 1.0,
            "peak_memory": [peak_memory_bytes("cpu")],
        }
        candidate.metrics_path.parent.mkdir(parents=True)
        candidate.metrics_path.write_text(json.dumps(record) + "\n")
        return 0

    monkeypatch.setattr(tune, "run_config", run_config)
    assert tune._measure(4, config).peak_memory < before + 200 * 2**20


def test_a_stop_signal_ends_the_tuning_with_what_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Ctrl-C stops a candidate as it stops a train run: status 0, the steps so far
    # summarised. The tuning went on with the next counts and called the stopped one "the
    # run failed (exit status 0)"; a Ctrl-C between two runs was a traceback.
    from pipetrain.cli import tune

    ran: list[int] = []

    def run_config(config: TrainConfig) -> int:
        count = config.pipeline.microbatches
        ran.append(count)
        if count == 8:
            raise KeyboardInterrupt  # as the run starts
        steps = 2 if count == 2 else 4  # 2 is stopped after 2 of its 4 steps
        record = {"summary": True, "steps": steps, "tokens_per_s": 9.0, "peak_memory": [2**20]}
        config.metrics_path.parent.mkdir(parents=True)
        config.metrics_path.write_text(json.dumps(record) + "\n")
        return 0

    monkeypatch.setattr(tune, "run_config", run_config)
    argv = [
        "tune", "--model", "llama-tiny", "--pp", "1", "--batch-size", "8", "--seq-len", "32",
        "--set", "data.max_bytes=100000", "--set", f"run.out_dir={json.dumps(str(tmp_path))}",
    ]  # fmt: skip
    assert main([*argv, "--microbatches", "1,2,4,8"]) == 0
    out, err = capsys.readouterr()
    assert ran == [1, 2]
    assert re.search(r"^\s+1\s+8\s+9 .* \*$", out, re.M)
    assert re.search(r"^\s+2\s+stopped by a signal$", out, re.M)
    for count in (4, 8):
        assert re.search(rf"^\s+{count}\s+skipped: the tuning was stopped before it$", out, re.M)
    assert "stopped by a signal" in err
    assert main([*argv, "--microbatches", "1,8", "--name", "again"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"^\s+8\s+stopped by a signal$", out, re.M) and "Traceback" not in err
    assert "note:" not in out
    # One step is timed with its allocations: said under the table.
    assert main([*argv, "--microbatches", "1", "--name", "one", "--steps", "1"]) == 0
    assert "note: with --steps 1 tokens/s times each candidate's first step" in (
        capsys.readouterr().out
    )


def test_each_candidate_draws_its_own_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One --timeline file for all candidates kept only the last one's picture.
    from pipetrain.cli import build_parser, tune

    args = build_parser().parse_args(
        ["tune", "--model", "llama-tiny", "--pp", "1", "--batch-size", "8", "--seq-len", "32",
         "--timeline", str(tmp_path / "step.png"), "--set", "data.max_bytes=100000"]
    )  # fmt: skip
    pictures = {tune._resolve(args, m, "now").run.timeline for m in (2, 4)}
    assert pictures == {str(tmp_path / "step-m2.png"), str(tmp_path / "step-m4.png")}
    assert tune._resolve(args, 2, "now").run.steps == 4  # the tuning's default
    # --set run.steps=10 ran 4 steps without a word; --steps was the only way.
    args = build_parser().parse_args(
        ["tune", "--model", "llama-tiny", "--pp", "1", "--seq-len", "32", "--set", "run.steps=10"]
    )
    assert tune._resolve(args, 2, "now").run.steps == 10


def test_format_table_marks_the_highest_throughput() -> None:
    table = format_table(
        [Candidate(2, 16, 900.0, 2**30), Candidate(4, 8, 1200.0, 2**29), Candidate(8, 4, error="x")]
    )
    lines = table.splitlines()
    assert lines[2].endswith("512 MiB *") and not lines[1].endswith("*")
    assert lines[-1] == "best: --microbatches 4 (1,200 tokens/s)"


@pytest.mark.parametrize("text", ["2,x", "0,4", ""])
def test_bad_counts_are_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match=r"--microbatches"):
        parse_counts(text)


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
