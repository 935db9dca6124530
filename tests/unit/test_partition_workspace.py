"""What a running backward holds beside the saved tensors (``partition.workspace``): the
formula against torch.profiler's tensor events of real stages of llama-default, and the
memory model charging a rank its largest layer kind's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType

from pipetrain.models import get_model_config
from pipetrain.models.spec import model_spec
from pipetrain.models.stage import build_stage
from pipetrain.partition.balance import LayerCost, make_partition
from pipetrain.partition.memory import rank_memory
from pipetrain.partition.workspace import backward_workspace_bytes

CONFIG = get_model_config("llama-default")
SEQ, MB = 128, 4


def _backward_peak(layers: list[int], input_only: bool) -> int:
    """The most tensor bytes a stage's backward holds above what was live at its start,
    for a micro-batch after the first (the .grad tensors exist: a weight gradient is then
    a temporary added in place)."""
    spec = model_spec(CONFIG)
    torch.manual_seed(0)
    stage = build_stage(spec, layers, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    x = torch.randn(MB, SEQ, CONFIG.d_model, requires_grad=True)
    y = stage(x)
    if spec.layers[layers[-1]].kind == "head":
        targets = torch.randint(0, CONFIG.vocab_size, (MB * SEQ,))
        out, grad = F.cross_entropy(y.flatten(0, 1), targets, reduction="sum"), None
    else:
        out, grad = y, torch.randn_like(y)
    torch.autograd.backward(out, grad, retain_graph=True)  # the first micro-batch's
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        if input_only:
            torch.autograd.grad(out, [x], grad_outputs=grad)
        else:
            torch.autograd.backward(out, grad)
    events = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            events.append((node.start_time_ns, node.typed[1].alloc_size))
    level = peak = 0
    for _, size in sorted(events):
        level += size
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize(
    ("where", "input_only"),
    [("blocks", False), ("blocks", True), ("head", False)],
)
def test_the_formula_covers_a_measured_backward_within_a_quarter(
    where: str, input_only: bool
) -> None:
    last = len(model_spec(CONFIG).layers) - 1
    layers = [1, 2] if where == "blocks" else [last - 1, last]
    measured = _backward_peak(layers, input_only)
    per_sample = backward_workspace_bytes(CONFIG, SEQ, split=input_only)
    formula = MB * max(per_sample["block"], per_sample["head"] if where == "head" else 0.0)
    # Not below what the backward holds (but its scalars: the loss's gradient, 4 bytes);
    # at most a quarter above (the I's queued row-wise gradients are the runtime's, not
    # autograd.grad's: 3.0 MiB against 2.5 here).
    assert measured - 64 <= formula <= 1.25 * measured


def _layer(kind: str) -> LayerCost:
    return LayerCost(kind, kind, 1.0, 2.0, 1.0, 1.0, 10, 40, 100.0)


def test_a_rank_is_charged_its_largest_kinds_backward_for_one_action() -> None:
    costs = [_layer("embedding"), _layer("block"), _layer("block"), _layer("head")]
    partition = make_partition("explicit", costs, [(0, 2), (2, 4)], (0, 1))
    running = {"embedding": 0.0, "block": 7.0, "head": 11.0}

    def charged(**kw: object) -> list[float]:
        memory = rank_memory(
            partition, costs, weight_bytes=[40.0, 80.0], peak_activation_bytes=[0.0, 0.0],
            microbatch_size=2, message_bytes=0.0, copies=1, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        return [m.in_backward for m in memory]

    assert charged() == [0.0, 0.0]
    assert charged(in_backward=running) == [14.0, 22.0]
    assert charged(in_backward=running, batch_scale=3) == [42.0, 66.0]  # naive: m at once
