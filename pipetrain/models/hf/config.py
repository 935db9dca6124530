"""A Hugging Face ``config.json`` as a ``ModelConfig``, and back (torch-free).

Five architectures map onto pipetrain's two families: Llama, Mistral, Qwen2 and Mixtral
are the llama family (Qwen2 with q/k/v biases, Llama 3 with its rotary scaling, Mixtral
with a mixture of experts in every block), GPT-2 the gpt2 family. Anything these models would compute differently (a sliding window shorter than
the sequence, biases elsewhere, another activation) is refused in one line, never
imported into a model that computes something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.errors import InputError
from pipetrain.models.config import ModelConfig, ModelConfigError

__all__ = [
    "ARCHITECTURES",
    "HFExportError",
    "HFImportError",
    "HFModel",
    "check_mixtral",
    "hf_config_dict",
    "read_hf_config",
]

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "GPT2LMHeadModel",
)
_MODEL_TYPES = dict(
    zip(ARCHITECTURES, ("llama", "mistral", "qwen2", "mixtral", "gpt2"), strict=True)
)
_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM")  # a window whenever one is given


class HFImportError(InputError):
    """A Hugging Face model directory that cannot be imported: one line, the fix."""


class HFExportError(InputError):
    """A model that no supported Hugging Face architecture expresses: one line, the fix."""


@dataclass(frozen=True)
class HFModel:
    """A model directory's architecture and the pipetrain model it describes."""

    architecture: str
    config: ModelConfig


def read_hf_config(directory: Path | str) -> HFModel:
    """``DIR/config.json`` as an architecture and a ``ModelConfig`` (named after DIR)."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFImportError(
            f"{path} does not exist: pass a Hugging Face model directory (config.json, "
            "model.safetensors or its shards, tokenizer.json)"
        ) from None
    except (OSError, ValueError) as exc:
        raise HFImportError(f"{path} is not readable JSON ({exc})") from None
    names = raw.get("architectures") or []
    architecture = names[0] if len(names) == 1 else None
    if architecture not in ARCHITECTURES:
        raise HFImportError(
            f"{path}: architecture {names!r} is not supported: use a model of "
            f"{', '.join(ARCHITECTURES)}"
        )
    try:
        if architecture == "GPT2LMHeadModel":
            config = _gpt2_config(raw, path)
        else:
            config = _llama_config(raw, path, architecture)
    except ModelConfigError as exc:
        raise HFImportError(f"{path}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise HFImportError(f"{path}: field {exc} is missing or malformed") from None
    return HFModel(architecture, config)


def _refuse(path: Path, what: str) -> HFImportError:
    return HFImportError(f"{path}: {what}, which pipetrain's model does not compute")


def _rope(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """Rotary settings, from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (earlier)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10_000.0)))
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "llama3":
        raise _refuse(path, f"rope type {kind!r} (supported: default, llama3)")
    return {
        "rope_theta": theta,
        "rope_scaling_factor": float(params["factor"]),
        "rope_low_freq_factor": float(params["low_freq_factor"]),
        "rope_high_freq_factor": float(params["high_freq_factor"]),
        "rope_original_max_len": int(params["original_max_position_embeddings"]),
    }


def _llama_config(raw: dict[str, Any], path: Path, architecture: str) -> ModelConfig:
    d_model, n_heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    head_dim = raw.get("head_dim") or d_model // n_heads
    if head_dim * n_heads != d_model:
        raise _refuse(path, f"head_dim {head_dim} x {n_heads} heads != hidden_size {d_model}")
    if raw.get("hidden_act", "silu") != "silu":
        raise _refuse(path, f"hidden_act {raw['hidden_act']!r} (SwiGLU uses silu)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise _refuse(path, "attention_bias or mlp_bias is true")
    max_len = int(raw["max_position_embeddings"])
    window = raw.get("sliding_window")
    if window and (architecture in _WINDOWED or raw.get("use_sliding_window")):
        # Attention over the whole prefix equals the sliding window's while the sequence
        # fits in the window: the model's positions are cut to it, so a longer
        # --seq-len is refused by the run's own check instead of computing otherwise.
        max_len = min(max_len, int(window))
    return ModelConfig(
        "llama",
        vocab_size=int(raw["vocab_size"]),
        d_model=d_model,
        n_layers=int(raw["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        ffn_hidden=int(raw["intermediate_size"]),
        max_seq_len=max_len,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        name=path.parent.name or "hf",
        qkv_bias=architecture == "Qwen2ForCausalLM",
        **_rope(raw, path),
        **(_mixtral_experts(raw, path) if architecture == "MixtralForCausalLM" else {}),
    )


def _mixtral_experts(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """Mixtral's sparse block as pipetrain's MoE options: softmax over every expert, the
    top k renormalised, dropless, each expert as wide as ``intermediate_size``.

    ``router_aux_loss_coef`` weighs pipetrain's per-layer Switch loss
    (``pipetrain.models.moe``); transformers adds its own, computed over all layers at once,
    only with ``output_router_logits``. Neither changes the logits."""
    if float(raw.get("router_jitter_noise") or 0.0) != 0.0:
        raise _refuse(path, f"router_jitter_noise {raw['router_jitter_noise']!r} (0 only)")
    return {
        "n_experts": int(raw["num_local_experts"]),
        "top_k": int(raw["num_experts_per_tok"]),
        "expert_ffn": int(raw["intermediate_size"]),
        "aux_loss_coef": float(raw.get("router_aux_loss_coef", 0.001)),
    }


def _gpt2_config(raw: dict[str, Any], path: Path) -> ModelConfig:
    if raw.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _refuse(path, f"activation_function {raw['activation_function']!r} (tanh GELU)")
    for flag, default in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("add_cross_attention", False),
    ):
        if bool(raw.get(flag, default)) != default:
            raise _refuse(path, f"{flag} is {raw[flag]!r}")
    d_model = int(raw["n_embd"])
    return ModelConfig(
        "gpt2",
        vocab_size=int(raw["vocab_size"]),
        d_model=d_model,
        n_layers=int(raw["n_layer"]),
        n_heads=int(raw["n_head"]),
        n_kv_heads=int(raw["n_head"]),
        ffn_hidden=int(raw.get("n_inner") or 4 * d_model),
        max_seq_len=int(raw["n_positions"]),
        tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        name=path.parent.name or "hf",
    )


def hf_config_dict(config: ModelConfig, architecture: str | None = None) -> dict[str, Any]:
    """The ``config.json`` body transformers builds ``config``'s model from.

    ``architecture`` None: GPT-2 for the gpt2 family, Mixtral for a mixture of experts
    (one Mixtral can express, else ``HFExportError``), Qwen2 for a llama with q/k/v
    biases, else Llama."""
    if config.n_experts:
        check_mixtral(config)
    if architecture is None:
        architecture = (
            "GPT2LMHeadModel"
            if config.family == "gpt2"
            else "MixtralForCausalLM"
            if config.n_experts
            else "Qwen2ForCausalLM"
            if config.qkv_bias
            else "LlamaForCausalLM"
        )
    common = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES[architecture],
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": "float32",
    }
    if config.family == "gpt2":
        return common | {
            "n_embd": config.d_model,
            "n_layer": config.n_layers,
            "n_head": config.n_heads,
            "n_inner": config.ffn_hidden,
            "n_positions": config.max_seq_len,
            "layer_norm_epsilon": config.norm_eps,
            "activation_function": "gelu_new",
        }
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        factor, low, high, original = config.rope_scaling
        rope |= {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
    experts = _mixtral_fields(config) if config.n_experts else {}
    return common | {
        "hidden_size": config.d_model,
        "intermediate_size": config.expert_hidden if config.n_experts else config.ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta/rope_scaling.
        "rope_theta": config.rope_theta,
        "rope_scaling": rope if config.rope_scaling is not None else None,
        "rope_parameters": rope,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": False,
        "mlp_bias": False,
        **experts,
    }


def _mixtral_fields(config: ModelConfig) -> dict[str, Any]:
    return {
        "num_local_experts": config.n_experts,
        "num_experts_per_tok": config.top_k,
        "router_aux_loss_coef": config.aux_loss_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


def check_mixtral(config: ModelConfig) -> None:
    """A mixture of experts that Mixtral computes too, else one line naming what differs.

    Mixtral: every block sparse, a softmax router whose top k are renormalised, no shared
    experts, no routing bias, no q/k/v biases. A capacity factor is a training option
    (Mixtral is dropless), not a different model: it is written as is."""
    problems = (
        (config.router != "softmax", f"a {config.router} router (Mixtral's is softmax)"),
        (not config.router_norm_topk, "top-k weights not renormalised (router_norm_topk)"),
        (config.n_shared_experts > 0, f"{config.n_shared_experts} shared experts"),
        (config.bias_update_rate > 0, "a routing bias (bias_update_rate > 0)"),
        (
            config.dense_first > 0 or config.moe_every != 1,
            f"dense blocks (dense_first={config.dense_first}, moe_every={config.moe_every})",
        ),
        (config.qkv_bias, "q/k/v biases"),
    )
    found = [what for bad, what in problems if bad]
    if found:
        raise HFExportError(
            f"model {config.name!r} has {', '.join(found)}, which a Hugging Face "
            "MixtralForCausalLM cannot express: export it with --format native"
        )
