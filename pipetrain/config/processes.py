"""``PipelineConfig``'s checks across fields: what can run in which process.

Each raises ``ConfigError`` with one line that names the fields and the fix.
"""

from __future__ import annotations

from typing import Any

from pipetrain.config.errors import ConfigError

__all__ = ["check_processes"]


def check_processes(p: Any) -> None:
    """What runs in which process (``PipelineConfig``'s fields): one process, replicas,
    sharded replicas, tensor-parallel ranks."""
    if p.single_process and p.pp == 1:
        raise ConfigError(
            "pipeline.single_process needs several pipeline ranks to simulate: set --pp 2 "
            "or more, or drop --single-process"
        )
    if p.shard and p.dp < 2:
        raise ConfigError(
            f"pipeline.shard shards each stage over data-parallel replicas but pipeline.dp "
            f"is {p.dp}: add --dp 2 (or more) or drop --shard"
        )
    if p.shard and p.compile:
        raise ConfigError(
            "pipeline.shard with pipeline.compile is not supported: drop --compile or --shard"
        )
    if p.grad_as_bucket_view and p.shard:
        raise ConfigError(
            "pipeline.grad_as_bucket_view makes .grad views of replicated dp buckets, which "
            "--shard does not have: drop --grad-as-bucket-view or --shard"
        )
    if p.tp > 1 and p.single_process:
        raise ConfigError(
            "pipeline.tp splits each layer over processes, which one process cannot "
            "simulate: drop --single-process or use --tp 1"
        )
    if p.sequence_parallel and p.tp < 2:
        raise ConfigError(
            "pipeline.sequence_parallel splits the sequence over tensor-parallel ranks but "
            f"pipeline.tp is {p.tp}: add --tp 2 (or more) or drop --sequence-parallel"
        )
    if p.dp > 1 and p.single_process:
        raise ConfigError(
            "pipeline.single_process runs one pipeline in one process: drop "
            "--single-process or use --dp 1"
        )
