"""The Python API: a pipeline built from a model and a schedule, one call per step.

Usage, in a script started on every rank (``torchrun --nproc-per-node 2 train.py``)::

    import torch
    import torch.distributed as dist
    from pipetrain.models import get_model_config, model_spec
    from pipetrain.runtime import build_pipeline, default_device

    device = default_device()                   # cuda:LOCAL_RANK if there is a GPU, else cpu
    if device.type == "cuda":
        torch.cuda.set_device(device)           # else every rank's object collectives use GPU 0
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    spec = model_spec(get_model_config("llama-tiny"))
    pipe = build_pipeline(spec, schedule="1f1b", microbatches=8, group=dist.group.WORLD,
                          device=device, seed=0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
    for step in range(3):
        g = torch.Generator().manual_seed(step)  # the same batch on every rank
        ids = torch.randint(0, 256, (32, 65), generator=g)
        result = pipe.step(ids[:, :-1], ids[:, 1:])  # inputs, targets (B, T)
        opt.step()
        pipe.zero_grad()
        if dist.get_rank() == 0:
            print(step, result.loss)             # the loss is known on every rank
    dist.destroy_process_group()

Without a process group (``group=None``) the pipeline runs every rank's actions in this
one process with an in-memory transport (``ranks`` says how many), giving exactly the same
numbers: the debug mode. Pass a ``Schedule`` instead of a name to run a schedule of your
own (``pipetrain.schedules.io`` loads one from CSV); it is validated and lowered here.

The loss is the sum over all target tokens of ``loss_fn`` (cross-entropy by default),
divided by the number of targets that are not -100 in the whole batch: the gradients are
those of one large batch, however it is split into micro-batches.

This module holds the pipeline and its step; ``build_pipeline`` (in
``pipetrain.runtime.build``, with its argument checks) is re-exported here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.models import PipelineSpec, StageModule
from pipetrain.runtime.build import (
    build_pipeline,
    check_class_targets,
    check_token_ids,
    default_device,
    even_split,
    forward_only,
    positive_count,
    token_table_rows,
)
from pipetrain.runtime.collectives import (
    DistReducer,
    LocalReducer,
    ReplicaGroup,
    TiedGroup,
    dist_barrier,
    dist_step_summary,
)
from pipetrain.runtime.errors import PipelineError, PipelineInputError, lost_peer_error
from pipetrain.runtime.executor import ComputeHook, GradsHook, RankExecutor, StepHook
from pipetrain.runtime.stage import IGNORE_INDEX, LossFn, StageRunner
from pipetrain.runtime.timeline import merge_timelines, rank_events
from pipetrain.runtime.transport import DistTransport, InMemoryTransport
from pipetrain.schedules import Kind, Schedule
from pipetrain.schedules.execution import Timeline

__all__ = ["Pipeline", "StepResult", "build_pipeline", "default_device", "even_split"]


@dataclass(frozen=True)
class StepResult:
    """What one step returns, the same on every rank."""

    loss: float  # mean loss per target token over the whole batch
    tokens: int  # target tokens that count (not -100)
    timeline: Timeline  # measured actions of every rank, seconds from the step's start
    step_time_s: float  # wall time of the step on this rank


class Pipeline:
    """A model cut into stages and run by a schedule. Build with ``build_pipeline``."""

    def __init__(
        self,
        schedule: Schedule,
        spec: PipelineSpec,
        split: tuple[tuple[int, ...], ...],
        ranks: tuple[int, ...],
        stage_modules: dict[int, StageModule],
        group: Any,
        device: torch.device,
        loss_fn: LossFn,
        timeout_s: float,
        step_hook: StepHook | None,
        compute_hook: ComputeHook | None = None,
        grads_hook: GradsHook | None = None,
        *,
        class_targets: bool = False,
    ) -> None:
        self.schedule = schedule
        self.spec = spec
        self.split = split
        self.device = device
        self._group = group
        self._ranks = ranks  # the ranks whose programs run in this process
        self._timeout_s = timeout_s
        # Every pass (training step or evaluation) has its own number on the wire, which
        # the messages' headers check; errors name the pass as the user counts it.
        self._step = 0
        self._passes = {True: 0, False: 0}  # training steps, evaluation passes so far
        # Set while a pass runs its actions; a training pass that fails after a backward
        # leaves some micro-batches' gradients in .grad, and the next step (whose sums would
        # silently include them) is refused until they are zeroed (``_partial``).
        self._started = False
        self._partial: str | None = None
        self._stage_modules = stage_modules
        placement = schedule.placement
        split_mbs = _split_microbatches(schedule)  # stage -> its split backwards, None: all
        runners = {
            s: StageRunner(
                s,
                module,
                is_first=placement.is_first(s),
                is_last=placement.is_last(s),
                loss_fn=loss_fn,
                split_backward=s in split_mbs,
                split_only=split_mbs.get(s),
            )
            for s, module in stage_modules.items()
        }
        replica_groups = [
            ReplicaGroup(
                j,
                placement.replicas_of(j),
                tuple(placement.rank_of(s) for s in placement.replicas_of(j)),
            )
            for j in range(placement.num_model_stages)
        ]
        holders = spec.tied_holders(split)
        tied_groups = [
            TiedGroup(
                key,
                tuple(
                    s
                    for s in range(placement.num_stages)
                    if placement.model_stage(s) in model_stages
                ),
                tuple(
                    placement.rank_of(s)
                    for s in range(placement.num_stages)
                    if placement.model_stage(s) in model_stages
                ),
            )
            for key, model_stages in holders.items()
            if len(model_stages) * placement.replicas > 1
        ]
        tied_params = {
            (key, s): module.tied_parameters()[key]
            for s, module in stage_modules.items()
            for key in module.tied_parameters()
        }
        tied_ids = {id(p) for p in tied_params.values()}
        replica_params = {
            s: [p for p in module.parameters() if p.requires_grad and id(p) not in tied_ids]
            for s, module in stage_modules.items()
        }
        # Kept so that rebind_parameters can update, in place, what the reducers sum.
        self._tied_params = tied_params
        self._replica_params = replica_params
        self.tied_names: dict[str, str] = {}
        for module in stage_modules.values():
            by_id = {id(p): key for key, p in module.tied_parameters().items()}
            for name, p in module.named_parameters(remove_duplicate=False):
                if id(p) in by_id and name != by_id[id(p)]:
                    self.tied_names[name] = by_id[id(p)]
        forward_schedule = forward_only(schedule)
        self._reducer: LocalReducer | DistReducer
        if group is None:
            transport: Any = InMemoryTransport()
            self._reducer = LocalReducer(replica_groups, replica_params, tied_groups, tied_params)
        else:
            rank = ranks[0]
            transport = DistTransport(group, placement.stage_to_rank, device, timeout_s)
            self._reducer = DistReducer(
                group, rank, replica_groups, replica_params, tied_groups, tied_params, timeout_s
            )
        self._transport = transport
        # The runtime's errors number ranks within the pipeline's group; where those are
        # not the global ranks (data parallelism: one pipeline per replica), they say
        # which process is which.
        self._rank_map = ""
        if group is not None:
            world = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
            if world != list(range(len(world))):
                pairs = ", ".join(f"{r} is global rank {g}" for r, g in enumerate(world))
                self._rank_map = f" [ranks of this pipeline's group: {pairs}]"

        def executors(program: Schedule, grads: GradsHook | None = None) -> list[RankExecutor]:
            return [
                RankExecutor(
                    program,
                    r,
                    {s: runners[s] for s in placement.stages_of(r)},
                    transport,
                    self._reducer,
                    step_hook,
                    compute_hook,
                    grads,
                )
                for r in ranks
            ]

        self._train = executors(schedule, grads_hook)
        self._eval = executors(forward_schedule)
        self._has_first = any(placement.is_first(s) for s in stage_modules)
        self._vocab = token_table_rows(spec, stage_modules)
        self._has_last = any(placement.is_last(s) for s in stage_modules)
        self._class_targets = class_targets  # the default loss: targets are class indices

    # ----------------------------------------------------------------- parameters
    @property
    def modules(self) -> tuple[StageModule, ...]:
        """This process's stage modules, in stage order (every rank's in the debug mode)."""
        return tuple(self._stage_modules[s] for s in sorted(self._stage_modules))

    @property
    def stages(self) -> tuple[int, ...]:
        """The virtual stages held by this process."""
        return tuple(sorted(self._stage_modules))

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(global name, parameter) of every distinct parameter here, in stage order.

        A tied copy keeps its own layer's name (``head.out.weight``); ``tied_names`` maps it
        to the canonical key (``embed.tok.weight``). Replicas (Chimera) and, in the debug
        mode, stages of different ranks repeat names: they are different tensors.
        """
        seen: set[int] = set()
        for module in self.modules:
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def rebind_parameters(self) -> None:
        """Point the gradient sums at the parameters the stage modules hold now.

        For wrappers that replace a module's parameters after the pipeline was built
        (FSDP2's ``fully_shard`` registers sharded ones): the sums of tied weights and of
        Chimera's replicas would otherwise keep adding into the tensors that were replaced.
        """
        for key, stage in self._tied_params:
            self._tied_params[(key, stage)] = self._stage_modules[stage].tied_parameters()[key]
        tied_ids = {id(p) for p in self._tied_params.values()}
        for stage, params in self._replica_params.items():
            module = self._stage_modules[stage]
            params[:] = [
                p for p in module.parameters() if p.requires_grad and id(p) not in tied_ids
            ]

    def zero_grad(self) -> None:
        for module in self.modules:
            module.zero_grad(set_to_none=True)

    # ----------------------------------------------------------------- steps
    def step(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        denominator: float | None = None,
        label: str | None = None,
    ) -> StepResult:
        """One forward and backward of the whole batch; gradients end up in ``.grad``.

        Every rank may pass the whole batch; ranks with a first stage need ``inputs``,
        ranks with a last stage ``targets`` (B, T) with -100 for tokens that do not count.
        ``denominator``: what the summed loss is divided by, by default the targets that
        count in this batch. Data parallelism passes the global batch's count over the
        replicas, so that replicas with fewer tokens weigh less in the mean of replicas.
        ``label``: how errors name this step (default "training step N", N counting this
        pipeline's steps from 1; a loop that resumed or accumulates knows better).

        A step that raises after some micro-batches went backward leaves their gradients
        in ``.grad``; the next step is refused until they are zeroed (``zero_grad()``).
        """
        return self._run(
            self._train, inputs, targets, training=True, denominator=denominator, label=label
        )

    def eval_loss(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        denominator: float | None = None,
        label: str | None = None,
    ) -> float:
        """The loss of a batch, forward only, without touching gradients (``denominator``
        and ``label`` as in ``step``)."""
        return self._run(
            self._eval, inputs, targets, training=False, denominator=denominator, label=label
        ).loss

    def _split(self, name: str, batch: torch.Tensor | None, needed: bool) -> list[torch.Tensor]:
        m = self.schedule.microbatches
        if batch is None:
            if needed:
                raise PipelineInputError(
                    f"this rank holds a {'first' if name == 'inputs' else 'last'} stage: pass {name}"
                )
            return []
        if not isinstance(batch, torch.Tensor):
            raise PipelineInputError(
                f"{name} is a {type(batch).__name__}: pass a tensor (torch.tensor(...)) whose first "
                f"dimension is the batch"
            )
        if batch.dim() < 1 or batch.shape[0] % m:
            params = dict(self.schedule.params)
            # An asynchronous schedule built for microbatches=m runs a stream of several
            # optimizer steps of m each: the count here is not the one the caller passed.
            stream = (
                f" (schedule {self.schedule.name!r} streams {params['steps']} steps of "
                f"{params['window']} micro-batches per call: stack the steps' batches)"
                if self.schedule.asynchronous and {"steps", "window"} <= params.keys()
                else ""
            )
            raise PipelineInputError(
                f"{name} has batch size {batch.shape[0] if batch.dim() else 0}, not a multiple of "
                f"microbatches={m}{stream}: make the batch size a multiple of {m}"
            )
        return list(batch.to(self.device).chunk(m, dim=0))

    def _run(
        self,
        executors: list[RankExecutor],
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        training: bool,
        denominator: float | None = None,
        label: str | None = None,
    ) -> StepResult:
        if training and self._partial is not None:
            self._refuse_partial_grads()
        step = self._step  # numbers the messages: every pass, the same on every rank
        self._step += 1
        self._passes[training] += 1
        where = label or self._label(training)
        self._started = False
        try:
            return self._run_pass(executors, step, where, inputs, targets, training, denominator)
        except PipelineError as exc:
            self._note_partial(executors, training, where)
            raise PipelineError(str(exc) + self._rank_map) from exc
        except RuntimeError as exc:
            self._note_partial(executors, training, where)
            # A transfer that torch refused at once (gloo raises when a send or receive is
            # posted on a connection its peer already closed).
            failure = lost_peer_error(
                exc,
                rank=executors[0].rank,
                timeout_s=self._timeout_s,
                step=where,
            )
            if failure is None:
                raise
            raise PipelineError(str(failure) + self._rank_map) from exc
        except BaseException:
            self._note_partial(executors, training, where)
            raise
        finally:
            self._started = False

    def _note_partial(self, executors: list[RankExecutor], training: bool, where: str) -> None:
        """Remember a training pass that failed after some backward added to .grad."""
        if not (training and self._started):
            return
        grads = (Kind.B, Kind.I, Kind.W)
        # The failing action (at ``position``) may have added part of its gradients too.
        if any(a.kind in grads for ex in executors for a in ex.actions[: ex.position + 1]):
            self._partial = where

    def _refuse_partial_grads(self) -> None:
        if any(_nonzero(p.grad) for p in self.parameters()):
            raise PipelineInputError(
                f"{self._partial} failed part-way and left some micro-batches' gradients in "
                f".grad: call zero_grad() (the pipeline's or the optimizer's) before the next step"
            )
        self._partial = None

    def _label(self, training: bool) -> str:
        """The current pass as the user counts it (1-based), for error messages."""
        # An asynchronous schedule's pass is a stream of several optimizer steps.
        unit = "stream" if self.schedule.asynchronous else "step"
        kind = f"training {unit}" if training else "evaluation pass"
        return f"{kind} {self._passes[training]}"

    def _run_pass(
        self,
        executors: list[RankExecutor],
        step: int,
        where: str,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        training: bool,
        denominator: float | None,
    ) -> StepResult:
        """One pass: ``step`` numbers its messages on the wire, ``where`` names it in errors."""
        input_mbs = self._split("inputs", inputs, self._has_first)
        if self._vocab is not None and inputs is not None:
            check_token_ids(inputs, self._vocab)
        target_mbs = self._split("targets", targets, self._has_last)
        if self._class_targets and targets is not None:
            check_class_targets(targets)
        tokens = 0
        if targets is not None:
            tokens = int((targets != IGNORE_INDEX).sum())
            if tokens == 0 and self._has_last and denominator is None:
                raise PipelineInputError(
                    f"targets of shape {tuple(targets.shape)} are empty: pass at least one "
                    f"sequence of at least one token"
                    if targets.numel() == 0
                    else "every target is -100 (ignored): the batch has no token to learn from"
                )
        if (
            isinstance(inputs, torch.Tensor)
            and isinstance(targets, torch.Tensor)
            and inputs.dim() > 0
            and targets.dim() > 0
            and inputs.shape[0] != targets.shape[0]
        ):
            # Checked before any rank starts: only a last stage would find out, mid-step.
            raise PipelineInputError(
                f"inputs hold {inputs.shape[0]} sequences but targets {targets.shape[0]}: pass "
                f"one row of targets per row of inputs"
            )
        divide_by = float(max(tokens, 1)) if denominator is None else positive_count(denominator)
        if training:
            self._reducer.begin()
        for ex in executors:
            ex.begin(step, input_mbs, target_mbs, divide_by, training, where)
        self._started = True
        if self._group is None:
            self._transport.begin_step(step, [], where)  # in memory, messages match by name
            return self._run_local(executors, where, tokens, training)
        # The barrier first: gloo's monitored barrier uses point-to-point tags that could
        # match receives posted early.
        dist_barrier(self._group, executors[0].rank, where, self._timeout_s, self.device)
        self._transport.begin_step(step, [executors[0].wire], where)
        return self._run_dist(executors[0], where, tokens, training)

    def _run_local(
        self, executors: list[RankExecutor], where: str, tokens: int, training: bool
    ) -> StepResult:
        origin = time.perf_counter_ns()
        pending = list(executors)
        while pending:
            progressed = False
            for ex in pending:
                before = ex.position
                ex.run()
                progressed = progressed or ex.position != before
            pending = [ex for ex in pending if not ex.done]
            if pending and not progressed:
                stuck = ", ".join(f"rank {ex.rank} at {ex.blocked_on}" for ex in pending)
                raise PipelineError(
                    f"{where}: every rank waits for a message that never comes ({stuck})"
                )
        self._transport.end_step()
        if training:
            self._reducer.finish(where)
        loss = sum(ex.loss_sum() for ex in executors)
        per_rank = []
        for ex in executors:
            ex.clock.origin_ns = origin
            per_rank.append(rank_events(ex.rank, ex.actions, ex.clock.relative()))
        elapsed = (time.perf_counter_ns() - origin) * 1e-9
        timeline = merge_timelines(self.schedule.name, self.schedule.num_ranks, per_rank)
        return StepResult(loss, tokens, timeline, elapsed)

    def _run_dist(self, ex: RankExecutor, where: str, tokens: int, training: bool) -> StepResult:
        origin = time.perf_counter_ns()
        ex.clock.origin_ns = origin
        ex.run()
        self._transport.end_step()
        if training:
            self._reducer.finish(where)
        width = 2 + 2 * max(len(row) for row in self.schedule.actions)
        row = [ex.loss_sum(), float(tokens), *map(float, ex.clock.relative())]
        rows = dist_step_summary(
            self._group, ex.rank, where, row, width, self._timeout_s, self.device
        )
        # Every rank got this far: this step's shapes are the next step's guess.
        self._transport.commit_step()
        loss = 0.0
        for r in rows:
            loss += r[0]
        elapsed = (time.perf_counter_ns() - origin) * 1e-9
        per_rank = [
            rank_events(
                r, self.schedule.actions[r], rows[r][2 : 2 + 2 * len(self.schedule.actions[r])]
            )
            for r in range(self.schedule.num_ranks)
        ]
        timeline = merge_timelines(self.schedule.name, self.schedule.num_ranks, per_rank)
        return StepResult(loss, int(max(r[1] for r in rows)), timeline, elapsed)


def _split_microbatches(schedule: Schedule) -> dict[int, frozenset[int] | None]:
    """The stages whose backward the schedule splits into I and W, each with the
    micro-batches it splits, or None where it splits every one (the zero-bubble family)."""
    split: dict[int, set[int]] = {}
    forwards: dict[int, set[int]] = {}
    for row in schedule.actions:
        for action in row:
            if action.microbatch is None:
                continue
            if action.kind is Kind.I:
                split.setdefault(action.stage, set()).add(action.microbatch)
            elif action.kind is Kind.F:
                forwards.setdefault(action.stage, set()).add(action.microbatch)
    return {
        stage: None if mbs == forwards.get(stage) else frozenset(mbs)
        for stage, mbs in split.items()
    }


def _nonzero(grad: torch.Tensor | None) -> bool:
    if grad is None:
        return False
    # A sharded (FSDP2) gradient is a DTensor: its local shard answers without a collective.
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    return bool(local.any())
