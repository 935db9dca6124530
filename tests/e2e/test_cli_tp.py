"""`pipetrain train --tp`: pp=2 x tp=2 through the real launcher (4 processes) equals one
process on the full batch, with and without sequence parallelism, and its checkpoints
resume under (pp=2, tp=1), (pp=1, tp=2) and (pp=4) with the same next losses; `ckpt
export` writes the whole weights; bad tensor-parallel settings are one line, exit 2,
before any process starts (under torchrun too, for a mesh that is not the world size).

Seven launches in all: the one-process reference, pp2 x tp2 (saving at step 2, with a
timeline and a closing sample that `generate` from its checkpoint repeats), pp2 x tp2
with --sequence-parallel, pp2 x dp2 x tp2 on 8 processes (3 steps), and the three
resumes from its step 2.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from run_records import assert_same_steps as _assert_losses
from run_records import losses as _losses
from run_records import read_records, train_run

from pipetrain.checkpoint import read_manifest
from pipetrain.cli import main

pytestmark = pytest.mark.e2e

TINY = [
    "--model", "llama-tiny", "--steps", "4", "--batch-size", "8", "--seq-len", "16",
    "--microbatches", "4", "--eval-every", "0", "--set", "data.max_bytes=100000",
    "--set", "optim.warmup_steps=1", "--set", "run.sample_tokens=0",
    "--set", "data.eval_batches=1",
]  # fmt: skip


def _train(out: Path, name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return train_run(out, name, *TINY, *flags)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def reference(out: Path) -> dict[int, float]:
    """One process, one stage, the full batch."""
    code = main(
        [
            "train",
            *TINY,
            "--pp",
            "1",
            "--name",
            "ref",
            "--set",
            f"run.out_dir={json.dumps(str(out))}",
        ]
    )
    assert code == 0
    return _losses(out / "ref")


@pytest.fixture(scope="module")
def pp2_tp2(out: Path) -> subprocess.CompletedProcess[str]:
    # Also the timeline of the last step and a greedy closing sample (gathered from the
    # shards), which `generate` from its last checkpoint must repeat.
    return _train(
        out, "pp2tp2", "--pp", "2", "--tp", "2",
        "--checkpoint-dir", str(out / "ckpt_pp2tp2"), "--checkpoint-every", "2",
        "--timeline", str(out / "pp2tp2_timeline.json"),
        "--set", "run.sample_tokens=12", "--set", "run.sample_temperature=0",
    )  # fmt: skip


def test_pp2_tp2_starts_4_processes_and_equals_one_process(
    out: Path, reference: dict[int, float], pp2_tp2: subprocess.CompletedProcess[str]
) -> None:
    _assert_losses(_losses(out / "pp2tp2"), reference, [1, 2, 3, 4], "pp=2 tp=2")
    summary = next(r for r in read_records(out / "pp2tp2") if r.get("summary"))
    assert len(summary["peak_memory"]) == 4  # one entry per process
    layout = read_manifest(out / "ckpt_pp2tp2" / "step_000002").layout
    assert (layout.pp, layout.tp, layout.world_size) == (2, 2, 4)


def test_sequence_parallel_equals_one_process(out: Path, reference: dict[int, float]) -> None:
    _train(out, "sp", "--pp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "zb-h1")
    _assert_losses(_losses(out / "sp"), reference, [1, 2, 3, 4], "pp=2 tp=2 sequence-parallel")


def test_pp2_dp2_tp2_on_8_processes_equals_one_process(
    out: Path, reference: dict[int, float]
) -> None:
    # The 3-D mesh whole: 2 replicas of a 2-stage pipeline whose layers span 2 processes.
    _train(out, "pp2dp2tp2", "--pp", "2", "--dp", "2", "--tp", "2", "--steps", "3")
    _assert_losses(_losses(out / "pp2dp2tp2"), reference, [1, 2, 3], "pp=2 dp=2 tp=2")


@pytest.mark.parametrize(
    ("name", "layout"),
    [("pp2", ["--pp", "2"]), ("pp1tp2", ["--pp", "1", "--tp", "2"]), ("pp4", ["--pp", "4"])],
)
def test_a_tp_checkpoint_resumes_under_another_layout(
    out: Path,
    reference: dict[int, float],
    pp2_tp2: subprocess.CompletedProcess[str],
    name: str,
    layout: list[str],
) -> None:
    ckpt = out / f"ckpt_{name}"
    ckpt.mkdir()
    shutil.copytree(out / "ckpt_pp2tp2" / "step_000002", ckpt / "step_000002")
    result = _train(out, name, *layout, "--checkpoint-dir", str(ckpt), "--resume")
    assert "at step 2" in result.stdout, result.stdout[-2000:]
    assert "saved with pp=2 tp=2" in result.stdout, result.stdout[-2000:]
    _assert_losses(_losses(out / name), reference, [3, 4], f"{name} resumed from pp=2 tp=2")


def test_export_of_a_tp_checkpoint_holds_the_whole_weights(
    out: Path, pp2_tp2: subprocess.CompletedProcess[str]
) -> None:
    from pipetrain.checkpoint.safetensors_io import read_safetensors

    target = out / "export.safetensors"
    step = out / "ckpt_pp2tp2" / "step_000004"
    assert main(["ckpt", "export", str(step), "--out", str(target)]) == 0
    weights, _ = read_safetensors(target)
    assert tuple(weights["embed.tok.weight"].shape) == (256, 32)  # the whole vocabulary
    assert tuple(weights["layers.0.attn.wq.weight"].shape) == (32, 32)
    assert tuple(weights["layers.0.mlp.w2.weight"].shape) == (32, 64)


def test_timeline_sample_and_generate_under_tp(
    out: Path, pp2_tp2: subprocess.CompletedProcess[str], capsys: pytest.CaptureFixture[str]
) -> None:
    trace = out / "pp2tp2_timeline.json"
    assert f"measured timeline of the last step written to {trace}" in pp2_tp2.stdout
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    # The pipeline of tp rank 0: both stages ran every micro-batch forward and backward.
    for kinds in (("F",), ("B", "I")):
        done = {(e["tid"], e["args"]["microbatch"]) for e in events if e["args"]["kind"] in kinds}
        assert done == {(rank, mb) for rank in (0, 1) for mb in range(4)}, kinds
    sample = pp2_tp2.stdout.split("sample (temperature 0.0):\n")[1].splitlines()[0]
    assert sample.startswith("def ") and len(sample) > len("def "), pp2_tp2.stdout[-1000:]
    flags = ["--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0", "--pp", "2"]
    assert main(["generate", "--checkpoint", str(out / "ckpt_pp2tp2"), *flags]) == 0
    assert capsys.readouterr().out == sample + "\n"


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--tp", "3"], "pipeline.tp is 3 but the model's n_heads is 4"),
        (
            ["--tp", "2", "--pp", "2", "--single-process"],
            "pipeline.tp splits each layer over processes",
        ),
        (["--sequence-parallel"], "pipeline.sequence_parallel splits the sequence over"),
        (["--tp", "2", "--schedule", "pipedream"], "pipeline.tp 2: the asynchronous trainer"),
        (
            ["--tp", "2", "--sequence-parallel", "--model", "gpt2-tiny"],
            "pipeline.sequence_parallel is not supported with gpt2",
        ),
    ],
)
def test_bad_tensor_parallel_settings_are_one_line_and_exit_2(
    out: Path, flags: list[str], line: str
) -> None:
    command = [
        sys.executable,
        "-m",
        "pipetrain.cli",
        "train",
        *TINY,
        *flags,
        "--set",
        f"run.out_dir={json.dumps(str(out / 'bad'))}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [e for e in result.stderr.splitlines() if e.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"pipetrain train: error: {line}"), errors


def test_a_mesh_that_is_not_the_world_size_under_torchrun_is_one_line_and_exit_2(
    out: Path,
) -> None:
    # Rank 1 of 2 processes that torchrun started (its agent hosts the store), asked for
    # pp 2 x dp 2 x tp 2 = 8: refused before it joins a process group. A process of its
    # own: a launched rank ends without the interpreter's finalization.
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
    env = {
        **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "1",
        "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "tp-world",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }  # fmt: skip
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", *TINY, "--pp", "2", "--dp", "2",
        "--tp", "2", "--set", f"run.out_dir={json.dumps(str(out / 'world'))}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        "pipetrain train: error: 2 processes were started but pipeline.pp x pipeline.dp x "
        "pipeline.tp is 8: start 8 processes in all (torchrun --nnodes x --nproc-per-node) "
        "or change --pp/--dp/--tp"
    ]
    # The other process hears of it through the store instead of waiting for this one.
    assert store.add("pipetrain/start/0/failed", 0) == 1
    assert json.loads(store.get("pipetrain/start/0/1"))["input"] is True
