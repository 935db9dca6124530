"""Model configurations and named presets (torch-free: the planner reads them without torch).

A config names a family ("llama" or "gpt2") and its sizes. Presets go from tiny models for
tests to the real sizes the planner and the simulator reason about.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.errors import InputError

__all__ = ["PRESETS", "ModelConfig", "ModelConfigError", "get_model_config", "parse_overrides"]

FAMILIES = ("llama", "gpt2")


class ModelConfigError(InputError):
    """A model config field that no model can be built from; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a decoder-only transformer; every field is validated on construction."""

    # "llama": RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP.
    # "gpt2": learned positions, LayerNorm, GELU MLP, biases.
    family: str
    vocab_size: int
    d_model: int
    n_layers: int  # transformer blocks; the pipeline has n_layers + 2 layers (embed, head)
    n_heads: int
    n_kv_heads: int  # grouped-query attention: n_heads must be a multiple of it
    ffn_hidden: int  # hidden width of the MLP (SwiGLU: of each of w1 and w3)
    max_seq_len: int
    tie_embeddings: bool  # the LM head reuses the token embedding matrix
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0  # llama only
    name: str = "custom"
    # Llama 3's rotary scaling (Hugging Face rope_type "llama3"): long wavelengths divided by
    # the factor, short ones kept, the band between blended. 1.0 (the default): none.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    qkv_bias: bool = False  # llama only: biases on the q, k, v projections (Qwen2)
    # Mixture of experts (llama only; pipetrain.models.moe). 0 experts: every block dense.
    n_experts: int = 0
    top_k: int = 2  # experts per token
    expert_ffn: int = 0  # hidden width of each expert's SwiGLU; 0: ffn_hidden
    n_shared_experts: int = 0  # experts every token goes through (DeepSeek), expert_ffn wide each
    moe_every: int = 1  # every moe_every-th block (after dense_first) is a MoE block
    dense_first: int = 0  # the first blocks stay dense (DeepSeek-V3: 3)
    router: str = "softmax"  # router scores: "softmax" (Mixtral) or "sigmoid" (DeepSeek-V3)
    router_norm_topk: bool = True  # the chosen experts' weights renormalised to sum to 1
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss (Switch/GShard); 0: off
    bias_update_rate: float = 0.0  # DeepSeek-V3's aux-loss-free bias step per update; 0: off
    capacity_factor: float = 0.0  # > 0: an expert takes at most this x its fair share; 0: dropless

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ModelConfigError(
                f"model family {self.family!r} is unknown: use one of {', '.join(FAMILIES)}"
            )
        for field in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_hidden",
            "max_seq_len",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(f"model {field} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ModelConfigError(
                f"model d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                "change one so that d_model / n_heads is whole"
            )
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"model n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: "
                "pick n_kv_heads that divides n_heads"
            )
        if self.family == "gpt2" and self.n_kv_heads != self.n_heads:
            # GPT-2's attention has no grouped queries: a smaller n_kv_heads would be ignored.
            raise ModelConfigError(
                f"model n_kv_heads={self.n_kv_heads} but gpt2 attention has one key/value head per "
                f"query head: set n_kv_heads={self.n_heads} (grouped-query attention is llama's)"
            )
        if self.family == "llama" and self.head_dim % 2:
            raise ModelConfigError(
                f"llama head size d_model/n_heads={self.head_dim} must be even for rotary positions"
            )
        # inf passes "> 0" but zeroes every normalised activation (or every rotation angle).
        if not 0 < self.norm_eps < math.inf:
            raise ModelConfigError(f"model norm_eps must be finite and > 0, got {self.norm_eps!r}")
        if not 0 < self.rope_theta < math.inf:
            raise ModelConfigError(
                f"model rope_theta must be finite and > 0, got {self.rope_theta!r}"
            )
        self._check_llama_options()
        self._check_moe_options()

    def _check_moe_options(self) -> None:
        if not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ModelConfigError(
                f"model n_experts must be >= 0 (0: dense), got {self.n_experts!r}"
            )
        if not self.n_experts:
            return
        if self.family != "llama":
            raise ModelConfigError(
                f"model n_experts={self.n_experts}: mixture-of-experts blocks are llama blocks; "
                f"set n_experts=0 for family {self.family!r}"
            )
        for field in ("top_k", "moe_every"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"model {field} must be a positive integer, got {value!r}")
        if self.top_k > self.n_experts:
            raise ModelConfigError(
                f"model top_k={self.top_k} is more than n_experts={self.n_experts}: a token "
                f"cannot go to more experts than there are; lower top_k"
            )
        for field in ("expert_ffn", "n_shared_experts", "dense_first"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ModelConfigError(f"model {field} must be an integer >= 0, got {value!r}")
        if self.router not in ("softmax", "sigmoid"):
            raise ModelConfigError(
                f"model router {self.router!r} is unknown: use 'softmax' or 'sigmoid'"
            )
        for field in ("aux_loss_coef", "bias_update_rate", "capacity_factor"):
            value = getattr(self, field)
            if not 0 <= value < math.inf:
                raise ModelConfigError(f"model {field} must be finite and >= 0, got {value!r}")
        if not self.moe_blocks:
            raise ModelConfigError(
                f"model n_experts={self.n_experts} but no block is a MoE block (n_layers="
                f"{self.n_layers}, dense_first={self.dense_first}, moe_every={self.moe_every}): "
                f"lower dense_first or moe_every"
            )

    @property
    def expert_hidden(self) -> int:
        """Hidden width of one expert (``expert_ffn``, or ``ffn_hidden`` when 0)."""
        return self.expert_ffn or self.ffn_hidden

    def is_moe_block(self, block: int) -> bool:
        """Whether block ``block`` (0-based) has experts instead of a dense MLP."""
        if not self.n_experts or block < self.dense_first:
            return False
        return (block - self.dense_first) % self.moe_every == self.moe_every - 1

    @property
    def moe_blocks(self) -> tuple[int, ...]:
        return tuple(b for b in range(self.n_layers) if self.is_moe_block(b))

    def _check_llama_options(self) -> None:
        if not 1.0 <= self.rope_scaling_factor < math.inf:
            raise ModelConfigError(
                f"model rope_scaling_factor must be finite and >= 1 (1: no scaling), got "
                f"{self.rope_scaling_factor!r}"
            )
        if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor < math.inf:
            raise ModelConfigError(
                f"model rope_low_freq_factor={self.rope_low_freq_factor!r} and "
                f"rope_high_freq_factor={self.rope_high_freq_factor!r} must satisfy "
                "0 < low < high (Llama 3: 1 and 4)"
            )
        if not isinstance(self.rope_original_max_len, int) or self.rope_original_max_len < 1:
            raise ModelConfigError(
                f"model rope_original_max_len must be a positive integer, got "
                f"{self.rope_original_max_len!r}"
            )
        if self.family != "llama" and (self.qkv_bias or self.rope_scaling is not None):
            raise ModelConfigError(
                f"model qkv_bias and rope_scaling_factor are llama options; gpt2 has biases "
                f"everywhere and learned positions: drop them for family {self.family!r}"
            )

    @property
    def rope_scaling(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original length), None unscaled."""
        if self.rope_scaling_factor == 1.0:
            return None
        return (
            self.rope_scaling_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_len,
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def num_pipeline_layers(self) -> int:
        """Embedding, the blocks, and the head."""
        return self.n_layers + 2


PRESETS: dict[str, ModelConfig] = {
    config.name: config
    for config in (
        ModelConfig("llama", 256, 32, 4, 4, 2, 64, 64, False, name="llama-tiny"),
        ModelConfig("gpt2", 256, 32, 3, 4, 4, 128, 64, True, name="gpt2-tiny"),
        # The main job: 3 stages x 4 blocks on a 2-core CPU, batch 32 x 128 in 8 micro-batches.
        # About 2.4 M parameters, so 60-100 steps fit in a few minutes.
        ModelConfig("llama", 256, 128, 12, 4, 2, 384, 128, False, name="llama-default"),
        # The default's wider sibling, for layouts that split layers (tp up to 4 divides its
        # 8 heads and 4 KV heads): about 25 M parameters.
        ModelConfig("llama", 256, 512, 8, 8, 4, 1536, 128, False, name="llama-wide"),
        ModelConfig("gpt2", 50257, 768, 12, 12, 12, 3072, 1024, True, name="gpt2-124m"),
        # Llama 3.2 1B and Llama 3.1 8B (context limited to 8192 for planning).
        ModelConfig(
            "llama", 128256, 2048, 16, 32, 8, 8192, 8192, True, 1e-5, 500_000.0, "llama3-1b"
        ),
        ModelConfig(
            "llama", 128256, 4096, 32, 32, 8, 14336, 8192, False, 1e-5, 500_000.0, "llama3-8b"
        ),
        # Mixtures of experts: 4 experts, top-2, for tests; and the default's MoE sibling with
        # the same active width per token (2 of 8 experts of 192 = the dense 384).
        ModelConfig(
            "llama",
            256,
            32,
            4,
            4,
            2,
            64,
            64,
            False,
            name="moe-tiny",
            n_experts=4,
            top_k=2,
            expert_ffn=32,
        ),
        ModelConfig(
            "llama",
            256,
            128,
            12,
            4,
            2,
            384,
            128,
            False,
            name="moe-default",
            n_experts=8,
            top_k=2,
            expert_ffn=192,
        ),
        # Mixtral 8x7B (46.7 B parameters, 12.9 B active) and a DeepSeek-V3-sized model
        # (671 B, 256 routed experts of which 8 per token, one shared, 3 dense blocks first,
        # sigmoid router with the loss-free bias; attention counted as GQA, not MLA): for
        # the planner and the meta device only.
        ModelConfig(
            "llama",
            32000,
            4096,
            32,
            32,
            8,
            14336,
            8192,
            False,
            1e-5,
            1_000_000.0,
            "mixtral-8x7b",
            n_experts=8,
            top_k=2,
            aux_loss_coef=0.02,
        ),
        ModelConfig(
            "llama",
            129280,
            7168,
            61,
            128,
            128,
            18432,
            8192,
            False,
            1e-6,
            10_000.0,
            "deepseek-v3",
            n_experts=256,
            top_k=8,
            expert_ffn=2048,
            n_shared_experts=1,
            dense_first=3,
            router="sigmoid",
            aux_loss_coef=0.0001,
            bias_update_rate=0.001,
        ),
        # Llama 3.1 70B: for the planner and the meta device only (about 70.6 B parameters,
        # 282 GB in fp32: never materialised on this machine).
        ModelConfig(
            "llama", 128256, 8192, 80, 64, 8, 28672, 8192, False, 1e-5, 500_000.0, "llama3-70b"
        ),
    )
}


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["n_layers=24", "tie_embeddings=true"]`` -> typed overrides for ``get_model_config``."""
    kinds = {f.name: str(f.type) for f in dataclasses.fields(ModelConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or key not in kinds:
            raise ModelConfigError(
                f"model override {item!r} is not FIELD=VALUE with a field of {', '.join(kinds)}"
            )
        kind = kinds[key]
        try:
            if kind == "bool":
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(raw)
                out[key] = raw.lower() in ("true", "1")
            else:
                out[key] = {"int": int, "float": float}.get(kind, str)(raw)
        except ValueError:
            raise ModelConfigError(f"model override {key}={raw!r} is not a valid {kind}") from None
    return out


def get_model_config(name: str, /, **overrides: Any) -> ModelConfig:
    """The preset ``name`` with some fields replaced (``get_model_config("llama-tiny", n_layers=6)``)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ModelConfigError(f"unknown model {name!r}: use one of {', '.join(PRESETS)}") from None
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ModelConfigError(
            f"unknown model field(s) {', '.join(unknown)}: use some of {', '.join(sorted(fields))}"
        )
    return dataclasses.replace(base, **overrides)
