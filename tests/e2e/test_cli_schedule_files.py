"""Schedule files through ``pipetrain simulate``: written with --save, loaded back with
--schedule-file to the same numbers (a spreadsheet's CSV with a byte-order mark too), and
every malformed file refused in one line, as are --chunks beside a file and a hand-edited
param the report divides by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from simulate_cli import cli, refused

from pipetrain.cli import main
from pipetrain.schedules import io, registry

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("name", "chunks"), [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_saved_schedule_loads_back_and_simulates_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, chunks: int
) -> None:
    argv = ["--schedule", name, "--pp", "2", "--microbatches", "4", "--chunks", str(chunks)]
    _, expected, _ = cli(capsys, *argv, "--json")
    reference = json.loads(expected)
    built = registry.build_schedule(name, 2, 4, chunks)
    for suffix in (".csv", ".json"):
        path = tmp_path / f"mine{suffix}"
        code, out, err = cli(capsys, *argv, "--save", str(path))
        assert code == 0, err
        assert out.splitlines()[-1] == f"wrote {path}"
        load = io.load_csv if suffix == ".csv" else io.load_json
        assert load(path).actions == built.actions
        code, out, err = cli(capsys, "--schedule-file", str(path), "--json")
        assert code == 0, err
        mine = json.loads(out)
        assert mine.pop("schedule") == ("mine" if suffix == ".csv" else name)
        assert mine == {k: v for k, v in reference.items() if k != "schedule"}


def test_save_refuses_what_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2"]
    assert "use a .csv or .json file name" in refused(capsys, *small, "--save", "s.txt")
    err = refused(capsys, "--compare", "--pp", "2", "--microbatches", "2", "--save", "s.csv")
    assert "--save writes one schedule" in err
    err = refused(capsys, *small, "--save", str(tmp_path / "missing" / "s.csv"))
    assert "cannot write schedule file" in err and "check the directory" in err
    stream = ["--schedule", "pipedream-2bw", "--pp", "2", "--microbatches", "2"]
    err = refused(capsys, *stream, "--save", str(tmp_path / "s.csv"))
    assert "CSV keeps no params" in err and "steps, window" in err and "save it as .json" in err
    assert not (tmp_path / "s.csv").exists()


GOOD = "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n"


@pytest.mark.parametrize(
    ("name", "content", "argv", "fragment"),
    [
        ("empty.csv", "", [], "has no actions"),
        ("semicolons.csv", GOOD.replace(",", ";"), [], "holds several actions"),
        ("lower.csv", GOOD.lower(), [], "kinds are upper case, write '0F0'"),
        ("count.csv", GOOD, ["--microbatches", "3"], "not the 3 asked for"),
        ("ranks.csv", GOOD, ["--pp", "3"], "2 rows but 3 ranks"),
        ("twice.csv", "0F0,0F0,0B0\n1F0,1B0\n", [], "duplicates 0F0"),
        ("missing.csv", "0F0,0F1,0B0\n1F0,1F1,1B0,1B1\n", [], "never runs 0B1"),
        ("mixed.csv", "0F0,0I0,0B0,0W0\n1F0,1B0\n", [], "mixes a full backward"),
        ("w.csv", "0F0,0W0\n1F0,1B0\n", [], "never runs 0I0"),
        ("sum.csv", "0F0,0B0,0ALLREDUCE\n1F0,1B0\n", [], "no replica whose gradients"),
        ("stuck.csv", "0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n", [], "deadlocks"),
        ("bytes.csv", b"0F0,\xff\n", [], "not UTF-8 text"),
        ("digits.json", '{"format": 1, "pp": 1' + "0" * 5000 + "}", [], "thousands of digits"),
        ("list.json", "[]", [], "expected a JSON object"),
    ],
)
def test_malformed_file_is_one_line_and_status_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    content: str | bytes,
    argv: list[str],
    fragment: str,
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    assert fragment in refused(capsys, "--schedule-file", str(path), *argv)


def test_training_with_a_saved_file_equals_the_builtin_to_the_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "zb.csv"
    code, _, err = cli(capsys, "--schedule", "zb-h1", "--pp", "2", "--microbatches", "4",
                       "--save", str(path))  # fmt: skip
    assert code == 0, err
    tiny = [
        "--model", "llama-tiny", "--steps", "2", "--batch-size", "8", "--seq-len", "32",
        "--microbatches", "4", "--pp", "2", "--single-process", "--set", "data.max_bytes=100000",
        "--set", "optim.warmup_steps=1", "--set", "run.sample_tokens=0",
        "--set", "run.evaluate=false", "--set", "pipeline.threads=1",
        "--set", f"run.out_dir={json.dumps(str(tmp_path))}",
    ]  # fmt: skip
    steps = {}
    for schedule in ("zb-h1", str(path)):
        name = Path(schedule).stem
        assert main(["train", *tiny, "--schedule", schedule, "--name", name]) == 0
        records = (json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open())
        steps[name] = [(r["loss"], r["grad_norm"]) for r in records if "loss" in r]
    capsys.readouterr()
    assert len(steps["zb"]) == 2 and steps["zb"] == steps["zb-h1"]


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
