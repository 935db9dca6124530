"""Distributed checkpoints keyed by global parameter names.

Every rank saves its own stage modules with torch.distributed.checkpoint; the files,
a manifest with their checksums and a completion marker appear under
``ROOT/step_NNNNNN/`` atomically. Any layout (pipeline size, chunks, schedule) loads any
checkpoint of the same model; ``export`` consolidates the weights into one safetensors
file with global (or Hugging Face) names.
"""

from pipetrain.checkpoint.directory import (
    CheckpointList,
    ResumeChoice,
    choose_resume,
    list_checkpoints,
)
from pipetrain.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompatibleError,
)
from pipetrain.checkpoint.export import (
    EXPORT_FORMATS,
    ExportResult,
    export_checkpoint,
    load_weights,
    read_weights,
)
from pipetrain.checkpoint.load import LoadResult, load_checkpoint, resume_checkpoint
from pipetrain.checkpoint.manifest import (
    FORMAT_VERSION,
    Layout,
    Manifest,
    Verification,
    read_manifest,
    verify_checkpoint,
)
from pipetrain.checkpoint.save import SaveResult, save_checkpoint
from pipetrain.checkpoint.trainer import CheckpointPolicy, RunCheckpoints, StopSignal

__all__ = [
    "EXPORT_FORMATS",
    "FORMAT_VERSION",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompatibleError",
    "CheckpointList",
    "CheckpointPolicy",
    "ExportResult",
    "Layout",
    "LoadResult",
    "Manifest",
    "ResumeChoice",
    "RunCheckpoints",
    "SaveResult",
    "StopSignal",
    "Verification",
    "choose_resume",
    "export_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_weights",
    "read_manifest",
    "read_weights",
    "resume_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
