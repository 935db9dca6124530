"""Where a process sits in a run: its rank, the world size and its neighbours on the node."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from pipetrain.launch.process_exit import launched_rank

__all__ = ["ProcessRole", "role_from_env"]


@dataclass(frozen=True)
class ProcessRole:
    """Where this process sits: its rank in the pipeline group and its neighbours on the node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def reporter(self) -> bool:
        return self.rank == 0


def role_from_env(environ: Mapping[str, str] | None = None) -> ProcessRole | None:
    """This process's place in a torchrun-style launch, or None when not launched so."""
    env = os.environ if environ is None else environ
    if not launched_rank(env):
        return None
    world = int(env["WORLD_SIZE"])
    return ProcessRole(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
    )
