"""Starting the processes of a run and ending them: the process role, the local launcher,
the rendezvous, the worker entry point, the process exit and the guards that end a rank
whose launcher died or whose step outlives a stop's grace.

It knows no trainer: ``launch_local`` is told which function each worker trains with.
Nothing here imports torch at import time (a worker installs its stop handler before
torch comes), so the rendezvous's names are imported when first used.
"""

from typing import Any

from pipetrain.launch.local import LaunchFailed, launch_local
from pipetrain.launch.process_exit import exit_rank, exit_record, launched_rank
from pipetrain.launch.role import ProcessRole, role_from_env

__all__ = [
    "LaunchFailed",
    "ProcessRole",
    "exit_rank",
    "exit_record",
    "join_process_group",
    "launch_local",
    "launched_rank",
    "report_failure",
    "role_from_env",
]


def __getattr__(name: str) -> Any:
    if name in ("join_process_group", "report_failure"):
        from pipetrain.launch import rendezvous

        return getattr(rendezvous, name)
    raise AttributeError(f"module 'pipetrain.launch' has no attribute {name!r}")
