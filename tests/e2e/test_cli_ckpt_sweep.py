"""``pipetrain ckpt`` on damaged and odd inputs, through main(argv): one line and exit
status 2 for what cannot be done, a warning for a damaged checkpoint that is described."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from pipetrain.checkpoint import list_checkpoints, read_manifest, save_checkpoint
from pipetrain.cli import main

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of a one-layer model at steps 1 and 2."""
    root = tmp_path_factory.mktemp("sweep") / "ckpt"
    torch.manual_seed(0)
    for step in (1, 2):
        save_checkpoint(root, step, modules=nn.Linear(4, 4), model={"family": "toy"})
    return root


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _copy(root: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    return copy


def test_inspect_of_a_damaged_checkpoint_warns_and_an_unreadable_one_is_one_line(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = _copy(root, tmp_path)
    shard = copy / "step_000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    code, out, err = cli(capsys, "ckpt", "inspect", str(copy / "step_000002"), "--json")
    problem = f"{shard}: sha256 differs from the manifest (the file is damaged)"
    assert code == 0 and err == f"warning: damaged checkpoint: {problem}\n"
    assert json.loads(out)["problems"] == [problem]
    code, out, err = cli(capsys, "ckpt", "inspect", str(root / "step_000002"), "--json")
    assert code == 0 and err == "" and json.loads(out)["problems"] == []

    metadata = copy / "step_000001" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:50])
    code, out, err = cli(capsys, "ckpt", "inspect", str(copy / "step_000001"))
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 2
    assert lines[0].startswith(f"warning: damaged checkpoint: {metadata}: 50 bytes")
    assert lines[1].startswith(f"pipetrain ckpt: error: {metadata}: unreadable (UnpicklingError")


def test_verify_of_a_directory_with_only_an_unfinished_save_names_it(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    partial = crashed / "step_000003.tmp-0123abcd"
    shutil.copytree(root / "step_000001", partial)
    code, out, _ = cli(capsys, "ckpt", "verify", str(crashed))
    assert code == 1
    assert out.splitlines() == [
        f"note {partial}: an unfinished save, ignored",
        f"{crashed}: no checkpoints (step_NNNNNN directories) found",
    ]


def test_export_to_a_directory_is_one_line(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(capsys, "ckpt", "export", str(root), "--out", str(tmp_path))
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"pipetrain ckpt: error: cannot write the export to {tmp_path}: it is a directory; "
        f"pass --out a file path such as {tmp_path / 'model.safetensors'}"
    ]


def test_export_of_a_directory_names_the_checkpoint_and_all_damaged_says_so(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "w.safetensors"
    code, out, err = cli(capsys, "ckpt", "export", str(root), "--out", str(out_file))
    assert code == 0, err
    assert out.startswith(f"wrote {out_file}: ")
    assert out.rstrip("\n").endswith(f"(native), from {root / 'step_000002'}")

    copy = _copy(root, tmp_path)
    shards = [next((copy / f"step_00000{step}").glob("*.distcp")) for step in (1, 2)]
    for shard in shards:
        shard.write_bytes(shard.read_bytes()[:10])
    for argv in (
        ["ckpt", "export", str(copy), "--out", str(out_file)],
        ["ckpt", "inspect", str(copy)],
    ):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and out == ""
        line = err.splitlines()[-1]
        # It said the directory held no step_NNNNNN with a COMPLETE marker: both have one.
        assert line.startswith(
            f"pipetrain ckpt: error: checkpoint {copy}: no valid checkpoint: {shards[1]}: 10 bytes"
        )
        assert line.endswith(
            "(and 1 more damaged); restore the damaged files, or pass another checkpoint"
        )


def test_a_v_schedules_checkpoint_says_two_stages_per_rank(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = work / "ckpt_v"
    argv = [
        "train", "--model", "llama-tiny", "--pp", "2", "--schedule", "zb-v", "--single-process",
        "--steps", "1", "--batch-size", "4", "--microbatches", "4", "--seq-len", "8",
        "--eval-every", "0", "--set", "run.evaluate=false", "--set", "run.sample_tokens=0",
        "--set", "optim.warmup_steps=0", "--data", str(work / "data"),
        "--set", f"run.out_dir={work / 'runs'}", "--name", "v", "--checkpoint-dir", str(ckpt),
    ]  # fmt: skip
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    # It said chunks=1 (pipeline.chunks, which the V schedules ignore) beside 4 stages.
    layout = read_manifest(ckpt / "step_000001").layout
    assert (layout.pp, layout.chunks, len(layout.stages)) == (2, 2, 4)
    code, out, err = cli(capsys, "ckpt", "inspect", str(ckpt))
    assert code == 0, err
    assert "layout: pp=2 chunks=2 schedule=zb-v world_size=1" in out


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


def test_a_checkpoint_deleted_while_being_read_is_said_to_be_gone_not_damaged(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A training run saving into the directory with --keep deletes its oldest checkpoint
    # while export, inspect, generate or verify reads it: here, as the read begins.
    import pipetrain.checkpoint
    import pipetrain.checkpoint.export

    copy = _copy(root, tmp_path)
    real_export = pipetrain.checkpoint.export.export_checkpoint

    def export_pruned(path: Path, *args: object, **kwargs: object) -> object:
        shutil.rmtree(path)
        return real_export(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pipetrain.checkpoint.export, "export_checkpoint", export_pruned)
    code, out, err = cli(capsys, "ckpt", "export", str(copy), "--out", str(tmp_path / "m.st"))
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"pipetrain ckpt: error: checkpoint {copy / 'step_000002'} was deleted while being read "
        "(a training run saving there with --keep removes its oldest): run the command again "
        "to read the newest"
    ]
    monkeypatch.undo()

    real_verify = pipetrain.checkpoint.verify_checkpoint

    def verify_pruned(path: Path, **kwargs: bool) -> object:
        if path.name == "step_000001":
            shutil.rmtree(path)
        return real_verify(path, **kwargs)

    monkeypatch.setattr(pipetrain.checkpoint, "verify_checkpoint", verify_pruned)
    code, out, _ = cli(capsys, "ckpt", "verify", str(copy))
    assert code == 0, out
    assert f"note {copy / 'step_000001'}: deleted while being verified" in out
    assert "BAD" not in out
