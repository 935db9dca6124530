"""``pipetrain simulate`` given bad outputs, sizes and schedule files: exit status 2 and one
line, never a traceback; and a spreadsheet's CSV simulates like the built-in schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from simulate_cli import cli, refused

from pipetrain.schedules import io, registry

pytestmark = pytest.mark.e2e

SMALL = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2"]


def test_outputs_that_cannot_be_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    err = refused(capsys, *SMALL, "--trace", str(missing / "t.json"))
    assert "cannot write" in err and "t.json" in err
    err = refused(capsys, *SMALL, "--plot", str(missing / "p.svg"))
    assert "cannot write" in err and "p.svg" in err
    (tmp_path / "d.json").mkdir()
    assert "Is a directory" in refused(capsys, *SMALL, "--trace", str(tmp_path / "d.json"))
    assert not missing.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--activation-bytes", "-5"],
        ["--activation-bytes", "inf"],
        ["--weight-bytes", "nan"],
        ["--weight-bytes", "-1", "--dp", "2"],
    ],
)
def test_sizes_must_be_finite_bytes(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    err = refused(capsys, *SMALL, *argv)
    assert argv[0] in err and "finite number of bytes >= 0" in err


def test_schedule_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    built = registry.build_schedule("pipedream", 2, 2)
    csv_path, json_path = tmp_path / "mine.csv", tmp_path / "mine.json"
    io.dump_csv(built, csv_path)
    io.dump_json(built, json_path)
    # --chunks cannot change a file's placement: refused rather than ignored.
    assert "drop --chunks" in refused(capsys, "--schedule-file", str(csv_path), "--chunks", "2")
    # A hand-edited param that the report divides by: one line, not a ZeroDivisionError.
    doc = json.loads(json_path.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, "params": {"window": 2, "steps": 0}}))
    assert "param 'steps'" in refused(capsys, "--schedule-file", str(bad), "--json")
    # Saved by a spreadsheet as "CSV UTF-8": a byte-order mark in front.
    excel = tmp_path / "excel.csv"
    excel.write_bytes(b"\xef\xbb\xbf" + csv_path.read_bytes())
    code, out, err = cli(capsys, "--schedule-file", str(excel), "--json")
    assert code == 0, err
    _, plain, _ = cli(capsys, "--schedule-file", str(csv_path), "--json")
    mine, ref = json.loads(out), json.loads(plain)
    assert (mine.pop("schedule"), ref.pop("schedule")) == ("excel", "mine")
    assert mine == ref


def test_dp_refuses_asynchronous_schedules(capsys: pytest.CaptureFixture[str]) -> None:
    # One all-reduce after a stage's last B/W is one synchronous step; PipeDream updates
    # after every backward (train refuses --dp with it too; --shard already refused it).
    argv = ["--schedule", "pipedream", "--pp", "2", "--microbatches", "2"]
    err = refused(capsys, *argv, "--dp", "2", "--weight-bytes", "100")
    assert "'pipedream' is asynchronous" in err and "drop --dp" in err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "argv",
    [
        ["--schedule", "1f1b", "--pp", "1000", "--microbatches", "1001"],
        ["--schedule", "zb-v", "--pp", "1000", "--microbatches", "501"],
        ["--compare", "--pp", "100000", "--microbatches", "100000"],
    ],
)
def test_a_size_the_replay_cannot_finish_is_refused_up_front(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    # It used to generate and replay for minutes to hours, growing by about 1.5 kB per
    # stage micro-batch, where a typo in --microbatches wants one line.
    err = refused(capsys, *argv)
    assert "stage micro-batches to replay" in err and "lower --pp or --microbatches" in err
