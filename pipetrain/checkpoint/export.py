"""Consolidate a checkpoint's weights into one safetensors file, in one process.

``native`` keeps the global names (``layers.3.attn.wq.weight``; a tied weight once, under
its canonical name), which ``load_weights`` puts back into any split of the model.
``hf`` renames a Llama-style model to Hugging Face Llama names and converts the query and
key projections from this model's interleaved rotary pairs to Hugging Face's halves.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetrain.checkpoint import state
from pipetrain.checkpoint.errors import CheckpointCorruptError, CheckpointError
from pipetrain.checkpoint.load import dcp_read, tensor_metadata
from pipetrain.checkpoint.manifest import Manifest, verify_checkpoint
from pipetrain.checkpoint.safetensors_io import read_safetensors, write_safetensors

__all__ = [
    "EXPORT_FORMATS",
    "ExportResult",
    "export_checkpoint",
    "hf_llama_weights",
    "load_weights",
    "read_weights",
]

EXPORT_FORMATS = ("native", "hf")


@dataclass(frozen=True)
class ExportResult:
    path: Path
    format: str
    tensors: int
    bytes: int


def read_weights(path: Path | str) -> tuple[dict[str, torch.Tensor], Manifest]:
    """Every model tensor of a verified checkpoint under its global name, on the CPU."""
    path = Path(path)
    verification = verify_checkpoint(path)
    if not verification.ok or verification.manifest is None:
        raise CheckpointCorruptError(verification.problems[0])
    wanted = {
        key: torch.empty(size, dtype=dtype)
        for key, (size, dtype) in tensor_metadata(path).items()
        if key.startswith(state.MODEL)
    }
    dcp_read(path, wanted)
    weights = {key[len(state.MODEL) :]: tensor for key, tensor in wanted.items()}
    return weights, verification.manifest


# Global Llama parameter name pattern -> Hugging Face name (block index kept).
_HF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")


def _pairs_to_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's output rows from (x0, x1), (x2, x3), ... rotary pairs to
    Hugging Face's [x0, x2, ...; x1, x3, ...] halves: the same rotation, other row order."""
    rows, cols = weight.shape
    head_dim = rows // heads
    return weight.reshape(heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_llama_weights(
    weights: Mapping[str, torch.Tensor], model: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    if model.get("family") != "llama":
        raise CheckpointError(
            f"--format hf maps Llama-style models only and this checkpoint's family is "
            f"{model.get('family')!r}: use --format native"
        )
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name == "embed.tok.weight":
            out["model.embed_tokens.weight"] = tensor
            if model.get("tie_embeddings"):
                out["lm_head.weight"] = tensor
        elif name == "head.norm.weight":
            out["model.norm.weight"] = tensor
        elif name == "head.out.weight":
            out["lm_head.weight"] = tensor
        elif (match := _BLOCK.match(name)) and match.group(2) in _HF_BLOCK:
            index, local = match.groups()
            if local == "attn.wq.weight":
                tensor = _pairs_to_halves(tensor, int(model["n_heads"]))
            elif local == "attn.wk.weight":
                tensor = _pairs_to_halves(tensor, int(model["n_kv_heads"]))
            out[f"model.layers.{index}.{_HF_BLOCK[local]}"] = tensor
        else:
            raise CheckpointError(
                f"parameter {name!r} has no Hugging Face Llama name: use --format native"
            )
    return out


def _hf_config(model: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model["vocab_size"],
        "hidden_size": model["d_model"],
        "intermediate_size": model["ffn_hidden"],
        "num_hidden_layers": model["n_layers"],
        "num_attention_heads": model["n_heads"],
        "num_key_value_heads": model["n_kv_heads"],
        "max_position_embeddings": model["max_seq_len"],
        "rms_norm_eps": model.get("norm_eps", 1e-5),
        "rope_theta": model.get("rope_theta", 10000.0),
        "tie_word_embeddings": bool(model.get("tie_embeddings")),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def export_checkpoint(path: Path | str, out: Path | str, *, format: str = "native") -> ExportResult:
    """Write the checkpoint's weights to ``out``; the manifest's model config (and, for
    ``hf``, a Hugging Face ``config.json`` body) goes into the file's metadata."""
    if format not in EXPORT_FORMATS:
        raise CheckpointError(f"export format {format!r} is unknown: use one of {EXPORT_FORMATS}")
    weights, manifest = read_weights(path)
    metadata = {
        "format": f"pipetrain-{format}",
        "step": str(manifest.step),
        "model": json.dumps(dict(manifest.model), sort_keys=True),
    }
    if format == "hf":
        weights = hf_llama_weights(weights, manifest.model)
        metadata = {"format": "pt", "hf_config": json.dumps(_hf_config(manifest.model))}
    out = Path(out)
    if not out.name or out.is_dir():
        raise CheckpointError(
            f"cannot write the export to {out}: it is a directory; pass --out a file path "
            f"such as {out / 'model.safetensors'}"
        )
    # Written beside the target and renamed over it: an export that fails half-way (a
    # full disk, a kill) leaves any earlier file at ``out`` whole.
    partial = out.with_name(f".{out.name}.partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        size = write_safetensors(partial, weights, metadata)
        partial.replace(out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise CheckpointError(
            f"cannot write the export to {out} ({exc}); pass --out a file path in a writable directory"
        ) from None
    return ExportResult(out, format, len(weights), size)


def load_weights(modules: nn.Module | Iterable[nn.Module], file: Path | str) -> tuple[str, ...]:
    """Copy a native export into stage modules (any split; tied copies all filled).
    Returns the file's tensor names that no module here holds; a module parameter that
    the file lacks, or whose shape differs, raises CheckpointError naming it."""
    tensors, _ = read_safetensors(file)
    index = state.index_parameters([modules] if isinstance(modules, nn.Module) else modules)
    with torch.no_grad():
        for key, copies in index.tensors.items():
            if key not in tensors:
                raise CheckpointError(
                    f"{file} has no tensor {key!r}: export a checkpoint of this model"
                )
            if tuple(tensors[key].shape) != tuple(copies[0].shape):
                raise CheckpointError(
                    f"{file}: {key} has shape {tuple(tensors[key].shape)}, the model "
                    f"{tuple(copies[0].shape)}: export a checkpoint of this model"
                )
            for tensor in copies:
                tensor.copy_(tensors[key])
    return tuple(sorted(set(tensors) - set(index.tensors)))
