"""The preflight plan: what a config resolves to, and what it rejects before any launch."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from pipetrain.config import ConfigError, load_config
from pipetrain.schedules.io import dump_csv
from pipetrain.schedules.registry import build_schedule
from pipetrain.train.plan import (
    RunPlan,
    block_split,
    plan_fingerprint,
    plan_run,
    plans_disagree,
    threads_per_process,
)


def _plan(**overrides: Any) -> RunPlan:
    return plan_run(load_config(overrides={"run.name": "t", **overrides}), vocab_size=256)


def test_default_is_three_stages_of_four_blocks() -> None:
    plan = _plan()
    assert plan.model.name == "llama-default" and plan.model.n_layers == 12
    assert plan.schedule.name == "1f1b" and plan.schedule.num_ranks == 3
    # Embedding (layer 0) with blocks 1-4, blocks 5-8, blocks 9-12 with the head (13).
    assert plan.split == (tuple(range(0, 5)), tuple(range(5, 9)), tuple(range(9, 14)))


def test_block_split_spreads_blocks_and_keeps_ends() -> None:
    assert block_split(4, 1) == (tuple(range(6)),)
    assert block_split(5, 2) == ((0, 1, 2, 3), (4, 5, 6))
    for blocks in range(1, 9):
        for stages in range(1, blocks + 1):
            split = block_split(blocks, stages)
            assert [i for s in split for i in s] == list(range(blocks + 2))
            sizes = [len(s) - (s[0] == 0) - (s[-1] == blocks + 1) for s in split]
            assert max(sizes) - min(sizes) <= 1


def test_looped_schedule_gets_one_range_per_model_stage() -> None:
    plan = _plan(**{"model.name": "llama-tiny", "data.seq_len": 32, "pipeline.pp": 2},
                 **{"pipeline.schedule": "interleaved-1f1b", "pipeline.chunks": 2})  # fmt: skip
    assert len(plan.split) == 4


def test_threads_share_the_cores() -> None:
    assert threads_per_process(3, 8) == 3
    assert threads_per_process(0, 10_000) == 1


REJECTED: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    ({"pipeline.chunks": 2}, ("pipeline.chunks 2", "interleaved-1f1b", "drop --chunks")),
    (
        {"pipeline.schedule": "pipedream", "optim.grad_accum": 2},
        ("optim.grad_accum 2", "--grad-accum 1"),
    ),
    ({"pipeline.schedule": "1f1x"}, ("pipeline.schedule", "unknown schedule '1f1x'", "1f1b")),
    (
        {"pipeline.pp": 4, "pipeline.microbatches": 2, "data.batch_size": 2},
        ("pipeline:", "--microbatches"),
    ),
    ({"model.name": "llama-huge"}, ("model.name", "llama-default")),
    ({"model.name": "llama-tiny"}, ("data.seq_len 128", "--seq-len 64")),
    (
        {"model.name": "llama-tiny", "data.seq_len": 32, "pipeline.pp": 5},
        ("5 model stages", "4 blocks"),
    ),
]


@pytest.mark.parametrize(("overrides", "words"), REJECTED, ids=[str(o) for o, _ in REJECTED])
def test_rejected_before_launch(overrides: dict[str, Any], words: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        _plan(**overrides)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed"
)
def test_missing_tensorboard_is_named_before_launch() -> None:
    with pytest.raises(
        ConfigError, match=r"run.tensorboard needs the 'tensorboard' package.*drop --tensorboard"
    ):
        _plan(**{"run.tensorboard": True})
    # Only rank 0 writes the events: another node of a torchrun launch need not have it.
    config = load_config(overrides={"run.name": "t", "run.tensorboard": True})
    assert plan_run(config, vocab_size=256, reporter=False).model.name == "llama-default"


def test_cuda_without_a_gpu_is_named() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"pipeline.device is 'cuda'.*--device cpu"):
        _plan(**{"pipeline.device": "cuda"})


def test_each_process_takes_the_gpu_of_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two processes on one GPU are named at the rendezvous, which compares the GPUs
    # themselves (tests/unit/test_rendezvous.py): a process that sees one GPU may be one
    # of several given a GPU each (SLURM's per-task binding), so no count refuses here.
    import torch

    from pipetrain.train.loop import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda", 3) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda", 1) == torch.device("cuda", 1)
    assert resolve_device("auto", 3) == torch.device("cuda", 1)
    assert resolve_device("cpu", 1) == torch.device("cpu")


def test_balance_moves_blocks_off_a_heavy_head() -> None:
    """A 50,000-token head costs as much compute as several blocks (cost moves blocks
    off the last stage) and holds more parameters than all 12 blocks (params leaves the
    embedding and the head alone on their stages); a split by hand is taken as given."""

    def counts(**overrides: Any) -> list[int]:
        config = load_config(overrides={"run.name": "x", **overrides})
        plan = plan_run(config, vocab_size=50_000)
        blocks = [len(stage) for stage in plan.split]
        blocks[0] -= 1  # the embedding
        blocks[-1] -= 1  # the head
        return blocks

    assert counts() == [4, 4, 4]
    cost = counts(**{"pipeline.balance": "cost"})
    assert sum(cost) == 12 and cost[-1] < 4 and cost[0] > 4
    assert counts(**{"pipeline.balance": "params"}) == [0, 12, 0]
    assert counts(**{"pipeline.split": "6, 5,1"}) == [6, 5, 1]


def test_processes_whose_pipelines_differ_from_the_same_settings_are_named(
    tmp_path: Path,
) -> None:
    same = [plan_fingerprint(_plan()), plan_fingerprint(_plan())]
    assert same[0] == same[1] and plans_disagree(same, "1f1b", "llama-default") is None
    # A preset renamed, its sizes kept: the same weights, so the same pipeline.
    plan = _plan()
    renamed = dataclasses.replace(plan, model=dataclasses.replace(plan.model, name="mine"))
    assert plan_fingerprint(renamed) == same[0]
    # One node's file holds GPipe's order, the other's 1F1B's, under one name.
    fingerprints = []
    for i, name in enumerate(("1f1b", "gpipe")):
        folder = tmp_path / f"node{i}"
        folder.mkdir()
        dump_csv(build_schedule(name, 3, 8), folder / "mine.csv")
        config = load_config(
            overrides={"run.name": "t", "pipeline.schedule": str(folder / "mine.csv")}
        )
        fingerprints.append(plan_fingerprint(plan_run(config, vocab_size=256)))
    assert plans_disagree(fingerprints, "mine.csv", "llama-default") == (
        "the schedule file 'mine.csv' holds other actions on rank 1 than on rank 0: give "
        "every node the same file"
    )
    # Another pipetrain version: the same preset name builds another model, or splits it
    # otherwise; the settings agree, so only the derived pipeline can tell.
    wider = dataclasses.replace(
        plan, model=dataclasses.replace(plan.model, ffn_hidden=plan.model.ffn_hidden * 2)
    )
    other_split = dataclasses.replace(plan, split=(plan.split[0][:-1], *plan.split[1:]))
    for other, words in ((wider, "model llama-default comes"), (other_split, "the split comes")):
        problem = plans_disagree(
            [same[0], same[0], plan_fingerprint(other)], "1f1b", "llama-default"
        )
        assert problem == (
            f"{words} out differently on rank 2 than on rank 0 from the same settings: "
            "install the same pipetrain version on every node"
        )


@pytest.mark.parametrize(
    ("pp", "balance"), [(5, "uniform"), (7, "params")], ids=["even", "beyond-the-ends"]
)
def test_more_stages_than_a_split_can_fill_are_refused(pp: int, balance: str) -> None:
    # An even split needs a block per stage; another may add a stage of the embedding alone
    # and one of the head alone (5 and 6 stages of llama-tiny's 4 blocks), no more.
    overrides = {"model.name": "llama-tiny", "data.seq_len": 16, "pipeline.balance": balance}
    with pytest.raises(ConfigError, match=f"on {pp} ranks has {pp} model stages but model "):
        _plan(**overrides, **{"pipeline.pp": pp})


def test_map_tensors_that_changes_nothing_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA the measured peak is the allocator's tensor bytes already; where glibc takes
    # no threshold the heap is kept as usual: either way the run says so rather than
    # measure the heap silently (the e2e run on glibc checks that it prints nothing).
    import torch

    import pipetrain.train.loop as loop

    calls: list[tuple[int, ...]] = []
    took = {"mapped": True}

    def keep_heap(*threshold: int) -> bool:
        calls.append(threshold)
        return took["mapped"] if threshold else True

    monkeypatch.setattr(loop, "keep_heap", keep_heap)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert loop.tune_heap(cpu, True) == "" and calls == [(loop.MAPPED_TENSORS,)]
    calls.clear()
    assert loop.tune_heap(cpu, False) == "" and calls == [()]
    calls.clear()
    took["mapped"] = False
    line = loop.tune_heap(cpu, True)
    assert line.startswith("note: run.map_tensors has no effect here") and "glibc" in line
    assert calls == [(loop.MAPPED_TENSORS,), ()]  # the kept heap instead
    calls.clear()
    assert "on cuda" in loop.tune_heap(cuda, True) and calls == []
    assert loop.tune_heap(cuda, False) == "" and calls == []
