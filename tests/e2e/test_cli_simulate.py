"""``pipetrain simulate`` end to end: through main(argv), and once as a real process.

Bad outputs and sizes are exit status 2 and one line, never a traceback: outputs that
cannot be written, sizes that are not finite bytes, --dp with an asynchronous schedule,
and a size the replay could not finish in reasonable time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from simulate_cli import cli, refused

from pipetrain.cli import main
from pipetrain.schedules import io, registry

pytestmark = pytest.mark.e2e


def test_json_object_for_1f1b(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["schedule"] == "1f1b"
    assert (data["pp"], data["microbatches"], data["chunks"]) == (4, 8, 1)
    assert data["makespan"] == 33
    assert data["bubble"]["idle_fraction"] == pytest.approx(3 / 11)
    assert data["bubble"]["over_ideal"] == pytest.approx(3 / 8)
    assert data["bubble"]["per_rank_span"] == pytest.approx(9 / 33)
    assert data["bubble"]["per_rank_span_time"] == 9
    assert data["peak_activations"] == [4, 3, 2, 1]
    assert data["weight_versions"] == [1, 1, 1, 1]


def test_default_output_is_a_summary_and_a_grid(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--schedule", "gpipe", "--pp", "2", "--microbatches", "2")
    assert code == 0
    assert "makespan            9" in out
    assert "33.33% of rank time" in out
    assert "r0| 0F0 0F1 ............0B0---- 0B1---- " in out


def test_costs_latency_and_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--pp", "2", "--microbatches", "4", "--json"]
    _, out, _ = cli(capsys, "--schedule", "1f1b", *base, "--costs", "F=2,B=4")
    assert json.loads(out)["makespan"] == 5 * 6
    _, out, _ = cli(capsys, "--schedule", "1f1b", *base, "--latency", "0.5")
    assert json.loads(out)["makespan"] > 15
    _, out, _ = cli(capsys, "--schedule", "interleaved-1f1b", *base, "--chunks", "2")
    data = json.loads(out)
    assert data["chunks"] == 2
    assert data["bubble"]["over_ideal"] == pytest.approx(1 / 8)


def test_one_number_is_a_rank_share_and_a_list_is_per_stage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--schedule", "zb-v", "--pp", "4", "--microbatches", "8", "--json"]
    _, out, _ = cli(capsys, *args)
    data = json.loads(out)
    # Two stages per rank, each half of a rank's share: 51 unit-cost chunk slots of 1/2.
    assert (data["chunks"], data["makespan"]) == (2, 25.5)
    assert data["bubble"]["per_rank_span_time"] == 0
    _, out, _ = cli(
        capsys, *args, "--costs", "F=" + "/".join(["1"] * 8) + ",B=" + "/".join(["2"] * 8)
    )
    assert json.loads(out)["makespan"] == 51
    code, _, err = cli(capsys, *args, "--costs", "F=1/2")
    assert code == 2 and "2 numbers for 8 model stages of zb-v" in err


@pytest.mark.parametrize(
    ("name", "activations", "weights"),
    [
        ("1f1b", [4000, 3000, 2000, 1000], [100] * 4),
        # p stage-equivalents on a V; Chimera holds two replicas; PipeDream stashes p-r.
        ("zb-v", [4000] * 4, [100] * 4),
        ("chimera", [4000] * 4, [200] * 4),
        ("pipedream", [4000, 3000, 2000, 1000], [400, 300, 200, 100]),
    ],
)
def test_bytes_are_a_rank_share_too(
    capsys: pytest.CaptureFixture[str], name: str, activations: list[int], weights: list[int]
) -> None:
    args = ["--pp", "4", "--microbatches", "8", "--json"]
    sizes = ["--activation-bytes", "1000", "--weight-bytes", "100"]
    _, out, _ = cli(capsys, "--schedule", name, *args, *sizes)
    data = json.loads(out)
    assert data["peak_activation_bytes"] == activations
    assert data["weight_bytes"] == weights


def test_asynchronous_schedules_report_steps(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = cli(capsys, "--schedule", "pipedream", "--pp", "4", "--microbatches", "8", "--json")
    data = json.loads(out)
    assert (data["microbatches"], data["steps"]) == (8, 2)
    assert data["time_per_step"] == data["makespan"] / 2
    assert data["weight_versions"] == [4, 3, 2, 1]


def test_pictures_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, svg, trace = tmp_path / "z.png", tmp_path / "z.svg", tmp_path / "z.json"
    args = ["--schedule", "zb-h1", "--pp", "4", "--microbatches", "8"]
    code, out, _ = cli(capsys, *args, "--plot", str(png), "--trace", str(trace), "--ascii")
    assert code == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1, 2, 3}
    assert "r3|" in out and f"wrote {png}" in out
    assert cli(capsys, *args, "--plot", str(svg))[0] == 0
    assert "<svg" in svg.read_text()


def test_compare_table_picture_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--compare", "--pp", "4", "--microbatches", "4")
    assert code == 0
    fits = registry.fitting(4, 4)
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["schedule", "makespan", "per", "step"]
    table = {line.split()[0] for line in lines[2:] if line and not line.startswith((" ", "wrote "))}
    assert table == set(fits)
    # zb-h2 needs m >= 2p-1: listed with its reason.
    assert any(line.startswith("  not fitting: zb-h2: ") for line in lines)
    # The smallest case for the picture: drawing is the slow part.
    png = tmp_path / "all.png"
    args = ["--compare", "--pp", "2", "--microbatches", "2", "--ascii", "--plot", str(png)]
    _, out, _ = cli(capsys, *args)
    grids = [line for line in out.splitlines() if ": 2 ranks, makespan " in line]
    assert [g.split(":")[0] for g in grids] == registry.fitting(2, 2)
    assert png.read_bytes()[:4] == b"\x89PNG" and f"wrote {png}" in out
    _, out, _ = cli(capsys, "--compare", "--pp", "4", "--microbatches", "4", "--json")
    data = json.loads(out)
    assert [r["schedule"] for r in data["results"]] == [
        n for n in registry.SCHEDULE_NAMES if n in fits
    ]
    assert {s["schedule"] for s in data["skipped"]} == set(registry.SCHEDULE_NAMES) - set(fits)
    naive = next(r for r in data["results"] if r["schedule"] == "naive")
    assert naive["microbatches"] == 4 and naive["peak_activations"] == [4, 4, 4, 4]


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_schedule_file_simulates_like_the_builtin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    built = registry.build_schedule("zb-h1", 4, 8)
    path = tmp_path / f"mine{suffix}"
    (io.dump_csv if suffix == ".csv" else io.dump_json)(built, path)
    _, expected, _ = cli(
        capsys, "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8", "--json"
    )
    code, out, err = cli(capsys, "--schedule-file", str(path), "--json")
    assert code == 0, err
    mine, ref = json.loads(out), json.loads(expected)
    assert mine.pop("schedule") == ("mine" if suffix == ".csv" else "zb-h1")
    ref.pop("schedule")
    assert mine == ref


def test_schedule_file_that_deadlocks_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")
    code, out, err = cli(capsys, "--schedule-file", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "bad" in err
    code, _, err = cli(capsys, "--schedule-file", str(path), "--pp", "3")
    assert code == 2 and "2 rows but 3 ranks" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule", "1f1b", "--pp", "4", "--microbatches", "2"], "microbatches"),
        (["--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--costs", "F=x"], "--costs"),
        (["--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--costs", "Q=1"], "--costs"),
        (["--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--plot", "a.jpg"], "--plot"),
        (["--schedule", "gpipe", "--pp", "2"], "--microbatches"),
        (["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--chunks", "2"], "--chunks"),
        (["--schedule", "gpipe", "--pp", "0", "--microbatches", "2"], "--pp"),
        (["--schedule-file", "nowhere.csv"], "nowhere.csv"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and message in err


def test_a_real_process_exits_2_with_one_line_and_no_traceback() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipetrain.cli",
            "simulate",
            "--schedule",
            "nope",
            "--pp",
            "2",
            "--microbatches",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr
    assert "'nope' is not a known schedule" in proc.stderr
    assert all(name in proc.stderr for name in registry.SCHEDULE_NAMES)


def test_a_closed_pipe_is_not_a_traceback() -> None:
    """`pipetrain simulate --ascii | head -1`: the reader leaves early; no traceback.

    The pipe is shrunk to one page so that the grid (about 10 kB) cannot fit in it: the
    child's write fails for real once the reader has gone.
    """
    import fcntl

    read_fd, write_fd = os.pipe()
    fcntl.fcntl(read_fd, fcntl.F_SETPIPE_SZ, 4096)
    args = [
        "simulate",
        "--schedule",
        "1f1b",
        "--pp",
        "8",
        "--microbatches",
        "64",
        "--ascii",
        "--width",
        "2000",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipetrain.cli", *args],
        stdout=write_fd,
        stderr=subprocess.PIPE,
    )
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        reader.readline()
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 141)
    assert "Traceback" not in stderr


def test_shard_adds_the_gathers_and_reduce_scatters(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--weight-bytes", "100"]
    code, out, err = cli(capsys, *flags, "--dp", "2", "--dp-bandwidth", "50", "--shard", "--json")
    assert code == 0, err
    data = json.loads(out)
    # The pipeline's own numbers stay those without dp; the gathers and reduce-scatters
    # (50 bytes each at 50 per unit) are added on top: rank 0's gather holds its F0 to 1.
    assert data["makespan"] == 9
    assert data["data_parallel"] == {
        "dp": 2,
        "sharded": True,
        "bytes_per_rank": [100.0, 100.0],
        "traffic_per_rank": [100.0, 100.0],
        "all_gather_traffic_per_rank": [50.0, 50.0],
        "reduce_scatter_traffic_per_rank": [50.0, 50.0],
        "all_gather_time": [1.0, 1.0],
        "reduce_scatter_time": [1.0, 1.0],
        "gather_delay": 1.0,
        "step_time": 11.0,
        "exposed": 2.0,
    }
    code, out, err = cli(capsys, *flags, "--dp", "2", "--dp-bandwidth", "50", "--shard")
    assert code == 0, err
    assert "dp=2 sharded        100 100 bytes per rank all-gathered and reduce-scattered" in out
    assert "step 11 (2 past the pipeline, 1 of it first forwards waiting for gathers)" in out
    code, out, err = cli(capsys, *flags, "--dp", "2", "--shard")
    assert code == 0, err
    assert "all-gather time" not in out  # bytes only without --dp-bandwidth


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shard"], "--shard shards stages over dp replicas: add --dp 2"),
        (
            ["--shard", "--dp", "2", "--schedule", "chimera"],
            "sharded stages do not fit 'chimera', which replicates stages",
        ),
        (["--shard", "--dp", "2", "--compare"], "drop --compare"),
        (["--shard", "--dp", "2", "--dp-bandwidth", "0"], "bandwidth is 0.0: give a positive"),
        (["--dp", "2", "--dp-bandwidth", "0"], "bandwidth is 0.0: give a positive"),
    ],
)
def test_bad_shard_options_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    base = ["--pp", "2", "--microbatches", "2", "--weight-bytes", "100"]
    if "--schedule" not in flags and "--compare" not in flags:
        base += ["--schedule", "1f1b"]
    code, _out, err = cli(capsys, *base, *flags)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_torchrun_rank_ends_without_finalization() -> None:
    # A rank of a torchrun launch ends through process_exit.exit_rank (gloo's threads can
    # abort a finalizing interpreter): its output and status survive, atexit handlers do
    # not run. Outside a launch the interpreter finalizes as usual.
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('finalized'))\n"
        "from pipetrain.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    launched = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    plain = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    args = ["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--json"]
    for env, finalized in ((launched, False), (plain, True)):
        ok = subprocess.run(
            [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60
        )
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout.split("finalized")[0])["schedule"] == "1f1b"
        assert ("finalized" in ok.stdout) == finalized
        bad = subprocess.run(
            [sys.executable, "-c", code, *args[:-2], "0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr


def test_outputs_never_land_on_each_other_or_on_the_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --trace wrote JSON to any name: over the --save of the same run, over the schedule
    # file it had just read (--trace my.csv), over a picture; all with exit status 0.
    base = ["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2"]
    mine = tmp_path / "my.csv"
    assert main([*base, "--save", str(mine)]) == 0
    kept = mine.read_text()
    for extra, said in [
        (["--save", str(tmp_path / "s.json"), "--trace", str(tmp_path / "s.json")],
         "is the file of --save too"),
        (["--trace", str(mine)], "use a .json file name"),
        (["--trace", str(tmp_path / "p.png")], "use a .json file name"),
    ]:  # fmt: skip
        assert main([*base, *extra]) == 2
        assert said in capsys.readouterr().err
    assert main(["simulate", "--schedule-file", str(mine), "--save", str(mine)]) == 2
    assert "is the file of --schedule-file too" in capsys.readouterr().err
    assert mine.read_text() == kept and not (tmp_path / "s.json").exists()


def test_early_grads_shows_the_schedule_the_trainer_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = cli(capsys, "--schedule", "1f1b", "--pp", "4", "--microbatches", "8")
    assert code == 0 and "makespan            33" in out and " I7 " not in out
    code, out, _ = cli(
        capsys, "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--early-grads"
    )
    assert code == 0 and "makespan            30" in out
    assert "F7 I7 W7" in out  # the last stage's last backward, split


def test_early_grads_is_refused_for_a_schedule_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "s.csv"
    assert (
        cli(capsys, "--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--save", str(path))[
            0
        ]
        == 0
    )
    code, out, err = cli(capsys, "--schedule-file", str(path), "--early-grads")
    assert (code, out, err.count("\n")) == (2, "", 1)
    assert "--early-grads changes a built-in schedule" in err


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
