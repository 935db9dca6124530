"""A full disk, in one process (``pipetrain.checkpoint.space``, ``save``, ``metrics_file``):
a save that runs out of space mid-write leaves no partial folder and every earlier
checkpoint, in one line; a save that cannot fit is refused before anything is written, or
makes room with ``keep``; the estimate covers what a save writes; a run is warned at its
start; a metrics line is written whole or not at all."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from pipetrain.checkpoint import (
    CheckpointError,
    CheckpointPolicy,
    Layout,
    RunCheckpoints,
    list_checkpoints,
    resume_checkpoint,
    save_checkpoint,
    space,
    verify_checkpoint,
)
from pipetrain.checkpoint import save as save_module
from pipetrain.checkpoint import state as ckpt_state
from pipetrain.train.metrics_file import MetricsError, MetricsFile

MODEL = {"family": "toy"}


class _Budget(io.FileIO):
    """A file on a disk with ``disk.room`` bytes left: what fits is written, then the write
    fails with ENOSPC, as on a full disk."""

    def __init__(self, path: str | os.PathLike[str], disk: _FullDisk) -> None:
        super().__init__(path, "wb")
        self._disk = disk

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) > self._disk.room:
            super().write(view[: self._disk.room])
            self._disk.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.room -= len(view)
        return int(super().write(view))


class _FullDisk(FileSystem):
    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with io.BufferedWriter(_Budget(path, self)) as stream:
            yield stream


def _fill_disk(monkeypatch: pytest.MonkeyPatch, room: int) -> _FullDisk:
    """Saves from now on write to a disk with ``room`` bytes left."""
    disk = _FullDisk(room)

    class Writer(FileSystemWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.fs = disk

    monkeypatch.setattr(save_module, "FileSystemWriter", Writer)
    return disk


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))  # about 18 KB of float32


def _steps(root: Path) -> list[int]:
    return [step for step, _ in list_checkpoints(root).complete]


def test_a_save_that_runs_out_of_space_removes_its_folder_and_keeps_the_earlier_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, modules=model, optimizer=optimizer, model=MODEL)
    disk = _fill_disk(monkeypatch, room=20_000)  # a part of the data fits, not all of it
    with pytest.raises(CheckpointError) as failed:
        save_checkpoint(tmp_path, 3, modules=model, optimizer=optimizer, model=MODEL)
    assert disk.room == 0  # it did write until the disk was full
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(
        f"saving the checkpoint of step 3 into {tmp_path} failed: no space left on the device "
        "(rank 0; it needs about 0.2 MB, "
    )
    assert message.endswith(
        "the partial save was removed and the earlier checkpoints are kept (newest "
        "step_000002); free space there, pass --keep N to remove older checkpoints first, or "
        "another --checkpoint-dir, then continue with --resume"
    )
    assert list_checkpoints(tmp_path).partial == () and _steps(tmp_path) == [1, 2]
    assert all(verify_checkpoint(path).ok for _, path in list_checkpoints(tmp_path).complete)

    # Space freed: the run resumes from step 2 and saves step 3.
    monkeypatch.undo()
    fresh = _model(seed=1)
    result = resume_checkpoint(tmp_path, modules=fresh, model=MODEL)
    assert result is not None and result.step == 2
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )
    save_checkpoint(tmp_path, 3, modules=fresh, model=MODEL)
    assert _steps(tmp_path) == [1, 2, 3]


def test_a_save_that_cannot_fit_is_refused_before_it_writes_or_makes_room_with_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, modules=model, model=MODEL)
    entries = ckpt_state.model_entries(ckpt_state.index_parameters([model]))
    entries.update(ckpt_state.rng_entries(0, {}))
    needed = space.plan_room(tmp_path, 4, space.tensor_bytes(entries.values()), None).needed
    one, two = (space.folder_bytes(tmp_path / f"step_00000{step}") for step in (1, 2))
    free = needed - one - two // 2  # it fits once steps 1 and 2 are gone
    monkeypatch.setattr(space, "free_bytes", lambda root: free)
    with pytest.raises(CheckpointError) as refused:
        save_checkpoint(tmp_path, 4, modules=model, model=MODEL)
    assert str(refused.value) == (
        f"not enough space for the checkpoint of step 4 in {tmp_path}: it needs about "
        f"{space.megabytes(needed)} and {space.megabytes(free)} are free; the earlier "
        "checkpoints are kept (newest step_000003); free space there, pass --keep N to remove "
        "older checkpoints first, or another --checkpoint-dir, then continue with --resume"
    )
    assert _steps(tmp_path) == [1, 2, 3] and list_checkpoints(tmp_path).partial == ()
    # --keep 3 would remove step 1 only: not enough, and nothing is removed.
    with pytest.raises(CheckpointError, match=r"with the older checkpoints that --keep 3 removes"):
        save_checkpoint(tmp_path, 4, modules=model, model=MODEL, keep=3)
    assert _steps(tmp_path) == [1, 2, 3]
    # --keep 1 removes steps 1 to 3 after the save; before it, only as many as make room.
    result = save_checkpoint(tmp_path, 4, modules=model, model=MODEL, keep=1)
    assert result.made_room == (tmp_path / "step_000001", tmp_path / "step_000002")
    assert result.needed == needed and _steps(tmp_path) == [4]


def test_the_estimate_covers_what_a_save_writes(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    before = space.tensor_bytes(model.state_dict().values()) + space.optimizer_bytes(optimizer)
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    result = save_checkpoint(tmp_path, 1, modules=model, optimizer=optimizer, model=MODEL)
    needed = space.plan_room(tmp_path / "empty", 1, before, None).needed
    # Adam's moments counted before they exist; DCP's headers and metadata included.
    assert result.bytes <= needed <= 2 * result.bytes


def test_a_run_whose_checkpoint_cannot_fit_is_warned_at_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    said: list[str] = []
    monkeypatch.setattr(space, "free_bytes", lambda root: 1000)
    checkpoints = RunCheckpoints(
        CheckpointPolicy(str(tmp_path), every=1),
        modules=[model],
        optimizer=torch.optim.AdamW(model.parameters()),
        model=MODEL,
        layout=Layout(pp=1, chunks=1, schedule="1f1b", world_size=1),
        config={},
        total_steps=2,
        group=None,
        device=torch.device("cpu"),
        say=said.append,
    )
    assert checkpoints.resume() == 0
    checkpoints.close()
    assert len(said) == 1 and said[0].startswith("warning: a checkpoint of this run needs about")
    assert said[0].endswith(
        f"but 0.0 MB are free in {tmp_path}: its saves will fail; free space there, pass "
        "--keep N, or another --checkpoint-dir"
    )


def test_a_metrics_line_is_written_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsFile(path)
    metrics.write({"step": 1, "loss": 2.0})
    real_write = os.write

    def short(fd: int, data: bytes) -> int:  # the disk fills up inside the line
        return real_write(fd, data[:7])

    monkeypatch.setattr(os, "write", short)
    with pytest.raises(MetricsError) as failed:
        metrics.write({"step": 2, "loss": 1.5})
    assert str(failed.value) == (
        f"writing run.metrics {str(path)!r} failed (No space left on device): free space on "
        "its disk or pass another --metrics (the lines written so far are whole)"
    )

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(MetricsError, match="No space left on device"):
        metrics.write({"step": 2, "loss": 1.5})
    metrics.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 2.0}
    ]
