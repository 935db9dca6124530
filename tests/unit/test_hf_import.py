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
    tensor_files,
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


def _mixtral() -> object:
    config = transformers.MixtralConfig(
        **SMALL, **ATTN, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
    )
    return transformers.MixtralForCausalLM(config)


def _gpt2() -> object:
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=3, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


MAKERS = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "mixtral": _mixtral,
    "gpt2": _gpt2,
}


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


@pytest.mark.parametrize("kind", sorted(MAKERS))
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
    # The very names transformers itself saved (Mixtral's experts one tensor each on disk,
    # fused in memory by transformers 5), a tied head once.
    assert set(hf_state_dict(weights, config)) == set(tensor_files(tmp_path / "in"))


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


def test_an_expert_parallel_rank_reads_only_its_own_experts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors

    _saved("mixtral", tmp_path, shard=True)
    read: list[str] = []
    real = safetensors.safe_open

    class Recording:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.file = real(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.file.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.__exit__(*exc)

        def __getattr__(self, name: str) -> object:  # headers: keys, get_slice
            return getattr(self.file, name)

        def get_tensor(self, key: str) -> torch.Tensor:
            read.append(key)
            return self.file.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    config = read_hf_config(tmp_path).config
    spec = model_spec(config, expert_shard=(1, 2))  # ep rank 1 of 2: experts 2 and 3
    full = build_full_model(spec, seed=3, device="cpu")
    load_hf_weights(full, tmp_path)
    experts = {k.split(".experts.")[1].split(".")[0] for k in read if ".experts." in k}
    assert experts == {"2", "3"}
    assert len(read) == len(full.state_dict())  # nothing else read, nothing read twice
    assert {k for k in read if "gate." in k} == {
        f"model.layers.{i}.block_sparse_moe.gate.weight" for i in range(3)
    }


def test_mixtral_options_pipetrain_does_not_compute_are_refused(tmp_path: Path) -> None:
    theirs = _saved("mixtral", tmp_path)
    with torch.no_grad():  # transformers' auxiliary loss goes to its loss, not its logits
        with_aux = theirs(TOKENS, labels=TOKENS, output_router_logits=True)
        assert with_aux.aux_loss is not None
        assert torch.equal(with_aux.logits, _their_logits(theirs))
    config = read_hf_config(tmp_path).config
    assert (config.n_experts, config.top_k, config.expert_ffn) == (4, 2, 48)
    assert config.router == "softmax" and config.router_norm_topk and config.capacity_factor == 0
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"sliding_window": 16}))
    assert read_hf_config(tmp_path).config.max_seq_len == 16  # a longer --seq-len is refused
    (tmp_path / "config.json").write_text(json.dumps(raw | {"router_jitter_noise": 0.1}))
    with pytest.raises(HFImportError, match=r"router_jitter_noise 0.1 \(0 only\), which pipetrain"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"router": "sigmoid"}, "a sigmoid router"),
        ({"n_shared_experts": 1}, "1 shared experts"),
        ({"bias_update_rate": 0.001}, "a routing bias"),
        ({"dense_first": 1}, "dense blocks .dense_first=1, moe_every=1."),
        ({"router_norm_topk": False}, "top-k weights not renormalised"),
    ],
)
def test_a_mixture_mixtral_cannot_express_is_not_exported(
    change: dict[str, object], said: str, tmp_path: Path
) -> None:
    from pipetrain.models import get_model_config
    from pipetrain.models.hf import HFExportError

    config = get_model_config("moe-tiny", **change)
    full = build_full_model(model_spec(config), seed=3, device="cpu")
    with pytest.raises(HFExportError, match=f"has {said}.*cannot express: export it with"):
        save_hf(tmp_path / "out", full.state_dict(), config)
    assert not (tmp_path / "out").exists()


def test_a_moe_checkpoint_exports_to_a_mixtral_transformers_loads(tmp_path: Path) -> None:
    import dataclasses

    from pipetrain.checkpoint import save_checkpoint
    from pipetrain.checkpoint.export import export_checkpoint
    from pipetrain.models import get_model_config

    config = get_model_config("moe-tiny", capacity_factor=0.0)
    spec = model_spec(config)
    pipe = build_pipeline(spec, schedule="1f1b", microbatches=2, ranks=2, seed=5)
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "name"}
    saved = save_checkpoint(tmp_path / "ck", 1, modules=pipe.modules, model=fields)
    result = export_checkpoint(saved.path, tmp_path / "hf", format="hf")
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        result.path, output_loading_info=True
    )
    assert type(theirs).__name__ == "MixtralForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    first, last = pipe.modules
    with torch.no_grad():
        torch.testing.assert_close(
            theirs.eval()(tokens).logits, last(first(tokens)), rtol=1e-5, atol=1e-5
        )
    back = _our_model(result.path)
    for name, tensor in back.state_dict().items():
        held = first.state_dict() | last.state_dict()
        assert torch.equal(tensor, held[name]), name
