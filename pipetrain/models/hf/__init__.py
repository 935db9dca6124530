"""Hugging Face model directories in and out: Llama (with Llama 3's rotary scaling),
Mistral, Qwen2, Mixtral and GPT-2.

``read_hf_config(DIR)`` gives the architecture and the ``ModelConfig`` of config.json;
build the pipeline (or the full model) from that config, then ``load_hf_weights(pipe,
DIR)`` fills each stage with its own tensors only. ``save_hf(DIR, weights, config)``
writes a directory that transformers' ``AutoModelForCausalLM.from_pretrained`` loads.
The config and the files' checks import no torch; the conversions load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipetrain.models.hf.config import (
    ARCHITECTURES,
    HFExportError,
    HFImportError,
    HFModel,
    check_mixtral,
    hf_config_dict,
    read_hf_config,
)
from pipetrain.models.hf.files import check_weights, tensor_files, tokenizer_file
from pipetrain.models.hf.names import Source, weight_sources

if TYPE_CHECKING:
    from pipetrain.models.hf.convert import (
        HFLoad,
        full_modules,
        hf_state_dict,
        load_hf_weights,
        save_hf,
    )

__all__ = [
    "ARCHITECTURES",
    "HFExportError",
    "HFImportError",
    "HFLoad",
    "HFModel",
    "Source",
    "check_mixtral",
    "check_weights",
    "full_modules",
    "hf_config_dict",
    "hf_state_dict",
    "load_hf_weights",
    "read_hf_config",
    "save_hf",
    "tensor_files",
    "tokenizer_file",
    "weight_sources",
]

_LAZY = ("HFLoad", "full_modules", "hf_state_dict", "load_hf_weights", "save_hf")


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pipetrain.models.hf' has no attribute {name!r}")
    return getattr(importlib.import_module("pipetrain.models.hf.convert"), name)
