"""The synchronous trainer: a run's set-up (``session``), its step loop and finish
(``loop``), optimizer, metrics and sample; the asynchronous one is ``pipedream``.

``train(config, role)`` runs one process of a run. The configuration is
``pipetrain.config``, the processes ``pipetrain.launch``, data parallelism
``pipetrain.parallel``. The names below are imported when first used, so that reading a
config does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "train": "pipetrain.train.loop",
    "resolve_device": "pipetrain.train.loop",
    "RunSummary": "pipetrain.train.metrics",
    "TrainingDiverged": "pipetrain.train.optim",
    "TrainConfig": "pipetrain.config",
    "ConfigError": "pipetrain.config",
    "load_config": "pipetrain.config",
    "ProcessRole": "pipetrain.launch",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'pipetrain.train' has no attribute {name!r}")
