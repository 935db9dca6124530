"""Checkpoint library in one process: round trips across splits, tied weights, optimizer
and RNG state, verification (flipped byte, missing file, version, model shape), keep and
crash leftovers, and the resume fallback.

Around damaged checkpoints: damaged DCP metadata and a marker that is not text are a
damaged checkpoint, ``keep`` counts back from the save just made, and resume refuses to
start over when every checkpoint is damaged."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pipetrain.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompatibleError,
    Layout,
    choose_resume,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from pipetrain.checkpoint.load import tensor_metadata
from pipetrain.checkpoint.manifest import COMPLETE_MARKER, MANIFEST_NAME

MODEL = {"family": "toy", "vocab_size": 16, "d_model": 8, "n_layers": 2}


class ToyStage(nn.Module):
    """Layers of a tiny tied-embedding model under their global names, like StageModule:
    0 = embed, 1..2 = layers.0..1, 3 = head (its weight tied to the embedding)."""

    def __init__(self, layers: tuple[int, ...], seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.layer_indices = layers
        self.embed = nn.Embedding(16, 8) if 0 in layers else None
        self.layers = nn.ModuleDict({str(i - 1): nn.Linear(8, 8) for i in (1, 2) if i in layers})
        self.head = nn.Linear(8, 16, bias=False) if 3 in layers else None
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            if self.head is not None:
                emb = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed)) * 0.3
                if self.embed is not None:
                    self.head.weight = self.embed.weight
                else:
                    self.head.weight.copy_(emb)

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        if self.embed is not None:
            return {"embed.weight": self.embed.weight}
        if self.head is not None:
            return {"embed.weight": self.head.weight}
        return {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        if self.head is not None:
            x = self.head(x)
        return x


def _pipeline(split: tuple[tuple[int, ...], ...]) -> list[ToyStage]:
    stages = [ToyStage(layers) for layers in split]
    # Same weights whatever the split: copy from one full reference by global name.
    reference = ToyStage((0, 1, 2, 3)).state_dict()
    for stage in stages:
        stage.load_state_dict({k: reference[k] for k in stage.state_dict()})
    return stages


def _params(stages: list[ToyStage]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for stage in stages:
        for p in stage.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def _train(stages: list[ToyStage], optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    """Steps on a fixed batch; tied copies get the sum of both gradients, as the runtime does."""
    losses = []
    tokens = torch.arange(12).reshape(2, 6) % 16
    for _ in range(steps):
        optimizer.zero_grad()
        x = tokens
        for stage in stages:
            x = stage(x)
        loss = nn.functional.cross_entropy(x.reshape(-1, 16), ((tokens + 1) % 16).reshape(-1))
        loss.backward()
        tied = [s.tied_parameters()["embed.weight"] for s in stages if s.tied_parameters()]
        if len(tied) == 2 and tied[0] is not tied[1]:
            total = tied[0].grad + tied[1].grad
            tied[0].grad, tied[1].grad = total.clone(), total.clone()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _full_weights(stages: list[ToyStage]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, tensor in stage.state_dict().items():
            out.setdefault("embed.weight" if name == "head.weight" else name, tensor.clone())
    return out


SPLITS = {
    "one": ((0, 1, 2, 3),),
    "two": ((0, 1), (2, 3)),
    "four": ((0,), (1,), (2,), (3,)),
}


@pytest.mark.parametrize(("saved", "loaded"), [("four", "two"), ("two", "one"), ("one", "four")])
def test_save_under_one_split_load_under_another_continues_identically(
    tmp_path: Path, saved: str, loaded: str
) -> None:
    a = _pipeline(SPLITS[saved])
    opt_a = torch.optim.AdamW(_params(a), lr=0.05)
    _train(a, opt_a, 3)
    result = save_checkpoint(
        tmp_path, 3, modules=a, optimizer=opt_a, model=MODEL, layout=Layout(pp=len(a))
    )
    assert result.path == tmp_path / "step_000003"
    assert result.bytes > 0

    b = _pipeline(SPLITS[loaded])
    opt_b = torch.optim.AdamW(_params(b), lr=0.05)
    loaded_result = load_checkpoint(result.path, modules=b, optimizer=opt_b, model=MODEL)
    assert loaded_result.step == 3
    for name, tensor in _full_weights(a).items():
        assert torch.equal(tensor, _full_weights(b)[name]), name
    # Same losses and weights for the next steps: optimizer state came back by name.
    assert _train(a, opt_a, 2) == _train(b, opt_b, 2)
    for name, tensor in _full_weights(a).items():
        assert torch.equal(tensor, _full_weights(b)[name]), name


def test_tied_copy_is_saved_once_under_its_canonical_name(tmp_path: Path) -> None:
    stages = _pipeline(SPLITS["two"])
    result = save_checkpoint(tmp_path, 0, modules=stages, model=MODEL)
    keys = {k for k in tensor_metadata(result.path) if k.startswith("model/")}
    assert keys == {
        "model/embed.weight",
        "model/layers.0.weight",
        "model/layers.0.bias",
        "model/layers.1.weight",
        "model/layers.1.bias",
    }


def test_rng_and_named_generators_are_restored(tmp_path: Path) -> None:
    stages = _pipeline(SPLITS["one"])
    data_gen = torch.Generator().manual_seed(7)
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    save_checkpoint(tmp_path, 1, modules=stages, model=MODEL, generators={"data": data_gen})
    expected = (
        torch.rand(3),
        random.random(),
        np.random.rand(),
        torch.rand(2, generator=data_gen),
    )
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    other_gen = torch.Generator().manual_seed(99)
    result = load_checkpoint(
        tmp_path / "step_000001", modules=stages, generators={"data": other_gen, "new": data_gen}
    )
    assert result.missing_generators == ("new",)
    got = (torch.rand(3), random.random(), np.random.rand(), torch.rand(2, generator=other_gen))
    assert torch.equal(got[0], expected[0])
    assert got[1] == expected[1]
    assert got[2] == expected[2]
    assert torch.equal(got[3], expected[3])


def test_manifest_records_model_layout_config_trainer_and_every_file(tmp_path: Path) -> None:
    stages = _pipeline(SPLITS["two"])
    layout = Layout(pp=2, chunks=1, schedule="1f1b", world_size=1, stages=((0, 1), (2, 3)))
    result = save_checkpoint(
        tmp_path,
        5,
        modules=stages,
        model=MODEL,
        layout=layout,
        config={"train": {"lr": 0.1, "betas": (0.9, 0.95)}},
        trainer={"data_position": 40},
    )
    manifest = read_manifest(result.path)
    assert manifest.step == 5
    assert manifest.layout == layout
    assert manifest.config == {"train": {"lr": 0.1, "betas": [0.9, 0.95]}}
    assert manifest.trainer == {"data_position": 40}
    on_disk = {p.name for p in result.path.iterdir()} - {MANIFEST_NAME, COMPLETE_MARKER}
    assert {f.name for f in manifest.files} == on_disk
    assert sum(f.size for f in manifest.files) == result.bytes
    assert verify_checkpoint(result.path).ok


def _saved(tmp_path: Path, step: int = 1) -> Path:
    stages = _pipeline(SPLITS["one"])
    opt = torch.optim.AdamW(_params(stages), lr=0.01)
    _train(stages, opt, 1)
    return save_checkpoint(tmp_path, step, modules=stages, optimizer=opt, model=MODEL).path


def test_flipped_byte_is_found_and_named(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    victim = next(path.glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    verification = verify_checkpoint(path)
    assert not verification.ok
    assert verification.problems == (
        f"{victim}: sha256 differs from the manifest (the file is damaged)",
    )
    with pytest.raises(CheckpointCorruptError, match=victim.name):
        load_checkpoint(path, modules=_pipeline(SPLITS["one"]), model=MODEL)


def test_missing_file_is_found_and_named(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    (path / ".metadata").unlink()
    assert verify_checkpoint(path).problems == (f"{path / '.metadata'}: missing",)
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata: missing"):
        load_checkpoint(path, modules=_pipeline(SPLITS["one"]))


def _rewrite_manifest(path: Path, edit: dict[str, object]) -> None:
    data = json.loads((path / MANIFEST_NAME).read_text())
    data.update(edit)
    text = json.dumps(data).encode()
    (path / MANIFEST_NAME).write_bytes(text)
    (path / COMPLETE_MARKER).write_text(hashlib.sha256(text).hexdigest())


def test_incompatible_format_version_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    _rewrite_manifest(path, {"format_version": 999})
    assert "format_version is 999" in verify_checkpoint(path).problems[0]
    with pytest.raises(CheckpointIncompatibleError, match="format_version 999"):
        load_checkpoint(path, modules=_pipeline(SPLITS["one"]), model=MODEL)


def test_other_model_shape_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with pytest.raises(CheckpointIncompatibleError, match="d_model=8 but this run has d_model=16"):
        load_checkpoint(path, modules=_pipeline(SPLITS["one"]), model={**MODEL, "d_model": 16})


def test_a_model_field_added_after_the_save_counts_as_its_default(tmp_path: Path) -> None:
    # Saved before q/k/v biases existed: the checkpoint does not name the field, so it is
    # a model without them, which a run with the default loads and a run with biases not.
    path = _saved(tmp_path)
    load_checkpoint(path, modules=_pipeline(SPLITS["one"]), model={**MODEL, "qkv_bias": False})
    with pytest.raises(
        CheckpointIncompatibleError, match="qkv_bias=False but this run has qkv_bias=True"
    ):
        load_checkpoint(path, modules=_pipeline(SPLITS["one"]), model={**MODEL, "qkv_bias": True})


def test_edited_manifest_is_caught_by_the_marker(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = json.loads((path / MANIFEST_NAME).read_text())
    data["step"] = 2
    (path / MANIFEST_NAME).write_text(json.dumps(data))
    assert "sha256 differs from the one in COMPLETE" in verify_checkpoint(path).problems[0]


def test_keep_prunes_oldest_and_a_save_cleans_crash_leftovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stages = _pipeline(SPLITS["one"])
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, modules=stages, model=MODEL, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path).complete] == [2, 3]
    leftover = tmp_path / "step_000004.tmp-0123456789ab"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"half")
    with caplog.at_level(logging.WARNING, logger="pipetrain.checkpoint"):
        assert choose_resume(tmp_path).path == tmp_path / "step_000003"
    assert f"ignoring {leftover}: an unfinished save" in caplog.text
    result = save_checkpoint(tmp_path, 5, modules=stages, model=MODEL, keep=2)
    assert leftover in result.removed and not leftover.exists()
    assert [s for s, _ in list_checkpoints(tmp_path).complete] == [3, 5]


def test_resume_falls_back_to_the_previous_valid_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = _pipeline(SPLITS["one"])
    save_checkpoint(tmp_path, 10, modules=first, model=MODEL)
    expected = _full_weights(first)
    second = _pipeline(SPLITS["one"])
    opt = torch.optim.AdamW(_params(second), lr=0.1)
    _train(second, opt, 1)
    newest = save_checkpoint(tmp_path, 20, modules=second, model=MODEL).path
    (next(newest.glob("*.distcp"))).unlink()

    fresh = _pipeline(SPLITS["two"])
    with caplog.at_level(logging.WARNING, logger="pipetrain.checkpoint"):
        result = resume_checkpoint(tmp_path, modules=fresh, model=MODEL)
    assert result is not None and result.step == 10
    assert "skipping" in caplog.text and "__0_0.distcp: missing" in caplog.text
    assert f"falling back to {tmp_path / 'step_000010'}" in caplog.text
    for name, tensor in expected.items():
        assert torch.equal(_full_weights(fresh)[name], tensor), name


def test_resume_from_an_empty_directory_is_none(tmp_path: Path) -> None:
    assert resume_checkpoint(tmp_path / "absent", modules=_pipeline(SPLITS["one"])) is None


def test_a_root_that_cannot_be_created_is_one_line_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(
        CheckpointError, match=r"cannot create a checkpoint in .*file.*--checkpoint-dir"
    ):
        save_checkpoint(blocker / "ckpt", 1, modules=_pipeline(SPLITS["one"]), model=MODEL)


def test_trainer_state_that_is_not_json_fails_loudly_and_leaves_no_checkpoint(
    tmp_path: Path,
) -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        save_checkpoint(
            tmp_path, 1, modules=_pipeline(SPLITS["one"]), model=MODEL, trainer={"x": object()}
        )
    found = list_checkpoints(tmp_path)
    assert found.complete == () and len(found.partial) == 1


def test_two_writer_threads_write_two_files_hashed_and_verified_in_parallel(
    tmp_path: Path,
) -> None:
    stages = _pipeline(SPLITS["two"])
    opt = torch.optim.AdamW(_params(stages), lr=0.05)
    _train(stages, opt, 1)
    path = save_checkpoint(tmp_path, 1, modules=stages, optimizer=opt, model=MODEL, threads=2).path
    data_files = sorted(f.name for f in read_manifest(path).files if f.name.endswith(".distcp"))
    assert data_files == ["__0_0.distcp", "__0_1.distcp"]
    fresh = _pipeline(SPLITS["one"])
    load_checkpoint(path, modules=fresh, model=MODEL, threads=2)
    assert all(torch.equal(t, _full_weights(fresh)[k]) for k, t in _full_weights(stages).items())
    victim = path / "__0_1.distcp"
    data = bytearray(victim.read_bytes())
    data[7] ^= 0x04
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"__0_1\.distcp: sha256 differs"):
        load_checkpoint(path, modules=fresh, model=MODEL, threads=2)


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
