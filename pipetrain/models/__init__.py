"""Models as ordered pipeline layers with global names, and stages built from them."""

from pipetrain.models.config import PRESETS, ModelConfig, ModelConfigError, get_model_config
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
