"""Export: the safetensors writer/reader, native export loadable into the single-process
model with the same loss, the Hugging Face export (transformers loads it, same logits), and
exports to paths that cannot be written (one line, an earlier export kept whole)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.checkpoint import CheckpointError, export, save_checkpoint
from pipetrain.checkpoint.export import export_checkpoint, load_weights
from pipetrain.checkpoint.safetensors_io import read_safetensors, write_safetensors
from pipetrain.models import build_full_model, build_stage, get_model_config, model_spec

MODEL = {"family": "toy", "d_model": 4}


def _model_fields(config: object) -> dict[str, object]:
    fields = dataclasses.asdict(config)  # type: ignore[call-overload]
    fields.pop("name")
    return fields


def test_safetensors_round_trip_keeps_dtype_shape_and_bytes(tmp_path: Path) -> None:
    tensors = {
        "a.f32": torch.randn(3, 5),
        "b.bf16": torch.randn(4).to(torch.bfloat16),
        "c.i64": torch.arange(6).reshape(2, 3),
        "d.scalar": torch.tensor(2.5),
        "e.empty": torch.empty(0, 4),
        "f.bool": torch.tensor([True, False, True]),
    }
    size = write_safetensors(tmp_path / "x.safetensors", tensors, {"k": "v"})
    assert size == (tmp_path / "x.safetensors").stat().st_size
    header_len = int.from_bytes((tmp_path / "x.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0  # data aligned, as the format asks
    back, metadata = read_safetensors(tmp_path / "x.safetensors")
    assert metadata == {"k": "v"}
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_files_agree_with_the_safetensors_package_when_installed(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {"w": torch.randn(2, 3), "h": torch.randn(5).to(torch.bfloat16)}
    write_safetensors(tmp_path / "ours.safetensors", tensors)
    theirs = safetensors_torch.load_file(str(tmp_path / "ours.safetensors"))
    assert all(torch.equal(theirs[k], v) for k, v in tensors.items())
    safetensors_torch.save_file(tensors, str(tmp_path / "theirs.safetensors"))
    ours, _ = read_safetensors(tmp_path / "theirs.safetensors")
    assert all(torch.equal(ours[k], v) for k, v in tensors.items())


def _trained_stages(preset: str, stages_count: int, **overrides: object):
    config = get_model_config(preset, **overrides)
    spec = model_spec(config)
    n = len(spec.layers)
    bounds = [n * i // stages_count for i in range(stages_count + 1)]
    stages = [
        build_stage(spec, range(bounds[i], bounds[i + 1]), seed=3, device="cpu")
        for i in range(stages_count)
    ]
    params = {id(p): p for s in stages for p in s.parameters()}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2)
    tokens = torch.randint(
        0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    for _ in range(2):
        opt.zero_grad()
        x = tokens[:, :-1]
        for stage in stages:
            x = stage(x)
        F.cross_entropy(x.reshape(-1, config.vocab_size), tokens[:, 1:].reshape(-1)).backward()
        tied = [s.tied_parameters() for s in stages]
        copies = [t[k] for t in tied for k in t]
        if len(copies) == 2:
            total = copies[0].grad + copies[1].grad
            copies[0].grad, copies[1].grad = total.clone(), total.clone()
        opt.step()
    return config, spec, stages, tokens


def _loss(modules, tokens: torch.Tensor, vocab: int) -> float:
    x = tokens[:, :-1]
    for module in modules:
        x = module(x)
    return F.cross_entropy(x.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).item()


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_native_export_loads_into_the_full_model_with_the_same_loss(
    tmp_path: Path, preset: str
) -> None:
    config, spec, stages, tokens = _trained_stages(preset, 2)
    saved = save_checkpoint(tmp_path / "ck", 2, modules=stages, model=_model_fields(config))
    result = export_checkpoint(saved.path, tmp_path / "w.safetensors")
    full = build_full_model(
        spec, seed=99, device="cpu"
    )  # other seed: weights must come from the file
    assert load_weights(full, result.path) == ()
    assert _loss([full], tokens, config.vocab_size) == _loss(stages, tokens, config.vocab_size)
    weights, metadata = read_safetensors(result.path)
    assert result.tensors == len(weights)
    assert json.loads(metadata["model"]) == _model_fields(config)
    if config.tie_embeddings:  # saved once, under the embedding's name
        assert "head.out.weight" not in weights and "embed.tok.weight" in weights


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_hf_export_is_a_directory_transformers_loads_with_the_same_logits(
    tmp_path: Path, preset: str
) -> None:
    transformers = pytest.importorskip("transformers")
    config, _, stages, tokens = _trained_stages(preset, 2, tie_embeddings=True)
    saved = save_checkpoint(tmp_path / "ck", 2, modules=stages, model=_model_fields(config))
    result = export_checkpoint(saved.path, tmp_path / "hf", format="hf")
    assert result.path.is_dir() and (result.path / "config.json").exists()
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        result.path, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        ours = stages[1](stages[0](tokens))
        torch.testing.assert_close(theirs.eval()(tokens).logits, ours, rtol=1e-5, atol=1e-5)
    with pytest.raises(CheckpointError, match="it is a file and --format hf writes a directory"):
        export_checkpoint(saved.path, result.path / "config.json", format="hf")


def test_load_weights_names_a_missing_tensor(tmp_path: Path) -> None:
    _, _, stages, _ = _trained_stages("llama-tiny", 1)
    write_safetensors(tmp_path / "w.safetensors", {"embed.tok.weight": torch.zeros(256, 32)})
    with pytest.raises(CheckpointError, match=r"has no tensor 'layers\.0\.attn_norm\.weight'"):
        load_weights(stages, tmp_path / "w.safetensors")


def _save(root: Path, step: int, keep: int | None = None) -> Path:
    torch.manual_seed(step)
    return save_checkpoint(root, step, modules=nn.Linear(4, 4), model=MODEL, keep=keep).path


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


def test_safetensors_errors_are_one_line_and_shared_memory_is_written(tmp_path: Path) -> None:
    weight = torch.randn(4, 3)
    write_safetensors(tmp_path / "tied.safetensors", {"a": weight, "b": weight, "c": weight[1]})
    back, _ = read_safetensors(tmp_path / "tied.safetensors")
    assert torch.equal(back["a"], weight) and torch.equal(back["b"], weight)
    assert torch.equal(back["c"], weight[1])
    with pytest.raises(CheckpointError, match=r"tensor 'z' has dtype torch.complex128, which"):
        write_safetensors(tmp_path / "c.safetensors", {"a": weight, "z": torch.zeros(2).cdouble()})
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(CheckpointError, match=r"bad.safetensors: not a safetensors file \("):
        read_safetensors(tmp_path / "bad.safetensors")
    _, _, stages, _ = _trained_stages("llama-tiny", 1)
    with pytest.raises(CheckpointError, match=r"bad.safetensors: not a safetensors file \("):
        load_weights(stages, tmp_path / "bad.safetensors")
