"""Models as ordered pipeline layers with global names, and stages built from them.

The configs import no torch, so planners and the CLI read them cheaply; the layers, specs
and stage builders (torch) load on first use of their names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipetrain.models.config import PRESETS, ModelConfig, ModelConfigError, get_model_config

if TYPE_CHECKING:
    from pipetrain.models.spec import LayerSpec, PipelineSpec, SpecError, TiedWeight, model_spec
    from pipetrain.models.stage import StageError, StageModule, build_full_model, build_stage

__all__ = [
    "PRESETS",
    "LayerSpec",
    "ModelConfig",
    "ModelConfigError",
    "PipelineSpec",
    "SpecError",
    "StageError",
    "StageModule",
    "TiedWeight",
    "build_full_model",
    "build_stage",
    "get_model_config",
    "model_spec",
]

_LAZY = {
    "LayerSpec": "spec",
    "PipelineSpec": "spec",
    "SpecError": "spec",
    "TiedWeight": "spec",
    "model_spec": "spec",
    "StageError": "stage",
    "StageModule": "stage",
    "build_full_model": "stage",
    "build_stage": "stage",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipetrain.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pipetrain.models.{module}"), name)
