"""Checkpoints through ``pipetrain train`` (2 local processes): exact resume, SIGTERM,
and a resume under another layout that skips a damaged newest checkpoint.

In this process (main(argv)): a used --checkpoint-dir is refused without --resume, a
resume past the run's steps or from only damaged checkpoints is one line, a resumed run
keeps its metrics and a finished one has nothing to train; an asynchronous run resumed
between streams of another length names a stream length that fits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipetrain.checkpoint import list_checkpoints, read_manifest, read_weights
from pipetrain.cli import main

pytestmark = pytest.mark.e2e

TINY = [
    "--model", "llama-tiny", "--steps", "4", "--batch-size", "4", "--microbatches", "2",
    "--seq-len", "16", "--eval-every", "0", "--set", "run.sample_tokens=0",
    "--set", "optim.warmup_steps=1",
]  # fmt: skip


def train_command(work: Path, name: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "pipetrain.cli", "train", *TINY, "--data", str(work / "data"),
        "--name", name, "--set", f"run.out_dir={work / 'runs'}", *extra,
    ]  # fmt: skip


def run_train(work: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        train_command(work, name, *extra), capture_output=True, text=True, timeout=240, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def losses(work: Path, name: str) -> dict[int, float]:
    lines = (work / "runs" / name / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def full(work: Path) -> Path:
    """4 steps on 2 processes, a checkpoint every 2: the reference run."""
    full = work / "ckpt_full"
    run_train(work, "full", "--pp", "2", "--checkpoint-dir", str(full), "--checkpoint-every", "2")
    return full


def test_k_steps_then_resume_k_equals_2k_steps_bit_for_bit(work: Path, full: Path) -> None:
    assert [s for s, _ in list_checkpoints(full).complete] == [2, 4]
    manifest = read_manifest(full / "step_000002")
    assert manifest.trainer == {"step": 2, "data_position": 2}
    assert manifest.layout.pp == 2 and manifest.layout.schedule == "1f1b"
    assert manifest.config["run"]["steps"] == 4

    # The second run starts from the first run's step 2, as a run stopped there would.
    resumed = work / "ckpt_resumed"
    resumed.mkdir()
    shutil.copytree(full / "step_000002", resumed / "step_000002")
    result = run_train(work, "resumed", "--pp", "2", "--checkpoint-dir", str(resumed), "--resume")
    assert f"resumed from {resumed / 'step_000002'} at step 2" in result.stdout
    expected = losses(work, "full")
    got = losses(work, "resumed")
    assert sorted(got) == [3, 4]
    assert got == {3: expected[3], 4: expected[4]}  # bit-exact
    a, _ = read_weights(full / "step_000004")
    b, _ = read_weights(resumed / "step_000004")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_in_one_process_falls_back_past_a_damaged_checkpoint(work: Path, full: Path) -> None:
    other = work / "ckpt_other"
    shutil.copytree(full, other)
    victim = other / "step_000004" / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = run_train(work, "other", "--pp", "1", "--checkpoint-dir", str(other), "--resume")
    assert f"{victim}: sha256 differs from the manifest" in result.stderr
    assert f"falling back to {other / 'step_000002'}" in result.stderr
    assert f"resumed from {other / 'step_000002'} at step 2" in result.stdout
    assert "saved with pp=2" in result.stdout
    expected, got = losses(work, "full"), losses(work, "other")
    # One stage instead of two: the same computation, sums in another order.
    assert got[3] == pytest.approx(expected[3], rel=1e-5)
    assert got[4] == pytest.approx(expected[4], rel=1e-5)


def test_sigterm_finishes_the_step_saves_and_exits_0(work: Path) -> None:
    ckpt = work / "ckpt_term"
    command = train_command(work, "term", "--pp", "2", "--checkpoint-dir", str(ckpt))
    command[command.index("--steps") + 1] = "100000"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    metrics = work / "runs" / "term" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and '"loss"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, err[-3000:]
    done = max(losses(work, "term"))
    assert [s for s, _ in list_checkpoints(ckpt).complete] == [done]
    assert f"stop signal: finished step {done} and stopped" in out
    assert "stopped by signal SIGTERM" in err


def test_resume_of_another_model_is_refused_in_one_line(
    work: Path, full: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = train_command(work, "other_model", "--pp", "1", "--checkpoint-dir", str(full))
    argv[argv.index("--model") + 1] = "gpt2-tiny"
    code = main([*argv[argv.index("train") :], "--resume"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        f"pipetrain train: error: {full / 'step_000004'} holds a model with family='llama' but "
        "this run has family='gpt2'; use the checkpoint's model settings or another "
        "checkpoint directory"
    ]


def test_resume_after_a_crash_keeps_one_trajectory_in_the_metrics(
    work: Path, full: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The earlier attempt wrote steps 3 and 4 after its last checkpoint (step 2), then
    died: the resumed run writes them again, and the earlier ones move aside."""
    ckpt = work / "ckpt_crashed"
    ckpt.mkdir()
    shutil.copytree(full / "step_000002", ckpt / "step_000002")
    run_dir = work / "runs" / "crashed"
    run_dir.mkdir(parents=True)
    earlier = (work / "runs" / "full" / "metrics.jsonl").read_text().splitlines(keepends=True)
    # A crash in the middle of a line leaves it cut short.
    (run_dir / "metrics.jsonl").write_text("".join(earlier) + '{"step": 5, "lo')
    argv = train_command(work, "crashed", "--pp", "1", "--checkpoint-dir", str(ckpt), "--resume")
    assert main(argv[argv.index("train") :]) == 0
    out = capsys.readouterr().out
    (aside,) = run_dir.glob("metrics.superseded-*.jsonl")
    records = [json.loads(line) for line in earlier]
    first_past = next(i for i, r in enumerate(records) if r.get("step", 0) > 2)
    moved = len(earlier) - first_past + 1
    assert f"note: resuming from step 2; the {moved} metrics records that the earlier " in out
    assert aside.read_text() == "".join(earlier[first_past:]) + '{"step": 5, "lo'
    now = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert now[:first_past] == records[:first_past]
    assert [r["step"] for r in now if "loss" in r] == [1, 2, 3, 4]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_train_refuses_a_used_directory_without_resume_and_resume_keeps_the_metrics(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = work / "ckpt_train"
    argv = [
        "train", "--model", "llama-tiny", "--pp", "1", "--steps", "2", "--batch-size", "2",
        "--microbatches", "1", "--seq-len", "8", "--eval-every", "0",
        "--set", "run.sample_tokens=0", "--set", "optim.warmup_steps=0",
        "--data", str(work / "data"), "--set", f"run.out_dir={work / 'runs'}", "--name", "same",
        "--checkpoint-dir", str(ckpt),
    ]  # fmt: skip
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    # Again without --resume (forgotten after a preemption): its saves would replace these.
    code, _, err = cli(capsys, *argv)
    assert code == 2
    assert err.splitlines()[-1] == (
        f"pipetrain train: error: {ckpt} already holds checkpoints of an earlier run (the "
        "newest step_000002, step 2): add --resume to continue it, or pass another "
        "--checkpoint-dir (or remove those) to start over"
    )
    assert [s for s, _ in list_checkpoints(ckpt).complete] == [2]
    code, _, err = cli(capsys, *argv, "--resume", "--steps", "1")
    assert code == 2
    assert err.splitlines()[-1] == (
        f"pipetrain train: error: {ckpt / 'step_000002'} is at step 2, past this run's 1 "
        "steps: pass --steps 3 or more to continue it, or another --checkpoint-dir"
    )

    # Resumed under the same name, the run continues its metrics file.
    code, _, err = cli(capsys, *argv, "--resume", "--steps", "3")
    assert code == 0, err
    lines = (work / "runs" / "same" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert not list((work / "runs" / "same").glob("metrics.superseded-*"))  # none past step 2
    # Resumed again as it is, the finished run has nothing to train: it appended an
    # evaluation and a summary of 0 steps (nan tokens/s) to the metrics.
    code, out, err = cli(capsys, *argv, "--resume", "--steps", "3")
    assert code == 0, err
    assert "the run is already at step 3 of 3: nothing to train" in out
    assert (work / "runs" / "same" / "metrics.jsonl").read_text().splitlines() == lines

    for step in (2, 3):
        shard = next((ckpt / f"step_00000{step}").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:10])
    code, out, err = cli(capsys, *argv, "--resume", "--steps", "3")
    assert code == 2 and "starting from step 0" not in out
    assert err.splitlines()[-1].startswith(
        f"pipetrain train: error: no valid checkpoint in {ckpt}: {shard}: 10 bytes"
    )


def test_async_resume_between_streams_of_another_length_names_a_stream_that_fits(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = work / "ckpt_async"
    argv = [
        "train", "--model", "llama-tiny", "--pp", "2", "--single-process",
        "--schedule", "pipedream", "--steps", "4", "--batch-size", "2", "--microbatches", "2",
        "--seq-len", "8", "--eval-every", "0", "--set", "run.sample_tokens=0",
        "--set", "optim.warmup_steps=0", "--data", str(work / "data"),
        "--set", f"run.out_dir={work / 'runs'}", "--checkpoint-dir", str(ckpt),
    ]  # fmt: skip
    code, _, err = cli(capsys, *argv, "--checkpoint-every", "2")  # streams of 2 steps
    assert code == 0, err
    shutil.rmtree(ckpt / "step_000004")
    code, _, err = cli(capsys, *argv, "--resume")  # streams of 4: step 2 is inside one
    assert code == 2
    assert err.splitlines()[-1] == (
        "pipetrain train: error: the checkpoint is at step 2, not between two streams of 4 "
        "steps (from run.steps, eval_every, checkpoint_every): pass --stream-steps 2, or the "
        "--checkpoint-every and --eval-every of the saved run"
    )
    code, out, err = cli(capsys, *argv, "--resume", "--stream-steps", "2")
    assert code == 0, err
    assert f"resumed from {ckpt / 'step_000002'} at step 2" in out
    # Resumed again as it is, the finished asynchronous run has nothing to train (it
    # evaluated again and reported "trained 4 steps, 0 tokens ... nan tokens/s").
    code, out, err = cli(capsys, *argv, "--resume", "--stream-steps", "2")
    assert code == 0, err
    assert "the run is already at step 4 of 4: nothing to train" in out
    assert "nan tokens/s" not in out
