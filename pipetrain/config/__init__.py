"""The configuration of a training run: the TOML schema, loading with ``--set`` overrides,
and the checks.

``TrainConfig`` holds one frozen section per table (``[model]``, ``[pipeline]``,
``[data]``, ``[optim]``, ``[run]``), each field documented where it is declared.
``load_config`` builds it from the defaults, a TOML file and overrides, and raises
``ConfigError`` (an ``InputError``: one line naming the field and the fix). Reading a
config does not import torch; ``run_folder`` (the first write of a run) is imported by
path.
"""

from pipetrain.config.checks import ConfigError, validate
from pipetrain.config.schema import (
    DataConfig,
    ModelSection,
    OptimConfig,
    PipelineConfig,
    RunConfig,
    TrainConfig,
    config_to_dict,
    config_to_toml,
    load_config,
    parse_override,
    settings_disagree,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "ModelSection",
    "OptimConfig",
    "PipelineConfig",
    "RunConfig",
    "TrainConfig",
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "parse_override",
    "settings_disagree",
    "validate",
]
