"""The process group a collective save or load runs over, and small shared helpers."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = [
    "Comm",
    "as_modules",
    "jsonable",
    "quiet_single_process",
]


@dataclass(frozen=True)
class Comm:
    """The process group a collective save/load runs over; a lone process without
    torch.distributed is a group of one."""

    group: Any
    rank: int
    size: int

    @classmethod
    def of(cls, group: Any) -> Comm:
        if dist.is_available() and dist.is_initialized():
            return cls(group, dist.get_rank(group), dist.get_world_size(group))
        return cls(None, 0, 1)

    @property
    def distributed(self) -> bool:
        return self.size > 1 or (dist.is_available() and dist.is_initialized())

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` on every rank, in rank order."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` on rank 0 (an empty list elsewhere)."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.size if self.rank == 0 else []
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.gather_object(value, out if self.rank == 0 else None, dst=dst, group=self.group)
        return out


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    # DCP warns on every call without torch.distributed; one process is a supported use.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def as_modules(modules: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    return [modules] if isinstance(modules, nn.Module) else list(modules)


def jsonable(value: Any) -> Any:
    """A value as it reads back from the manifest's JSON (tuples become lists)."""
    if isinstance(value, tuple | list):
        return [jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value
