"""The configuration of a training run: the TOML schema, loading with ``--set`` overrides,
and the checks.

``TrainConfig`` holds one frozen section per table (``[model]``, ``[pipeline]``,
``[data]``, ``[optim]``, ``[run]``), each field documented by the string under it, each
section checking its own fields when built (``schema``). ``load_config`` (``load``)
builds it from the defaults, a TOML file and overrides, and ``validate`` (``checks``)
checks what relates sections; all raise ``ConfigError`` (``errors``; an ``InputError``:
one line naming the field and the fix). Reading a config does not import torch;
``run_folder`` (the first write of a run), ``docs`` (the field docs, for ``--help``) and
``elastic`` (a config re-planned for another number of processes, on a restart) are
imported by path.
"""

from pipetrain.config.checks import validate
from pipetrain.config.errors import ConfigError
from pipetrain.config.load import (
    config_to_dict,
    config_to_toml,
    load_config,
    parse_override,
    settings_disagree,
)
from pipetrain.config.schema import (
    DataConfig,
    ModelSection,
    OptimConfig,
    PipelineConfig,
    RunConfig,
    TrainConfig,
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
