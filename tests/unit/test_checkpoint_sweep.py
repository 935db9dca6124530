"""Checkpoint library edge cases found by a user's sweep: damaged DCP metadata, exports
to paths that cannot be written, and what ``keep`` and resume do around damaged
checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from pipetrain.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointPolicy,
    Layout,
    RunCheckpoints,
    export,
    list_checkpoints,
    read_manifest,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from pipetrain.checkpoint.export import export_checkpoint
from pipetrain.checkpoint.load import tensor_metadata
from pipetrain.checkpoint.manifest import COMPLETE_MARKER, MANIFEST_NAME

MODEL = {"family": "toy", "d_model": 4}


def _save(root: Path, step: int, keep: int | None = None) -> Path:
    torch.manual_seed(step)
    return save_checkpoint(root, step, modules=nn.Linear(4, 4), model=MODEL, keep=keep).path


@pytest.mark.parametrize(
    "damage",
    [lambda data: data[:100], lambda data: b"k" + data[1:]],
    ids=["truncated", "first-byte"],
)
def test_damaged_dcp_metadata_is_a_corrupt_checkpoint_naming_the_file(
    tmp_path: Path, damage: Callable[[bytes], bytes]
) -> None:
    path = _save(tmp_path, 1)
    metadata = path / ".metadata"
    metadata.write_bytes(damage(metadata.read_bytes()))
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata: unreadable \(UnpicklingError"):
        tensor_metadata(path)


def test_export_to_a_directory_or_below_a_file_is_one_line_and_keeps_an_earlier_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _save(tmp_path / "ckpt", 1)
    with pytest.raises(CheckpointError, match="is a directory; pass --out a file path"):
        export_checkpoint(path, tmp_path)
    (tmp_path / "plain").write_text("x")
    with pytest.raises(CheckpointError, match=r"cannot write the export to .*plain/w\.safetensors"):
        export_checkpoint(path, tmp_path / "plain" / "w.safetensors")

    out = tmp_path / "w.safetensors"
    export_checkpoint(path, out)
    before = out.read_bytes()

    def disk_full(file: Path, *args: object) -> int:
        Path(file).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_safetensors", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        export_checkpoint(_save(tmp_path / "other", 2), out)
    assert out.read_bytes() == before  # the earlier export, whole; no partial file left
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["plain", "w.safetensors"]


def _damage(checkpoint: Path) -> Path:
    shard = next(checkpoint.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    return shard


def test_keep_counts_back_from_the_save_just_made_not_from_a_damaged_later_step(
    tmp_path: Path,
) -> None:
    # A run resumed past a damaged step 6 (here: started over) saves steps 2 and 4 with
    # keep=1: each save must survive its own pruning, and the older one go.
    _damage(_save(tmp_path, 6))
    assert _save(tmp_path, 2, keep=1).is_dir()
    assert _save(tmp_path, 4, keep=1).is_dir()
    assert [s for s, _ in list_checkpoints(tmp_path).complete] == [4, 6]
    # Saving step 6 again replaces the damaged one, and keep applies as usual.
    _save(tmp_path, 6, keep=1)
    assert [s for s, _ in list_checkpoints(tmp_path).complete] == [6]
    assert verify_checkpoint(tmp_path / "step_000006").ok


def test_resume_when_every_checkpoint_is_damaged_refuses_instead_of_starting_over(
    tmp_path: Path,
) -> None:
    _damage(_save(tmp_path, 1))
    shard = _damage(_save(tmp_path, 2))
    size = {f.name: f.size for f in read_manifest(shard.parent).files}[shard.name]
    with pytest.raises(CheckpointCorruptError) as raised:
        resume_checkpoint(tmp_path, modules=nn.Linear(4, 4), model=MODEL)
    assert str(raised.value) == (
        f"no valid checkpoint in {tmp_path}: {shard}: 10 bytes, the manifest says {size} "
        "(and 1 more damaged); restore the damaged files, or move the checkpoints away "
        "(or pass another checkpoint directory) to start over"
    )
    # Only unfinished saves (a crash before the first checkpoint): nothing to resume yet.
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (tmp_path / "step_000001").rename(crashed / "step_000001.tmp-0123abcd")
    assert resume_checkpoint(crashed, modules=nn.Linear(4, 4), model=MODEL) is None


def test_a_checkpoint_past_the_run_steps_is_refused_in_one_line(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path, 5, modules=model, optimizer=optimizer, model=MODEL)

    def run(total: int) -> RunCheckpoints:
        return RunCheckpoints(
            CheckpointPolicy(str(tmp_path), resume=True),
            modules=[model],
            optimizer=optimizer,
            model=MODEL,
            layout=Layout(),
            config={},
            total_steps=total,
            group=None,
            device=torch.device("cpu"),
        )

    short = run(3)
    with pytest.raises(CheckpointError) as raised:
        short.resume()
    short.close()
    assert str(raised.value) == (
        f"{tmp_path / 'step_000005'} is at step 5, past this run's 3 steps: pass --steps 6 "
        "or more to continue it, or another --checkpoint-dir"
    )
    done = run(5)
    assert done.resume() == 5  # a finished run resumed with the same steps: nothing to do
    done.close()


def test_resume_names_the_settings_that_change_the_run_from_here(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = {
        "pipeline": {"pp": 2},
        "data": {"batch_size": 4, "seq_len": 16},
        "optim": {"lr": 0.1, "grad_accum": 1},
        "run": {"steps": 5, "seed": 0, "name": "first"},
    }
    save_checkpoint(tmp_path, 2, modules=model, optimizer=optimizer, model=MODEL, config=saved)

    def resume(config: dict[str, dict[str, object]]) -> list[str]:
        said: list[str] = []
        run = RunCheckpoints(
            CheckpointPolicy(str(tmp_path), resume=True),
            modules=[model],
            optimizer=optimizer,
            model=MODEL,
            layout=Layout(),
            config=config,
            total_steps=5,
            group=None,
            device=torch.device("cpu"),
            say=said.append,
        )
        assert run.resume() == 2
        run.close()
        return [line for line in said if line.startswith("note:")]

    # Another layout and another run name change nothing that matters.
    same = {**saved, "pipeline": {"pp": 3}, "run": {**saved["run"], "name": "second"}}
    assert resume(same) == []
    other = {**same, "optim": {"lr": 0.1, "grad_accum": 2}, "run": {**same["run"], "steps": 8}}
    assert resume(other) == [
        "note: resuming with settings other than the saved run's (optim.grad_accum 1 -> 2, "
        "run.steps 5 -> 8): the steps from here are not those of the run continued as it was"
    ]


def test_a_marker_that_is_not_text_is_a_damaged_checkpoint_and_resume_falls_back(
    tmp_path: Path,
) -> None:
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    marker = newest / COMPLETE_MARKER
    data = bytearray(marker.read_bytes())
    data[3] ^= 0x80  # no longer UTF-8
    marker.write_bytes(bytes(data))
    assert verify_checkpoint(newest).problems == (
        f"{newest / MANIFEST_NAME}: sha256 differs from the one in {COMPLETE_MARKER}; "
        "the manifest is damaged",
    )
    result = resume_checkpoint(tmp_path, modules=nn.Linear(4, 4), model=MODEL)
    assert result is not None and result.step == 1


def test_resume_keeps_this_runs_optimizer_settings_and_loads_the_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    saved = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
    model(torch.ones(2, 4)).sum().backward()
    saved.step()
    save_checkpoint(tmp_path, 1, modules=model, optimizer=saved, model=MODEL)
    moments = saved.state[model.weight]["exp_avg"].clone()

    changed = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.5), weight_decay=0.7)
    run = RunCheckpoints(
        CheckpointPolicy(str(tmp_path), resume=True),
        modules=[model],
        optimizer=changed,
        model=MODEL,
        layout=Layout(),
        config={},
        total_steps=3,
        group=None,
        device=torch.device("cpu"),
    )
    assert run.resume() == 1
    run.close()
    (group,) = changed.param_groups
    assert (group["betas"], group["weight_decay"]) == ((0.8, 0.5), 0.7)
    assert torch.equal(changed.state[model.weight]["exp_avg"], moments)
