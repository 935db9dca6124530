"""Hugging Face checkpoints in and out, checked against transformers itself: tiny random
models built with transformers' own classes and saved with ``save_pretrained`` (no
download) give the same logits in pipetrain (the full model, and a two-stage pipeline in
one process), export loads back into transformers with the same logits, and import ->
export -> import is bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipetrain.models import build_full_model, model_spec  # noqa: E402
from pipetrain.models.hf import (  # noqa: E402
    HFImportError,
    hf_state_dict,
    load_hf_weights,
    read_hf_config,
    save_hf,
)
from pipetrain.runtime import build_pipeline  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3)
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _llama() -> object:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    config = transformers.LlamaConfig(**SMALL, **ATTN, rope_parameters=rope, rms_norm_eps=1e-5)
    return transformers.LlamaForCausalLM(config)


def _mistral() -> object:
    config = transformers.MistralConfig(**SMALL, **ATTN, sliding_window=32)
    return transformers.MistralForCausalLM(config)


def _qwen2() -> object:
    config = transformers.Qwen2Config(**SMALL, **ATTN, tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(config)


def _gpt2() -> object:
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=3, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


MAKERS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gpt2": _gpt2}


def _saved(kind: str, directory: Path, *, shard: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MAKERS[kind]().eval()
    with torch.no_grad():  # random norms and biases, so a swapped pair cannot hide
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0 if "norm" in name or "ln" in name else 0.0, 0.1)
    extra = {"max_shard_size": "20KB"} if shard else {}
    model.save_pretrained(directory, safe_serialization=True, **extra)
    return model


TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))


def _their_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def _our_model(directory: Path) -> torch.nn.Module:
    config = read_hf_config(directory).config
    full = build_full_model(model_spec(config), seed=3, device="cpu")
    load_hf_weights(full, directory)
    return full.eval()


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_imported_logits_equal_transformers(kind: str, tmp_path: Path) -> None:
    theirs = _saved(kind, tmp_path, shard=kind == "llama")
    if kind == "llama":
        assert (tmp_path / "model.safetensors.index.json").exists()
    ours = _our_model(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), _their_logits(theirs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_two_stage_pipeline_loads_its_own_layers_and_matches(kind: str, tmp_path: Path) -> None:
    theirs = _saved(kind, tmp_path, shard=True)
    config = read_hf_config(tmp_path).config
    pipe = build_pipeline(model_spec(config), schedule="1f1b", microbatches=2, ranks=2)
    result = load_hf_weights(pipe, tmp_path)
    assert result.architecture == type(theirs).__name__
    first, last = pipe.modules
    with torch.no_grad():
        logits = last(first(TOKENS))
        want = _their_logits(theirs)
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        loss = pipe.eval_loss(TOKENS[:, :-1], TOKENS[:, 1:])
        # HF shifts the labels itself: the same 11 predictions per row, causally.
        ref = theirs(TOKENS, labels=TOKENS).loss
    assert loss == pytest.approx(float(ref), rel=1e-5)


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_export_loads_in_transformers_and_round_trips_bit_exactly(
    kind: str, tmp_path: Path
) -> None:
    _saved(kind, tmp_path / "in")
    ours = _our_model(tmp_path / "in")
    config = read_hf_config(tmp_path / "in").config
    weights = {k: v.detach() for k, v in ours.state_dict().items()}
    save_hf(tmp_path / "out", weights, config)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(_their_logits(back.eval()), ours(TOKENS), rtol=1e-5, atol=1e-5)
    again = _our_model(tmp_path / "out")
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    hf_in = hf_state_dict(weights, config)
    assert set(hf_in) == set(back.state_dict()) - {"lm_head.weight"} | (
        set() if config.tie_embeddings else {"lm_head.weight"}
    )


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(HFImportError, match="not supported: use a model of LlamaForCausalLM"):
        read_hf_config(tmp_path)


def test_a_missing_shard_and_a_wrong_shape_are_one_line(tmp_path: Path) -> None:
    _saved("llama", tmp_path / "a", shard=True)
    shards = sorted((tmp_path / "a").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(HFImportError, match=r"names the shard model-.*which is missing"):
        _our_model(tmp_path / "a")
    _saved("gpt2", tmp_path / "b")
    raw = json.loads((tmp_path / "b" / "config.json").read_text())
    raw["n_inner"] = 64  # the file's MLP is 128 wide
    (tmp_path / "b" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        HFImportError, match=r"c_fc.bias has shape \(128,\) but config.json gives \(64,\)"
    ):
        _our_model(tmp_path / "b")


def test_a_sliding_window_bounds_the_positions(tmp_path: Path) -> None:
    _saved("mistral", tmp_path)
    assert read_hf_config(tmp_path).config.max_seq_len == 32


def test_llama3_rope_scaling_is_read_and_changes_the_angles(tmp_path: Path) -> None:
    from pipetrain.models.llama import rotary_tables

    _saved("llama", tmp_path)
    config = read_hf_config(tmp_path).config
    assert config.rope_scaling == (8.0, 1.0, 4.0, 16)
    plain = rotary_tables(20, 8, 500000.0, torch.device("cpu"))
    scaled = rotary_tables(20, 8, 500000.0, torch.device("cpu"), config.rope_scaling)
    # Not a no-op, so the logits test above checks the scaling against transformers'.
    assert not torch.equal(plain[0], scaled[0])
