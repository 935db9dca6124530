"""`pipetrain train` end to end: a short run on the default data, its outputs, and the
loss-independence matrix (per-step losses equal to 1e-5 relative against --pp 1).

Few launches: the tiny model, 5 steps, small batches. The single-process cases run the
CLI in this process; the multi-process ones go through the real launcher. Outputs and a
config file that cannot be used are one line and exit status 2 before any training.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cli_errors import one_line_error as _one_line_error
from local_port import reserved_port
from run_records import read_records

from pipetrain.cli import main

pytestmark = pytest.mark.e2e

# The tiny model on a small slice of the default corpus: seconds per run.
TINY = [
    "--model", "llama-tiny", "--steps", "5", "--batch-size", "8", "--seq-len", "32",
    "--microbatches", "4", "--set", "data.max_bytes=100000", "--set", "optim.warmup_steps=1",
    "--set", "run.sample_tokens=0", "--set", "data.eval_batches=1", "--set", "pipeline.threads=1",
]  # fmt: skip


def _cli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`pipetrain ...` as a user runs it; a timeout takes every process it started down."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipetrain.cli", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _steps(path: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(path) if "loss" in r]


def _train_here(out_dir: Path, name: str, *flags: str) -> list[dict[str, Any]]:
    """`pipetrain train` in this process (no launch): the per-step records of the run."""
    code = main(
        ["train", *TINY, *flags, "--name", name, "--set", f"run.out_dir={json.dumps(str(out_dir))}"]
    )
    assert code == 0
    return _steps(out_dir / name / "metrics.jsonl")


def _assert_same_steps(got: list[dict[str, Any]], want: list[dict[str, Any]], what: str) -> None:
    """Per-step loss and global grad norm equal to 1e-5 relative."""
    assert len(got) == len(want) == 5, what
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (
                f"{what}: step {step + 1} {key} {a[key]} vs {b[key]} with --pp 1"
            )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Per-step records of --pp 1, the one-process reference."""
    out = tmp_path_factory.mktemp("ref")
    return _train_here(out, "ref", "--pp", "1")


def test_short_run_on_the_default_data(reference: list[dict[str, Any]], tmp_path: Path) -> None:
    """Two processes through the launcher: outputs, and the same losses as --pp 1."""
    done = _cli(
        "train", *TINY, "--pp", "2", "--name", "e2e", "--set", "run.sample_tokens=16",
        "--timeline", "step.png",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "e2e"
    # The resolved config is printed and saved, and reads back.
    saved = (run_dir / "config.toml").read_text()
    assert saved in done.stdout
    assert 'name = "llama-tiny"' in saved and "pp = 2" in saved
    records = read_records(run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    _assert_same_steps(steps, reference, "--pp 2")
    for r in steps:
        for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "bubble"):
            assert isinstance(r[key], (int, float)), (key, r)
        assert r["tokens"] == 8 * 32 and r["step_time_s"] > 0
        assert 0.0 <= r["bubble"] < 1.0
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 5]
    summary = records[-1]
    assert summary["summary"] is True and len(summary["peak_memory"]) == 2
    assert summary["measured_bubble"] is not None and summary["simulated_bubble"] is not None
    # Plain lines (stdout is not a terminal), the summary, the sample; rank 1 stays quiet.
    assert "\r" not in done.stdout
    assert "step 5/5  loss" in done.stdout
    # 1F1B's last backward on the last stage sends its input gradient before its weights'.
    assert "early input gradients: 1 backward run as I then W (1I3;" in done.stdout
    assert "Python" in done.stdout and "standard library" in done.stdout
    assert "peak memory per rank:" in done.stdout and "sample (temperature" in done.stdout
    assert (tmp_path / "step.png").stat().st_size > 1000
    assert done.stdout.count("eval loss after 5 steps") == 1


@pytest.mark.parametrize(
    "flags",
    [
        ("--pp", "2", "--single-process"),
        ("--pp", "2", "--single-process", "--schedule", "gpipe"),
        ("--pp", "2", "--single-process", "--schedule", "interleaved-1f1b", "--chunks", "2"),
        ("--pp", "4", "--single-process", "--schedule", "zb-h1"),
        ("--pp", "2", "--single-process", "--schedule", "zb-v"),
        ("--pp", "2", "--single-process", "--schedule", "v-min"),
        ("--pp", "2", "--single-process", "--recompute"),
        ("--pp", "4", "--single-process", "--recompute-ranks", "0,2"),
        ("--pp", "4", "--single-process", "--no-early-grads"),
    ],
    ids=lambda flags: " ".join(flags),
)
def test_loss_does_not_depend_on_the_split_in_one_process(
    reference: list[dict[str, Any]], tmp_path: Path, flags: tuple[str, ...]
) -> None:
    _assert_same_steps(_train_here(tmp_path, "x", *flags), reference, " ".join(flags))


def test_split_by_hand_chooses_the_stages_and_keeps_the_losses(
    reference: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    got = _train_here(tmp_path, "s", "--pp", "2", "--single-process", "--split", "1,3")
    # Embedding + 1 block, then 3 blocks + head (llama-tiny has 4 blocks).
    assert "split [2, 4] layers" in capsys.readouterr().out
    _assert_same_steps(got, reference, "--split 1,3")
    for flags, line in (
        (
            ["--split", "1,2"],
            "pipeline.split: --split 1,2 adds up to 3 blocks but the model has 4: make the "
            "counts sum to 4",
        ),
        (
            ["--split", "2,2", "--balance", "params"],
            "pipeline.split '2,2' and pipeline.balance 'params' both choose the split: drop "
            "one of --split and --balance",
        ),
        (["--balance", "flops"], "pipeline.balance is 'flops': use one of uniform, params, cost"),
    ):
        assert main(["train", *TINY, "--pp", "2", *flags, "--name", "bad"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"pipetrain train: error: {line}"), err


def test_bf16_stays_close_to_fp32(reference: list[dict[str, Any]], tmp_path: Path) -> None:
    flags = ["--pp", "2", "--single-process", "--precision", "bf16"]
    losses = [r["loss"] for r in _train_here(tmp_path, "x", *flags)]
    fp32 = [r["loss"] for r in reference]
    assert len(losses) == 5
    for step, (a, b) in enumerate(zip(losses, fp32, strict=True)):
        # bf16 keeps 8 bits of mantissa: about 0.4% per rounding; the loss stays within 1%.
        assert abs(a - b) <= 0.01 * b, f"bf16 step {step + 1}: {a} vs fp32 {b}"
    assert losses != fp32  # bf16 did run: the numbers are not fp32's


@pytest.mark.parametrize(
    "flags",
    [
        ("--pp", "2", "--schedule", "interleaved-1f1b", "--chunks", "2"),
    ],
    ids=lambda flags: " ".join(flags),
)
def test_loss_does_not_depend_on_the_split_across_processes(
    reference: list[dict[str, Any]], tmp_path: Path, flags: tuple[str, ...]
) -> None:
    done = _cli("train", *TINY, *flags, "--name", "x", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_steps(
        _steps(tmp_path / "runs" / "x" / "metrics.jsonl"), reference, " ".join(flags)
    )


def test_bad_setting_is_one_line_before_any_process_starts(tmp_path: Path) -> None:
    done = _cli("train", "--pp", "2", "--microbatches", "5", cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "data.batch_size 32 is not a multiple of pipeline.microbatches 5" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_a_run_does_not_replace_an_earlier_runs_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = json.dumps(str(tmp_path / "runs"))
    again = ["train", *TINY, "--steps", "2", "--name", "mine", "--set", f"run.out_dir={out}"]
    assert main(again) == 0
    run_dir = tmp_path / "runs" / "mine"
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    config = (run_dir / "config.toml").read_bytes()
    assert metrics
    capsys.readouterr()
    # In this process (one rank), then through the launcher (refused before any rank starts).
    assert main(again) == 2
    assert "already holds an earlier run's metrics: pass --resume" in capsys.readouterr().err
    done = _cli(*again, "--pp", "2", cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert f"run.metrics '{run_dir / 'metrics.jsonl'}' already holds" in done.stderr
    # A folder where the metrics file goes was "an earlier run's metrics".
    assert main([*again, "--metrics", str(run_dir)]) == 2
    assert f"run.metrics '{run_dir}' is a directory" in capsys.readouterr().err
    # Metrics sent elsewhere still replaced the earlier run's config.toml next to its metrics.
    assert main([*again, "--metrics", str(tmp_path / "elsewhere.jsonl")]) == 2
    assert "whose config.toml this run would replace" in capsys.readouterr().err
    assert not (tmp_path / "elsewhere.jsonl").exists()
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert (run_dir / "config.toml").read_bytes() == config
    # A --resume with nothing to resume from (restarted before the first save) trains from
    # step 0, as documented; it appended a second trajectory to the earlier records,
    # which now move to a file of their own.
    assert main([*again, "--resume", "--checkpoint-dir", str(tmp_path / "none")]) == 0
    assert "so this run starts from step 0; the metrics already in" in capsys.readouterr().out
    (aside,) = run_dir.glob("metrics.before-*.jsonl")
    assert aside.read_bytes() == metrics
    assert [r["step"] for r in _steps(run_dir / "metrics.jsonl")] == [1, 2]


def _torchrun_nodes(
    tmp_path: Path, flags: list[list[str]], cwds: list[Path] | None = None
) -> list[tuple[int, str, str]]:
    """Two torchrun "nodes" of one process each on this machine, node i started with
    ``flags[i]`` in ``cwds[i]`` (default ``tmp_path``); (exit status, stdout, stderr) of each."""
    with reserved_port() as port:
        return _start_nodes(cwds or [tmp_path, tmp_path], flags, port)


def _start_nodes(cwds: list[Path], flags: list[list[str]], port: int) -> list[tuple[int, str, str]]:
    nodes = []
    for node in range(2):
        # torchrun's options first, then the module and its own options: after the module
        # name nothing is read as (an abbreviation of) a torchrun option.
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "pipetrain.cli", "train", *flags[node],
        ]  # fmt: skip
        pipe = subprocess.PIPE
        nodes.append(
            subprocess.Popen(
                command, cwd=cwds[node], stdout=pipe, stderr=pipe, text=True, start_new_session=True
            )
        )
    outputs = []
    try:
        for proc in nodes:
            outputs.append(proc.communicate(timeout=240))
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return [(proc.returncode, out, err) for proc, (out, err) in zip(nodes, outputs, strict=True)]


def test_two_torchrun_nodes_on_loopback(reference: list[dict[str, Any]], tmp_path: Path) -> None:
    """Two torchrun "nodes" of one process each make one 2-stage pipeline."""
    flags = [*TINY, "--pp", "2", "--name", "nodes"]
    ran = _torchrun_nodes(tmp_path, [flags, flags])
    for code, _, err in ran:
        assert code == 0, err[-3000:]
    outputs = [(out, err) for _, out, err in ran]
    # Rank 0 (node 0) reports; node 1 stays quiet.
    assert "step 5/5" in outputs[0][0] and "step " not in outputs[1][0]
    records = read_records(tmp_path / "runs" / "nodes" / "metrics.jsonl")
    _assert_same_steps([r for r in records if "loss" in r], reference, "two nodes")
    assert len(records[-1]["peak_memory"]) == 2


def test_torchrun_nodes_started_with_different_settings_stop_with_one_line(
    tmp_path: Path,
) -> None:
    """Node 1 started with another seed would feed the last stage targets that do not
    belong to the first stage's inputs: both processes refuse before the first step."""
    flags = [*TINY, "--pp", "2"]  # default run names: each node stamps its own second
    started = time.monotonic()
    ran = _torchrun_nodes(tmp_path, [flags, [*flags, "--set", "run.seed=3"]])
    assert time.monotonic() - started < 120
    problem = "run.seed is 0 on rank 0 but 3 on rank 1"
    for code, _, err in ran:
        assert code != 0
        (line,) = [line for line in err.splitlines() if problem in line]
        assert line.startswith("pipetrain train: error: the processes of this run were started"), (
            line
        )
        assert line.endswith("start every process with the same --config file and flags"), line
        assert "Traceback" not in err.split(problem)[0][-2000:]
    assert not list(tmp_path.glob("runs/*/metrics.jsonl"))


def test_torchrun_nodes_whose_schedule_files_differ_stop_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same flags, --schedule mine.csv, but each node's file holds another order
    (1F1B's on node 0, GPipe's on node 1): the settings agree, the pipelines do not, and
    training on would wait at the first message that one side never sends."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for folder, schedule in zip(nodes, ("1f1b", "gpipe"), strict=True):
        folder.mkdir()
        argv = ["simulate", "--schedule", schedule, "--pp", "2", "--microbatches", "4"]
        assert main([*argv, "--save", str(folder / "mine.csv")]) == 0
    capsys.readouterr()
    flags = [*TINY, "--pp", "2", "--schedule", "mine.csv", "--name", "files"]
    ran = _torchrun_nodes(tmp_path, [flags, flags], cwds=nodes)
    problem = (
        "pipetrain train: error: the schedule file 'mine.csv' holds other actions on rank 1 "
        "than on rank 0: give every node the same file"
    )
    for code, _, err in ran:
        assert code != 0, err[-3000:]  # torchrun exits 1 whatever its process said
        assert problem in err.splitlines(), err[-3000:]
    assert not list(tmp_path.glob("node*/runs/*/metrics.jsonl"))


def test_torchrun_nodes_that_read_other_text_stop_with_one_line(tmp_path: Path) -> None:
    """The same --data data, but each node's folder holds other text: the last stage
    (node 1) would learn targets that do not follow the first stage's inputs."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for folder, word in zip(nodes, ("return", "yield"), strict=True):
        (folder / "data").mkdir(parents=True)
        for i in range(4):
            (folder / "data" / f"doc{i}.txt").write_text(f"def f(x): {word} x + {i}\n" * 300)
    flags = [*TINY, "--pp", "2", "--data", "data", "--name", "texts"]
    ran = _torchrun_nodes(tmp_path, [flags, flags], cwds=nodes)
    for code, _, err in ran:
        assert code != 0, err[-3000:]  # torchrun exits 1 whatever its process said
        (line,) = [line for line in err.splitlines() if line.startswith("pipetrain train:")]
        assert line.startswith("pipetrain train: error: rank 1 read other data than rank 0 ("), line
        assert "from the same data.path: give every node the same files" in line, line
    assert not list(tmp_path.glob("node*/runs/*/metrics.jsonl"))


def test_a_node_that_cannot_start_stops_the_others_at_once(tmp_path: Path) -> None:
    """Node 1's data file is missing: node 0 would wait for it in the rendezvous until
    the timeout (300 s); it stops within seconds, with node 1's reason."""
    flags = [*TINY, "--pp", "2", "--name", "gone"]
    started = time.monotonic()
    ran = _torchrun_nodes(tmp_path, [flags, [*flags, "--data", str(tmp_path / "missing.txt")]])
    assert time.monotonic() - started < 90
    assert all(code != 0 for code, _, _ in ran)
    missing = f"data.path {str(tmp_path / 'missing.txt')!r} does not exist"
    (line,) = [line for line in ran[0][2].splitlines() if line.startswith("pipetrain train:")]
    assert line.startswith("pipetrain train: error: rank 1 (on "), line
    assert f"could not start: {missing}" in line, line
    assert f"pipetrain train: error: {missing}" in ran[1][2]


def test_a_first_node_that_cannot_start_stops_the_others_too(tmp_path: Path) -> None:
    """Node 0's launcher hosts the run's store and ends with its failed process. Node 1
    reads node 0's reason if it gets there first, else says that the launcher ended,
    instead of retrying the store until the timeout."""
    flags = [*TINY, "--pp", "2", "--name", "gone"]
    started = time.monotonic()
    ran = _torchrun_nodes(tmp_path, [[*flags, "--data", str(tmp_path / "missing.txt")], flags])
    assert time.monotonic() - started < 90
    assert all(code != 0 for code, _, _ in ran)
    (line,) = [line for line in ran[1][2].splitlines() if line.startswith("pipetrain train:")]
    missing = f"data.path {str(tmp_path / 'missing.txt')!r} does not exist"
    reason = (
        f"pipetrain train: error: rank 0 (on {socket.gethostname()}) could not start: {missing}"
    )
    ended = "pipetrain train: rank 1: the run's launcher at 127.0.0.1:"
    assert line.startswith((reason, ended)), line
    assert line.startswith(reason) or "the first node's launcher has ended" in line, line


def test_non_finite_gradients_stop_every_rank_with_one_line(tmp_path: Path) -> None:
    """A learning rate of 1e8 blows the gradients up: both ranks skip, then stop alike."""
    done = _cli(
        "train", *TINY, "--pp", "2", "--lr", "1e8", "--set", "optim.grad_clip=0.0",
        "--set", "optim.warmup_steps=0", "--set", "optim.max_bad_steps=2", "--name", "nan",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1
    stop = (
        "step 3: loss or gradients were not finite for 2 steps in a row (optim.max_bad_steps = 2)"
    )
    for rank in range(2):
        assert f"pipetrain train (rank {rank}): {stop}" in done.stderr, done.stderr[-3000:]
    assert "pipetrain train: rank " in done.stderr and "exited with status 1 first" in done.stderr
    assert "Traceback" not in done.stderr
    steps = _steps(tmp_path / "runs" / "nan" / "metrics.jsonl")
    assert [r["skipped"] for r in steps] == [False, True]
    assert steps[1]["grad_norm"] is None  # not finite: written as null


def test_gradient_accumulation_takes_several_pipeline_steps_per_update(tmp_path: Path) -> None:
    flags = ["--pp", "2", "--single-process", "--grad-accum", "3", "--steps", "2"]
    steps = _train_here(tmp_path, "acc", *flags)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["tokens"] == 3 * 8 * 32 for r in steps)
    assert all(r["grad_norm"] > 0 and not r["skipped"] for r in steps)


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
