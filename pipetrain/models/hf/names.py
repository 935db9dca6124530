"""Name maps: each pipetrain global parameter name and the Hugging Face tensor it comes
from, per architecture (torch-free: plans check shapes with it before loading anything).

A ``Source`` says how to turn the Hugging Face tensor into pipetrain's: take one of
``parts`` equal slices along the last dimension (GPT-2's fused ``c_attn``), transpose
(GPT-2's ``Conv1D`` stores (in, out)), and reorder each head's rows from Hugging Face's
rotary halves to pipetrain's interleaved pairs (Llama's q and k). Export runs it
backwards (``pipetrain.models.hf.convert``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.models.config import ModelConfig
from pipetrain.models.hf.config import check_mixtral

__all__ = ["Source", "weight_sources"]


@dataclass(frozen=True)
class Source:
    """Where one pipetrain parameter lives in a Hugging Face checkpoint."""

    key: str  # the Hugging Face tensor name
    shape: tuple[int, ...]  # that tensor's whole shape, as config.json implies it
    part: int = 0  # which of ``parts`` equal slices of the last dimension
    parts: int = 1
    transpose: bool = False  # Conv1D (in, out) -> Linear (out, in)
    rope_heads: int = 0  # > 0: rows per head in rotary halves -> interleaved pairs


_LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}


def weight_sources(config: ModelConfig) -> dict[str, Source]:
    """Global name -> its source, for every parameter of ``config``'s model (a tied head
    reads the embedding). A mixture of experts maps to Mixtral's names, or is refused
    (``HFExportError``) when Mixtral cannot express it."""
    if config.n_experts:
        check_mixtral(config)
    return _gpt2(config) if config.family == "gpt2" else _llama(config)


def _mixtral_block(c: ModelConfig, i: int) -> dict[str, Source]:
    """Block ``i``'s router and experts (``layers.i.moe.*``) in Mixtral's
    ``block_sparse_moe``: the same router rows and expert matrices, under other names."""
    d, ffn = c.d_model, c.expert_hidden
    hf = f"model.layers.{i}.block_sparse_moe"
    out = {f"layers.{i}.moe.gate.weight": Source(f"{hf}.gate.weight", (c.n_experts, d))}
    for e in range(c.n_experts):
        for w, shape in (("w1", (ffn, d)), ("w3", (ffn, d)), ("w2", (d, ffn))):
            key = f"experts.{e}.{w}.weight"
            out[f"layers.{i}.moe.{key}"] = Source(f"{hf}.{key}", shape)
    return out


def _llama(c: ModelConfig) -> dict[str, Source]:
    d, kv, ffn = c.d_model, c.kv_dim, c.ffn_hidden
    embed = Source("model.embed_tokens.weight", (c.vocab_size, d))
    out = {
        "embed.tok.weight": embed,
        "head.norm.weight": Source("model.norm.weight", (d,)),
        "head.out.weight": embed
        if c.tie_embeddings
        else Source("lm_head.weight", (c.vocab_size, d)),
    }
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (d,),
        "attn.wq.weight": (d, d),
        "attn.wk.weight": (kv, d),
        "attn.wv.weight": (kv, d),
        "attn.wo.weight": (d, d),
        "mlp_norm.weight": (d,),
        "mlp.w1.weight": (ffn, d),
        "mlp.w3.weight": (ffn, d),
        "mlp.w2.weight": (d, ffn),
    }
    if c.qkv_bias:
        shapes |= {"attn.wq.bias": (d,), "attn.wk.bias": (kv,), "attn.wv.bias": (kv,)}
    heads = {"attn.wq": c.n_heads, "attn.wk": c.n_kv_heads}
    for i in range(c.n_layers):
        moe = c.is_moe_block(i)
        if moe:
            out |= _mixtral_block(c, i)
        for local, shape in shapes.items():
            if moe and local.startswith("mlp."):
                continue
            rope = heads.get(local.rpartition(".")[0], 0)
            key = f"model.layers.{i}.{_LLAMA_BLOCK[local]}"
            out[f"layers.{i}.{local}"] = Source(key, shape, rope_heads=rope)
    return out


def _gpt2(c: ModelConfig) -> dict[str, Source]:
    d, ffn = c.d_model, c.ffn_hidden
    embed = Source("transformer.wte.weight", (c.vocab_size, d))
    out = {
        "embed.tok.weight": embed,
        "embed.pos.weight": Source("transformer.wpe.weight", (c.max_seq_len, d)),
        "head.norm.weight": Source("transformer.ln_f.weight", (d,)),
        "head.norm.bias": Source("transformer.ln_f.bias", (d,)),
        "head.out.weight": embed
        if c.tie_embeddings
        else Source("lm_head.weight", (c.vocab_size, d)),
    }
    for i in range(c.n_layers):
        h = f"transformer.h.{i}"
        block = {
            "ln1.weight": Source(f"{h}.ln_1.weight", (d,)),
            "ln1.bias": Source(f"{h}.ln_1.bias", (d,)),
            "ln2.weight": Source(f"{h}.ln_2.weight", (d,)),
            "ln2.bias": Source(f"{h}.ln_2.bias", (d,)),
            "attn.wo.weight": Source(f"{h}.attn.c_proj.weight", (d, d), transpose=True),
            "attn.wo.bias": Source(f"{h}.attn.c_proj.bias", (d,)),
            "mlp.fc.weight": Source(f"{h}.mlp.c_fc.weight", (d, ffn), transpose=True),
            "mlp.fc.bias": Source(f"{h}.mlp.c_fc.bias", (ffn,)),
            "mlp.proj.weight": Source(f"{h}.mlp.c_proj.weight", (ffn, d), transpose=True),
            "mlp.proj.bias": Source(f"{h}.mlp.c_proj.bias", (d,)),
        }
        # One fused (d, 3d) projection: q, k and v are its thirds, in that order.
        for part, name in enumerate(("wq", "wk", "wv")):
            block[f"attn.{name}.weight"] = Source(
                f"{h}.attn.c_attn.weight", (d, 3 * d), part, 3, transpose=True
            )
            block[f"attn.{name}.bias"] = Source(f"{h}.attn.c_attn.bias", (3 * d,), part, 3)
        out |= {f"layers.{i}.{local}": source for local, source in block.items()}
    return out
