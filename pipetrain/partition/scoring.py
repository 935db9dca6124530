"""Scoring one layout for ``plan --auto``: its split, its simulated step and its bytes
per rank, with the caches the layouts share (torch-free)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import (
    LayerCost,
    MemoryModel,
    Partition,
    PartitionError,
    split_explicit,
)
from pipetrain.partition.expert_costs import expert_parallel_costs
from pipetrain.partition.layouts import AutoRequest, CostsFor, Hardware, Layout, Scored
from pipetrain.partition.memory import gradient_copies, rank_memory, recompute_costs
from pipetrain.partition.recompute_ranks import recompute_speeds, recomputed_on
from pipetrain.partition.split_sim import simulate_split
from pipetrain.partition.stages import rank_live_points, split_for, stage_ranks_of
from pipetrain.partition.workspace import backward_workspace_bytes
from pipetrain.schedules.actions import Kind
from pipetrain.schedules.early_grads import early_grads
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.registry import get_spec
from pipetrain.schedules.schedule import Schedule, ScheduleError
from pipetrain.sim.data_parallel import data_parallel_cost, ring_allreduce_time
from pipetrain.sim.shared_cores import shared_core_makespan, shared_speedup_limit
from pipetrain.sim.simulator import SimResult

__all__ = ["Scorer"]

_FP32 = 4
# AdamW reads a parameter, its gradient and both moments and writes three of them back.
_UPDATE_BYTES_PER_PARAM_BYTE = 7


class Scorer:
    """Caches shared by the layouts: costs per (tp, recompute), schedules, splits."""

    def __init__(
        self, config: ModelConfig, req: AutoRequest, costs_for: CostsFor, hw: Hardware
    ) -> None:
        self.config, self.req, self.hw = config, req, hw
        self._costs_for = costs_for
        self._costs: dict[tuple[int, bool, int, int], list[LayerCost]] = {}
        self._schedules: dict[tuple[str, int, int, int, bool], Schedule] = {}
        self._splits: dict[tuple[int, bool, int, int, int], Partition] = {}

    def microbatch_size(self, layout: Layout) -> int:
        return self.req.batch_size // layout.dp // layout.microbatches

    def costs(self, tp: int, recompute: bool, mb: int, ep: int = 1) -> list[LayerCost]:
        """One tp (and ep) rank's per-sample layer costs at micro-batch size ``mb``."""
        key = (tp, recompute, mb, ep)
        if key not in self._costs:
            plain = list(self._costs_for(tp, mb))
            if ep > 1:
                # The ep group lies inside dp: its all-to-alls take the dp link.
                plain = expert_parallel_costs(
                    plain, self.config, self.req.seq_len, tp=tp, ep=ep,
                    flops_per_second=self.hw.flops, ep_bandwidth=self.hw.link_bandwidth,
                )  # fmt: skip
            self._costs[key] = recompute_costs(plain, self.message_bytes(1)) if recompute else plain
        return self._costs[key]

    def layout_costs(self, layout: Layout) -> list[LayerCost]:
        return self.costs(layout.tp, layout.recompute, self.microbatch_size(layout), layout.ep)

    def message_bytes(self, mb: int) -> float:
        """One micro-batch's (mb, T, d) activation between stages, as every tp rank sends it."""
        return float(_FP32 * mb * self.req.seq_len * self.config.d_model)

    def schedule(self, layout: Layout) -> Schedule:
        lay = layout
        key = (lay.schedule, lay.pp, lay.microbatches, lay.chunks, lay.early_grads)
        if key not in self._schedules:
            plain = get_spec(lay.schedule).build(lay.pp, lay.microbatches, lay.chunks)
            self._schedules[key] = early_grads(plain) if lay.early_grads else plain
        return self._schedules[key]

    def bound(self, layout: Layout) -> tuple[float, float]:
        """Lower bounds of the step time and of the fullest rank's static bytes.

        Time: a rank works through its share of the micro-batches after the first one has
        come through the stages before its earliest, and the gradient of its last backward
        still has to go back through them (1F1B's and GPipe's (m + p - 1)(f + b) exactly).
        Exact for the time-balanced split; a split balanced under the memory limit, whose
        bound this does not compute, is the pruned part.
        """
        costs = self.layout_costs(layout)
        params = sum(c.param_bytes for c in costs) - sum(c.tied_param_bytes for c in costs)
        update = _UPDATE_BYTES_PER_PARAM_BYTE * params / layout.pp / self.hw.update_bandwidth
        try:
            placement = self.placement(layout)
            partition = self.split_for_placement(layout, placement)
        except (PartitionError, ScheduleError):
            return math.inf, math.inf
        # Every stage holds one micro-batch at some point: the fullest rank at least the
        # mean of state plus one micro-batch's activations (Chimera holds every stage's
        # state twice).
        mb = self.req.batch_size // layout.dp // layout.microbatches
        # Some ranks recomputing: the fewest bytes any of them can save, a lower bound.
        saved = self.costs(layout.tp, True, mb, layout.ep) if layout.recompute_ranks else costs
        acts = sum(c.activation_bytes_per_sample for c in saved) * mb
        copies = gradient_copies(layout.dp, placement.replicas, layout.grad_views)
        state = placement.replicas * (3 + copies) * params
        static = (state + acts) / layout.pp
        m = layout.microbatches
        scale = m if get_spec(layout.schedule).whole_batch else 1
        per_layer = self.hw.per_layer
        split = get_spec(layout.schedule).splits_backward or layout.early_grads
        own = self.hw.per_action / scale  # an action's own cost, once however much it carries
        forward = [
            f * mb + per_layer * len(layers) + own
            for f, layers in zip(partition.forward, partition.stages, strict=True)
        ]
        backward = [  # a split backward is two actions, I and W
            b * mb + 2 * per_layer * len(layers) + own * (1 + split)
            for b, layers in zip(partition.backward, partition.stages, strict=True)
        ]
        # After a rank's last B the gradient still runs back through the stages before it;
        # with split backwards its last I does, and Ws may follow that I.
        back = [
            (bi * mb + per_layer * len(layers) + own) if split else b
            for bi, b, layers in zip(
                partition.backward_input, backward, partition.stages, strict=True
            )
        ]
        prefix, chain = [0.0], [0.0]
        for f, b in zip(forward, back, strict=True):
            prefix.append(prefix[-1] + f)
            chain.append(chain[-1] + b)
        actions = 1 if scale > 1 else m  # naive: one action carries the whole batch
        best, total = 0.0, 0.0
        for rank in range(placement.num_ranks):
            held = [placement.model_stage(v) for v in placement.stages_of(rank)]
            share = actions / placement.replicas
            work = sum(forward[j] + backward[j] for j in held) * share
            tail = min(chain[j] for j in held)
            if split:
                weights = sum(
                    w * mb + per_layer * len(partition.stages[j]) + own
                    for j, w in ((j, partition.backward_weight[j]) for j in held)
                )
                tail = max(0.0, tail - weights * share)
            best = max(best, (min(prefix[j] for j in held) + work + tail) * scale)
            total += work * scale
        hw = self.hw
        if hw.shared_cores and self.req.world_size > hw.shared_cores:
            # Cores shared (sim/shared_cores.py): a segment shrinks at most to the profiled
            # speed, and all the processes' work still has to pass through the cores.
            limit = shared_speedup_limit(self.req.world_size, hw.shared_cores)
            processes = total * layout.dp * layout.tp * limit / hw.shared_cores
            best = max(best * limit, processes)
        return best + update, static

    def placement(self, layout: Layout) -> Placement:
        """The layout's placement, without building its schedule where the kind says it."""
        kind, p, v = get_spec(layout.schedule).placement, layout.pp, layout.chunks
        made = {
            "linear": Placement.linear,
            "v": Placement.v_shape,
            "bidirectional": Placement.bidirectional,
        }
        if kind in made:
            return made[kind](p)
        if kind == "looped":
            return Placement.looped(p, v)
        return self.schedule(layout).placement

    def split(self, layout: Layout, schedule: Schedule, memory: MemoryModel | None) -> Partition:
        if memory is None:
            return self.split_for_placement(layout, schedule.placement)
        costs = self.layout_costs(layout)
        return split_for("cost", costs, stage_ranks_of(schedule.placement), None, memory)

    def split_for_placement(self, layout: Layout, placement: Placement) -> Partition:
        """The time-balanced split (no limit) of ``placement``'s model stages; where some
        ranks recompute, balanced as if those ranks ran slower by recomputation's share."""
        ranks = stage_ranks_of(placement)
        costs = self.layout_costs(layout)
        if layout.recompute_ranks:
            mb = self.microbatch_size(layout)
            speeds = recompute_speeds(
                self.costs(layout.tp, False, mb, layout.ep),
                self.costs(layout.tp, True, mb, layout.ep),
                layout.recompute_ranks,
                placement.num_ranks,
            )
            return split_for("cost", costs, ranks, None, None, speeds)
        # Without a limit the split depends on the number of stages only, not their ranks.
        key = (layout.tp, layout.recompute, self.microbatch_size(layout), layout.ep, len(ranks))
        if key not in self._splits:
            self._splits[key] = split_for("cost", costs, ranks, None, None)
        return replace(self._splits[key], stage_ranks=ranks)

    def over_without_simulating(self, layout: Layout) -> bool:
        """True when the layout's time-balanced split is over the limit and it has several
        stages a rank (so it is not re-split): its live micro-batches follow from the order
        of its actions alone, which is exactly the simulator's peak, without a replay."""
        limit = self.req.memory_limit
        if limit is None or layout.recompute_ranks:
            return False
        try:
            schedule = self.schedule(layout)
        except ScheduleError:
            return False
        if schedule.placement.stages_per_rank == 1 or get_spec(layout.schedule).whole_batch:
            return False
        partition = self.split(layout, schedule, None)
        mb = self.req.batch_size // layout.dp // layout.microbatches
        state = 4 + (layout.dp > 1)
        acts = [a * mb for a in partition.activation_bytes_per_sample]
        static = [0.0] * schedule.num_ranks
        for stage, holders in enumerate(partition.stage_ranks):
            for rank in holders:
                static[rank] += state * partition.param_bytes[stage]
        for rank, points in enumerate(rank_live_points(schedule)):
            peak = max(
                (sum(n * a for n, a in zip(p, acts, strict=True)) for p in points), default=0
            )
            if static[rank] + peak > limit:
                return True
        return False

    def evaluate(self, layout: Layout) -> Scored | None:
        """The layout simulated, split under the limit where it must be; None when the
        model cannot be split for it."""
        try:
            schedule = self.schedule(layout)
            scored = self.score(layout, schedule, self.split(layout, schedule, None), False)
        except (PartitionError, ScheduleError):
            return None
        limit = self.req.memory_limit
        if scored.fits or limit is None:
            return scored
        if schedule.placement.stages_per_rank > 1 or layout.recompute_ranks:
            # Several stages a rank couple the limits: the exact search over their cuts
            # takes up to seconds a layout, more than the search can give each one.
            return scored
        memory = self._memory_model(layout, schedule, scored, limit)
        if memory is None:
            return scored
        try:
            partition = self.split(layout, schedule, memory)
        except PartitionError:
            return scored  # no split fits: the time-balanced one stands for the layout
        return self.score(layout, schedule, partition, True)

    def rescore(self, scored: Scored) -> Scored:
        """``scored``'s layout at its split (blocks per stage), under this scorer's costs and
        hardware: a calibration compares a run with its own split, where ties between
        equally balanced splits could otherwise fall another way."""
        schedule = self.schedule(scored.layout)
        partition = split_explicit(
            self.layout_costs(scored.layout), scored.split, stage_ranks_of(schedule.placement)
        )
        return self.score(scored.layout, schedule, partition, scored.memory_balanced)

    def _memory_model(
        self, layout: Layout, schedule: Schedule, scored: Scored, limit: float
    ) -> MemoryModel | None:
        """The balancer's limit: the budget less what the split does not change."""
        spare = max(m.transient + m.in_backward + m.buffers for m in scored.memory)
        hw = self.hw
        fraction, per_process = hw.recompute_overhead if layout.recompute else hw.memory_overhead
        spare += per_process
        spec = get_spec(layout.schedule)
        mb = self.req.batch_size // layout.dp // layout.microbatches
        points = rank_live_points(schedule)
        live = tuple(
            max((max(p[s] for p in r) for r in points if r), default=1)
            for s in range(schedule.placement.num_model_stages)
        )
        if spec.whole_batch:
            scale = layout.microbatches
            live = tuple(n * scale for n in live)
            points = tuple(tuple(tuple(n * scale for n in p) for p in r) for r in points)
        if limit - spare <= 0:
            return None
        # Per parameter byte: weights, AdamW's two moments, the gradients' copies (the
        # scored layout's: with views where the score chose them).
        views = scored.layout.grad_views
        state = 3.0 + gradient_copies(layout.dp, schedule.placement.replicas, views)
        return MemoryModel(
            # The activations' measured overhead, charged on everything: on the safe side.
            limit_bytes=(limit - spare) / (1.0 + fraction),
            microbatch_size=mb,
            live=live,
            state_factor=state,
            rank_live=points,
            whole_batch=spec.whole_batch,
        )

    def score(
        self, layout: Layout, schedule: Schedule, partition: Partition, balanced: bool
    ) -> Scored:
        hw, req = self.hw, self.req
        local = req.batch_size // layout.dp
        mb = local // layout.microbatches
        if layout.recompute_ranks:
            again = self.costs(layout.tp, True, mb, layout.ep)
            partition = recomputed_on(partition, again, layout.recompute_ranks)
        whole = get_spec(layout.schedule).whole_batch
        copies = gradient_copies(layout.dp, schedule.placement.replicas, layout.grad_views)
        held = layout.grad_views and layout.dp > 1
        sim = self._simulate(schedule, partition, mb, whole, layout.microbatches, copies, held)
        pipeline_time = shared_core_makespan(
            sim.timeline,
            processes_per_rank=layout.dp * layout.tp,
            processes=self.req.world_size,
            cores=hw.shared_cores,
        ) if hw.shared_cores else sim.makespan  # fmt: skip
        dp_time = self._reduce_time(layout, schedule, partition, sim)
        weights = sim.weight_bytes or tuple(0.0 for _ in range(layout.pp))
        update = max(weights) * _UPDATE_BYTES_PER_PARAM_BYTE / hw.update_bandwidth
        costs = self.layout_costs(layout)
        full_block = max(
            (
                c.activation_bytes_per_sample
                for c in self.costs(layout.tp, False, mb, layout.ep)
                if c.kind == "block"
            ),
            default=0.0,
        )
        count = partial(
            rank_memory,
            partition,
            costs,
            weight_bytes=weights,
            peak_activation_bytes=sim.peak_activation_bytes or (0.0,) * len(weights),
            microbatch_size=mb,
            message_bytes=self.message_bytes(mb) if layout.pp > 1 else 0.0,
            recompute_block_bytes=full_block if layout.recompute or layout.recompute_ranks else 0.0,
            overhead=hw.memory_overhead,
            recompute_ranks=None if layout.recompute else layout.recompute_ranks,
            recompute_overhead=hw.recompute_overhead,
            batch_scale=layout.microbatches if whole else 1,
            in_backward=backward_workspace_bytes(
                self.config, req.seq_len, layout.tp, _has_split_backward(schedule)
            ),
        )
        memory = count(
            copies=copies, peak_with_gradients=sim.peak_with_gradient_bytes, gradients_held=held
        )
        if req.grad_views and copies > 1 and _may_view(layout, schedule):
            # The .grad tensors as views of the buckets, held all step: one copy, off the
            # timeline (the same simulation), kept unless the fullest process then holds
            # more: the steps they save copying are measured faster (BENCHMARKS.md).
            viewed = count(copies=1)
            # A tie is a tie to rounding: the two sums add the same bytes in two orders.
            if max(m.total for m in viewed) <= max(m.total for m in memory) * (1 + 1e-9):
                layout, memory = replace(layout, grad_views=True), viewed
        limit = req.memory_limit
        fits = limit is None or all(m.total <= limit for m in memory)
        return Scored(
            layout,
            _blocks_per_stage(costs, partition),
            balanced,
            pipeline_time,
            dp_time,
            update,
            sim.bubble.idle_fraction,
            memory,
            fits,
            req.batch_size * req.seq_len,
        )

    def _reduce_time(
        self, layout: Layout, schedule: Schedule, partition: Partition, sim: SimResult
    ) -> float:
        """The gradient all-reduce after the pipeline: over the dp replicas, and between the
        ranks that hold the same model stage (Chimera's two pipelines) too."""
        placement = schedule.placement
        group = layout.dp * placement.replicas
        if group == 1:
            return 0.0
        latency, bandwidth = self.hw.allreduce_link(group)
        if self.hw.overlap_comm:
            cost = data_parallel_cost(
                sim.timeline,
                placement,
                partition.param_bytes,
                replicas=group,
                bandwidth=bandwidth,
            )
            return cost.exposed + latency * placement.stages_per_rank
        # Nothing to hide behind: every rank's all-reduces, one after the other.
        return max(
            sum(
                latency
                + ring_allreduce_time(
                    partition.param_bytes[placement.model_stage(v)], group, bandwidth
                )
                for v in placement.stages_of(rank)
            )
            for rank in range(placement.num_ranks)
        )

    def _simulate(
        self, schedule: Schedule, partition: Partition, mb: int, whole: bool, m: int,
        copies: int, held: bool,
    ) -> SimResult:  # fmt: skip
        return simulate_split(
            schedule,
            partition,
            mb,
            per_layer=self.hw.per_layer,
            per_action=self.hw.per_action,
            latency=self.hw.latency,
            bandwidth=self.hw.link_bandwidth,
            message_bytes=self.message_bytes(mb),
            batch_scale=m if whole else 1,
            buckets=copies > 1,
            gradients_held=held,
        )


def _may_view(layout: Layout, schedule: Schedule) -> bool:
    """Whether ``pipeline.grad_as_bucket_view`` may run ``layout`` and the count above holds
    for it: replicated dp, no experts (reduced apart), no Chimera (whose own sum copies)."""
    return layout.dp > 1 and layout.ep == 1 and schedule.placement.replicas == 1


def _has_split_backward(schedule: Schedule) -> bool:
    """Whether any backward of ``schedule`` runs as I then W."""
    return any(a.kind is Kind.I for actions in schedule.actions for a in actions)


def _blocks_per_stage(costs: Sequence[LayerCost], partition: Partition) -> tuple[int, ...]:
    return tuple(sum(1 for i in stage if costs[i].kind == "block") for stage in partition.stages)
