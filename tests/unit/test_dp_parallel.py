"""The process-free parts of pipetrain.parallel.mesh and the `dp` config field, and the
errors of ``--shard``'s reduce-scatter, which name the step as the progress does (from 1)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from pipetrain.config import ConfigError, load_config
from pipetrain.data import Batch
from pipetrain.parallel import (
    DataParallelStats,
    Mesh,
    check_shardable,
    norm_share,
    replica_denominator,
    shard_batch,
    sharded,
)
from pipetrain.parallel.replicated import _buckets
from pipetrain.parallel.sharded import fsdp_internals, missing_fsdp_internals
from pipetrain.runtime import PipelineError
from pipetrain.schedules.registry import build_schedule
from pipetrain.train.optim import Gradients


@given(st.integers(1, 6), st.integers(1, 5))
def test_shards_cover_every_row_once_in_order(dp: int, per_replica: int) -> None:
    rows = dp * per_replica
    batch = Batch(torch.arange(rows * 3).view(rows, 3), torch.arange(rows * 3).view(rows, 3) + 1)
    shards = [shard_batch(batch, r, dp) for r in range(dp)]
    assert all(s.inputs.shape[0] == per_replica for s in shards)
    assert torch.equal(torch.cat([s.inputs for s in shards]), batch.inputs)
    assert torch.equal(torch.cat([s.targets for s in shards]), batch.targets)


def test_a_batch_that_does_not_split_is_a_config_error() -> None:
    batch = Batch(torch.zeros(6, 2, dtype=torch.long), torch.zeros(6, 2, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"multiple of pipeline\.dp"):
        shard_batch(batch, 0, 4)


def test_buckets_keep_order_and_respect_the_limit() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5, 5, 5)]  # 4 bytes each
    buckets = _buckets(params, limit=80)
    assert [p for b in buckets for p in b] == params
    assert [[p.numel() for p in b] for b in buckets] == [[10, 10], [30], [5, 5, 5]]
    # A parameter larger than the limit gets a bucket of its own.
    assert [[p.numel() for p in b] for b in _buckets(params[2:4], limit=40)] == [[30], [5]]


def test_only_the_first_replica_counts_its_squares() -> None:
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    grads = Gradients.of([a, b])
    first = Mesh(2, 2, 1, 0, None, None, None)
    second = dataclasses.replace(first, dp_rank=1)
    assert norm_share(grads, first) == grads
    share = norm_share(grads, second)
    assert share.counted == () and share.all == grads.all  # still checked for NaN, still stepped
    assert second.rank == 3


def test_stats_text_and_json() -> None:
    stats = DataParallelStats(replicas=2, bytes_per_step=(2_500_000, 1_000), wait_s=(0.012, 0.0))
    assert stats.format() == (
        "data parallel: 2 replicas; per step, by pipeline rank: 2.50, 0.00 MB of gradients "
        "all-reduced, 12.0, 0.0 ms waited for them after the pipeline"
    )
    assert stats.to_json() == {
        "dp_replicas": 2,
        "dp_bytes_per_step": [2_500_000, 1_000],
        "dp_wait_s": [0.012, 0.0],
        "dp_sharded": False,
        "dp_state_bytes": [],
    }
    sharded = DataParallelStats(2, (2_500_000,), (0.003,), True, (1_000_000, 3_000_000))
    assert sharded.format() == (
        "data parallel: 2 replicas, sharded (FSDP2); per step, by pipeline rank: 2.50 MB of "
        "parameters all-gathered and as many of gradients reduce-scattered, 3.0 ms in the "
        "reduce-scatters; parameters + optimizer state per rank: 3.00 MB"
    )
    assert sharded.to_json()["dp_state_bytes"] == [1_000_000, 3_000_000]
    assert sharded.to_json()["dp_all_gather_bytes_per_step"] == [2_500_000]
    assert "dp_all_gather_bytes_per_step" not in stats.to_json()


def test_sharded_replicas_each_count_their_own_shard() -> None:
    grads = Gradients.of([nn.Parameter(torch.ones(2))])
    second = Mesh(2, 2, 1, 1, None, None, None)
    assert norm_share(grads, second, sharded=True) == grads


def test_replica_denominator_weights_replicas_by_their_tokens() -> None:
    targets = torch.ones(4, 5, dtype=torch.long)
    targets[0, :3] = -100  # replica 0 (rows 0-1): 7 tokens; replica 1 (rows 2-3): 10
    assert replica_denominator(targets, 2) == 17 / 2
    # Each replica's loss sum over N / dp, averaged over the replicas: sum over N.
    sums = torch.tensor([3.5, 9.0])
    mean_of_replicas = float((sums / replica_denominator(targets, 2)).mean())
    assert mean_of_replicas == pytest.approx(float(sums.sum()) / 17)
    assert replica_denominator(torch.full((2, 3), -100), 2) == 0.5  # never a division by 0


def test_fsdp2_internals_used_by_shard_are_present() -> None:
    # --shard calls private FSDP2 methods (as torch.distributed.pipelining does): a torch
    # that renames or drops them must fail here, not train with wrong gradients.
    assert missing_fsdp_internals() == []
    for name, found in fsdp_internals().items():
        assert callable(found), name
    group_post_backward = fsdp_internals()["FSDPParamGroup.post_backward"]
    assert list(inspect.signature(group_post_backward).parameters)[:1] == ["self"]


def test_fsdp2_post_backward_entry_points_reduce_into_the_shards() -> None:
    # The whole private path on a one-process gloo group: a torch that changes it fails here.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from pipetrain.parallel.sharded import _reduce_scatter_now

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = nn.Linear(4, 3)
        module = nn.Linear(4, 3)
        module.load_state_dict(plain.state_dict())
        fully_shard(module, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=False)
        assert missing_fsdp_internals(module) == []
        module.set_requires_gradient_sync(False)  # type: ignore[operator]
        module.set_reshard_after_backward(False)  # type: ignore[operator]
        module.set_is_last_backward(False)  # type: ignore[operator]
        x = torch.randn(5, 4)
        for half in (x[:2], x[2:]):  # two backwards accumulate unsharded
            module(half).sum().backward()
            plain(half).sum().backward()
        # Still gathered (plain tensors), gradients accumulating outside the shards.
        assert not isinstance(module.weight, DTensor)
        _reduce_scatter_now(module)  # type: ignore[arg-type]
        assert isinstance(module.weight, DTensor)  # resharded
        assert isinstance(module.weight.grad, DTensor)
        assert torch.allclose(module.weight.grad.full_tensor(), plain.weight.grad)
    finally:
        dist.destroy_process_group()


def test_fsdp_param_groups_in_both_torch_layouts() -> None:
    # torch 2.13 lists a state's groups; earlier releases (2.11 seen) hold one or None.
    from types import SimpleNamespace

    from pipetrain.parallel.sharded import _param_groups

    group = object()
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=[group])) == [group]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
    assert _param_groups(SimpleNamespace()) is None


def test_config_shard_field() -> None:
    config = load_config(
        None,
        {
            "pipeline.dp": 2,
            "pipeline.shard": True,
            "pipeline.microbatches": 4,
            "data.batch_size": 16,
        },
    )
    assert config.pipeline.shard
    with pytest.raises(ConfigError, match=r"pipeline.dp is 1: add --dp 2 \(or more\) or drop"):
        load_config(None, {"pipeline.shard": True})
    with pytest.raises(ConfigError, match="drop --compile or --shard"):
        load_config(
            None,
            {
                "pipeline.dp": 2,
                "pipeline.shard": True,
                "pipeline.compile": True,
                "pipeline.microbatches": 4,
                "data.batch_size": 16,
            },
        )


def test_shard_refuses_asynchronous_and_replicated_schedules() -> None:
    for name, problem in (("pipedream", "asynchronous"), ("chimera", "replicated")):
        schedule = build_schedule(name, 2, 4)
        with pytest.raises(ConfigError, match=problem):
            check_shardable(schedule)
    check_shardable(build_schedule("zb-h1", 2, 4))


def test_config_dp_field() -> None:
    config = load_config(
        None, {"pipeline.dp": 2, "pipeline.microbatches": 4, "data.batch_size": 16}
    )
    assert config.pipeline.dp == 2
    with pytest.raises(ConfigError, match=r"pipeline.dp is 0: it must be at least 1"):
        load_config(None, {"pipeline.dp": 0})
    with pytest.raises(ConfigError, match="use a batch size like 32"):
        load_config(None, {"pipeline.dp": 4, "pipeline.microbatches": 8, "data.batch_size": 24})
    with pytest.raises(ConfigError, match="drop --single-process"):
        load_config(None, {"pipeline.dp": 2, "pipeline.single_process": True})


def _failing(module: Any) -> None:
    raise RuntimeError("Connection closed by peer\nmore detail")


def _gradients(monkeypatch: pytest.MonkeyPatch) -> sharded.ShardedGradients:
    # No process group: the mesh only has to name this rank, the reduction is faked.
    mesh = Mesh(2, 2, 1, 0, None, None, None, dp_mesh=object())
    grads = sharded.ShardedGradients(mesh, timeout_s=1.0)
    grads._modules = {0: object()}  # type: ignore[dict-item]
    grads._order = [0]
    monkeypatch.setattr(sharded, "_reduce_scatter_now", _failing)
    return grads


def test_reduce_scatter_failure_names_the_step_from_1(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = _gradients(monkeypatch)
    # The loop's step 4 (from 0) is what the progress shows as step 5.
    with pytest.raises(PipelineError) as failed:
        grads.finish(4)
    message = str(failed.value)
    assert message.startswith("rank 2: training step 5, reduce-scatter of stage 0's"), message
    assert message.endswith("failed or timed out: Connection closed by peer"), message


def test_reduce_scatter_failure_inside_a_step_names_that_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grads = _gradients(monkeypatch)
    monkeypatch.setattr(sharded, "_reduce_scatter_now", lambda module: None)
    grads.finish(6)  # a resumed run: its first finished step was the loop's 6
    monkeypatch.setattr(sharded, "_reduce_scatter_now", _failing)
    grads._sync = True
    with pytest.raises(PipelineError, match=r"^rank 2: training step 8, reduce-scatter"):
        grads.grads_hook(0)  # inside the next pipeline step, the progress's step 8


def test_reduce_scatter_failure_before_any_finished_step(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = _gradients(monkeypatch)
    grads._sync = True
    with pytest.raises(PipelineError, match=r"^rank 2: its first training step, reduce-scatter"):
        grads.grads_hook(0)
