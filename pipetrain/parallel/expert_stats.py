"""What a mixture of experts did in a step, known on every rank: the auxiliary loss, the
tokens each expert got, the dropped assignments; and the loss-free balancing update.

Each MoE layer records its training micro-batches (``pipetrain.models.moe``); after a
step every rank adds its layers' records into one vector by the model's global layer
order, and one all-reduce over the world group sums them: over the pipeline ranks (each
holds other layers) and over the data-parallel replicas (each routed other tokens). Only
tensor-parallel rank 0 contributes, as the tp ranks of a replica route the same tokens.
The auxiliary loss is then the mean over the replicas (and the accumulated steps) of the
per-layer sums, as the single process computes it over the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.models.config import ModelConfig
from pipetrain.models.moe import MoEFeedForward, moe_layers
from pipetrain.parallel.mesh import Mesh

__all__ = ["ExpertStep", "ExpertTracker", "expert_summary"]


@dataclass(frozen=True)
class ExpertStep:
    """One optimizer step of the whole model's MoE layers."""

    aux_loss: float  # sum over the MoE layers of each one's mean auxiliary loss
    loads: dict[str, list[int]]  # layer -> tokens routed to each expert (all replicas)
    dropped: int  # assignments dropped for capacity, all layers and replicas

    def metrics(self) -> dict[str, Any]:
        """The step's metrics: the auxiliary loss (unweighted, summed over the layers), the
        tokens per expert of each layer, its busiest expert over the mean, dropped tokens."""
        return {
            "aux_loss": self.aux_loss,
            "expert_load": self.loads,
            "expert_imbalance": self.imbalance(),
            "dropped_tokens": self.dropped,
        }

    def imbalance(self) -> dict[str, float]:
        """Layer -> the busiest expert's load over the mean load (1.0: balanced)."""
        out = {}
        for name, load in self.loads.items():
            mean = sum(load) / len(load)
            out[name] = max(load) / mean if mean > 0 else 1.0
        return out


class ExpertTracker:
    """The MoE layers of this process's stages, and their global reduction."""

    def __init__(
        self,
        model: ModelConfig,
        modules: Sequence[nn.Module],
        mesh: Mesh | None,
        device: torch.device,
        group: Any = None,
    ) -> None:
        """``group``: the expert-parallel group of this process (None without --ep)."""
        self.group = group
        self.names = [f"layers.{b}.moe" for b in model.moe_blocks]
        self.n_experts = model.n_experts
        self.local: dict[str, MoEFeedForward] = {
            name: layer for module in modules for name, layer in moe_layers(module)
        }
        self._mesh = mesh
        self._device = device

    def collect(self, accumulated: int = 1) -> ExpertStep:
        """Take every local record and sum over the run (collective with a mesh)."""
        width = 2 + len(self.names) * self.n_experts
        box = torch.zeros(width, dtype=torch.float64)
        contributes = self._mesh is None or self._mesh.tp_rank == 0
        for i, name in enumerate(self.names):
            layer = self.local.get(name)
            if layer is None:
                continue
            for record in layer.take_records():
                if not contributes:
                    continue
                box[0] += float(record.aux) * record.weight
                box[1] += float(record.dropped)
                start = 2 + i * self.n_experts
                box[start : start + self.n_experts] += record.counts.to("cpu", torch.float64)
        dp = 1
        if self._mesh is not None:
            box = box.to(self._device)
            dist.all_reduce(box, group=self._mesh.world_group)
            box = box.cpu()
            dp = self._mesh.dp
        loads = {
            name: [
                round(v)
                for v in box[2 + i * self.n_experts : 2 + (i + 1) * self.n_experts].tolist()
            ]
            for i, name in enumerate(self.names)
        }
        return ExpertStep(float(box[0]) / (dp * accumulated), loads, round(float(box[1])))

    def sampling_group(self) -> Any:
        """Under expert parallelism, the ep group of a rank of the first replicas' group
        (dp ranks 0 .. ep-1 hold every expert between them): it gathers them for the
        closing sample. None elsewhere and without --ep."""
        if (
            self.group is None
            or self._mesh is None
            or self._mesh.dp_rank >= dist.get_world_size(self.group)
        ):
            return None
        return self.group

    def update_bias(self, step: ExpertStep) -> None:
        """The loss-free balancing step of each local layer, from the step's global loads:
        the same numbers on every replica and in one process."""
        for name, layer in self.local.items():
            layer.update_bias(torch.tensor(step.loads[name], dtype=torch.float32))

    def clear(self) -> None:
        """Drop records of passes that will not be reported (a failed or evaluation pass)."""
        for layer in self.local.values():
            layer.take_records()


def expert_summary(steps: Sequence[ExpertStep]) -> tuple[dict[str, Any], str]:
    """The run's experts in one record and one line: each layer's imbalance (busiest
    expert over the mean) over all the steps' tokens, the most imbalanced layer, the mean
    auxiliary loss and the dropped assignments."""
    totals: dict[str, list[int]] = {}
    for step in steps:
        for name, load in step.loads.items():
            totals[name] = [
                a + b for a, b in zip(totals.get(name, [0] * len(load)), load, strict=True)
            ]
    imbalance = ExpertStep(0.0, totals, 0).imbalance()
    worst = max(imbalance, key=lambda n: imbalance[n])
    aux = sum(s.aux_loss for s in steps) / len(steps)
    dropped = sum(s.dropped for s in steps)
    record = {"expert_imbalance": imbalance, "aux_loss_mean": aux, "dropped_tokens": dropped}
    line = (
        f"experts: most imbalanced layer {worst} (busiest expert {imbalance[worst]:.2f}x the "
        f"mean, tokens per expert {totals[worst]}); aux loss {aux:.4f} on average; "
        f"{dropped:,} token assignments dropped"
    )
    return record, line
