"""Runs any validated schedule across processes (or all ranks in one, the debug mode).

See ``pipetrain.runtime.api`` for the user-facing API and a complete example.
"""

from pipetrain.runtime.api import Pipeline
from pipetrain.runtime.build import build_pipeline
from pipetrain.runtime.device import default_device
from pipetrain.runtime.errors import PipelineError, PipelineInputError, StageMismatchError
from pipetrain.runtime.executor import PipelineHooks
from pipetrain.runtime.inputs import even_split
from pipetrain.runtime.result import StepResult

__all__ = [
    "Pipeline",
    "PipelineError",
    "PipelineHooks",
    "PipelineInputError",
    "StageMismatchError",
    "StepResult",
    "build_pipeline",
    "default_device",
    "even_split",
]
