"""Runs any validated schedule across processes (or all ranks in one, the debug mode).

See ``pipetrain.runtime.api`` for the user-facing API and a complete example.
"""

from pipetrain.runtime.api import Pipeline, StepResult, build_pipeline, default_device, even_split
from pipetrain.runtime.errors import PipelineError, PipelineInputError, StageMismatchError

__all__ = [
    "Pipeline",
    "PipelineError",
    "PipelineInputError",
    "StageMismatchError",
    "StepResult",
    "build_pipeline",
    "default_device",
    "even_split",
]
