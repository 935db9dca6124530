"""Checkpoint library edge cases found by a user's sweep: damaged DCP metadata, exports
to paths that cannot be written, and what ``keep`` and resume do around damaged
checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from pipetrain.checkpoint import CheckpointCorruptError, CheckpointError, export, save_checkpoint
from pipetrain.checkpoint.export import export_checkpoint
from pipetrain.checkpoint.load import tensor_metadata

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
