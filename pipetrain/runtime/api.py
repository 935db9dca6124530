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
numbers: the debug mode. Pass a ``Schedule``, or the path of a CSV or JSON schedule file,
instead of a name to run a schedule of your own (``pipetrain.schedules.io`` writes and
reads them); ``build_pipeline`` validates and lowers it.

The loss is the sum over all target tokens of ``loss_fn`` (cross-entropy by default),
divided by the number of targets that are not -100 in the whole batch: the gradients are
those of one large batch, however it is split into micro-batches.

This module holds the pipeline and its step. ``build_pipeline``
(``pipetrain.runtime.build``) builds one: it checks its arguments
(``pipetrain.runtime.inputs``), builds this process's stages and connects them
(``pipetrain.runtime.wiring``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from pipetrain.diagnose.grads import GradBounds, GradRow, measure, report_rows
from pipetrain.models import PipelineSpec, StageModule
from pipetrain.runtime.collectives import dist_barrier, dist_step_summary
from pipetrain.runtime.errors import PipelineError, PipelineInputError, lost_peer_error
from pipetrain.runtime.executor import RankExecutor
from pipetrain.runtime.extras import split_extras
from pipetrain.runtime.hang import watch_pipeline
from pipetrain.runtime.inputs import (
    batch_rows,
    check_class_targets,
    check_token_ids,
    count_targets,
    positive_count,
    split_batch,
    token_table_rows,
)
from pipetrain.runtime.result import StepResult
from pipetrain.runtime.state import load_stage_state, stage_state
from pipetrain.runtime.timeline import gathered_timeline, merge_timelines, rank_events
from pipetrain.runtime.wiring import Wiring, retrain
from pipetrain.schedules import Kind, Schedule
from pipetrain.tensors import local_tensor

__all__ = ["Pipeline", "StepResult"]


class Pipeline:
    """A model cut into stages and run by a schedule. Build with ``build_pipeline``."""

    def __init__(
        self,
        schedule: Schedule,
        spec: PipelineSpec,
        split: tuple[tuple[int, ...], ...],
        stage_modules: dict[int, StageModule],
        wiring: Wiring,
        *,
        device: torch.device,
        timeout_s: float,
        class_targets: bool = False,
        names: tuple[str, ...] = (),
    ) -> None:
        """``stage_modules``: this process's stages, connected by ``wiring``
        (``pipetrain.runtime.wiring.wire``); ``build_pipeline`` builds both. ``names``:
        the whole model's state names (``pipetrain.models.layer_check.check_layers``)."""
        self.schedule = schedule
        self.spec = spec
        self.split = split
        self.device = device
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
        self._wiring = wiring
        self._group = wiring.group
        self._transport = wiring.transport
        self._reducer = wiring.reducer
        self._train = wiring.train
        self._eval = wiring.eval
        self._rank_map = wiring.rank_map
        # Kept so that rebind_parameters can update, in place, what the reducers sum.
        self._tied_params = wiring.tied_params
        self._replica_params = wiring.replica_params
        self.tied_names = wiring.tied_names
        placement = schedule.placement
        self._has_first = any(placement.is_first(s) for s in stage_modules)
        self._vocab = token_table_rows(spec, stage_modules)
        self._has_last = any(placement.is_last(s) for s in stage_modules)
        self._class_targets = class_targets  # the default loss: targets are class indices
        self._names = names
        self._extra_names = frozenset().union(*(m.extra_names for m in stage_modules.values()))
        # The hang doctor's side of this process (pipetrain.runtime.hang): None in one
        # process; ``hang_watch.report_dir`` is where the report it collects is saved.
        self.hang_watch = watch_pipeline(self, self._group, schedule, [*self._train, *self._eval])

    def reschedule(self, schedule: Schedule) -> None:
        """Train with ``schedule`` (lowered, as ``resolve_schedule`` returns it) from the
        next step: the same stages, placement and transport, another micro-batch count
        (``pipetrain train --microbatches auto``). Every rank must switch before the same
        step; evaluation keeps the program the pipeline was built with."""
        if schedule.placement != self.schedule.placement or schedule.asynchronous:
            raise PipelineInputError(
                f"reschedule: {schedule.name!r} is asynchronous or places its stages unlike "
                f"{self.schedule.name!r}: give a synchronous schedule of the same placement"
            )
        self._wiring = retrain(self._wiring, schedule)
        self._train = self._wiring.train
        self.schedule = schedule
        if self.hang_watch is not None:  # the doctor reads the actions that run now
            self.hang_watch.follow([*self._train, *self._eval])

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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This process's parameters and persistent buffers by global name (every rank's in
        the debug mode); sharded ones gathered whole (``pipetrain.runtime.state``)."""
        return stage_state(self.modules)

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Take this process's layers' tensors from ``state``, a full state dict by global
        name; ``strict``: a missing or unexpected name is a one-line error."""
        load_stage_state(self.modules, state, self._names, self.tied_names, strict=strict)

    def zero_grad(self) -> None:
        for module in self.modules:
            module.zero_grad(set_to_none=True)

    def grad_report(self, bounds: GradBounds | None = None) -> list[GradRow]:
        """Each parameter of this process after a ``step``: gradient norm, weight norm, their
        ratio and flags (no gradient: unused or frozen; zero; non-finite; outside ``bounds``),
        by stage and global name (``pipetrain.diagnose.grads``). A sharded (DTensor)
        parameter is measured on this rank's shard; ``pipetrain train --grad-report`` adds
        up every rank's into one table."""
        placement = self.schedule.placement
        params = [
            (stage, name, p)
            for stage in self.stages
            for name, p in dict(self._stage_modules[stage].named_parameters()).items()
        ]
        not_in_norm = {
            id(p)
            for stage, name, p in params
            if name in self.tied_names or placement.replica(stage) > 0
        }
        measured = measure(params, in_norm=lambda _, p: id(p) not in not_in_norm)
        return report_rows(measured, bounds or GradBounds(), step=self._passes[True])

    # ----------------------------------------------------------------- steps
    def step(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        denominator: float | None = None,
        label: str | None = None,
        ranges: bool = False,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> StepResult:
        """One forward and backward of the whole batch; gradients end up in ``.grad``.

        Every rank may pass the whole batch; ranks with a first stage need ``inputs``,
        ranks with a last stage ``targets`` (B, T) with -100 for tokens that do not count.
        ``denominator``: what the summed loss is divided by, by default the targets that
        count in this batch. Data parallelism passes the global batch's count over the
        replicas, so that replicas with fewer tokens weigh less in the mean of replicas.
        ``label``: how errors name this step (default "training step N", N counting this
        pipeline's steps from 1; a loop that resumed or accumulates knows better).
        ``ranges``: run each action inside a profiler range named after it (``F stage 1 mb
        3``; torch.profiler's record_function, and NVTX on CUDA for Nsight), for a step
        that torch.profiler records (pipetrain.runtime.ranges); the numbers are the same.
        ``extras``: the spec's per-batch side inputs by name, batch first (position ids,
        attention masks), cut into micro-batches like ``inputs``.

        A step that raises after some micro-batches went backward leaves their gradients
        in ``.grad``; the next step is refused until they are zeroed (``zero_grad()``).
        """
        for ex in self._train:
            ex.use_ranges(ranges, nvtx=self.device.type == "cuda")
        return self._run(self._train, inputs, targets, True, denominator, label, extras)

    def eval_loss(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        denominator: float | None = None,
        label: str | None = None,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> float:
        """The loss of a batch, forward only, without touching gradients (``denominator``,
        ``label`` and ``extras`` as in ``step``)."""
        return self._run(self._eval, inputs, targets, False, denominator, label, extras).loss

    def _run(
        self,
        executors: list[RankExecutor],
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        training: bool,
        denominator: float | None = None,
        label: str | None = None,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> StepResult:
        if training and self._partial is not None:
            self._refuse_partial_grads()
        step = self._step  # numbers the messages: every pass, the same on every rank
        self._step += 1
        self._passes[training] += 1
        where = label or self._label(training)
        self._started = False
        try:
            return self._run_pass(
                executors, step, where, inputs, targets, training, denominator, extras
            )
        except PipelineError as exc:
            self._note_partial(executors, training, where)
            self._ask_doctor(str(exc) + self._rank_map)
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
            self._ask_doctor(str(failure) + self._rank_map)
            raise PipelineError(str(failure) + self._rank_map) from exc
        except BaseException:
            self._note_partial(executors, training, where)
            raise
        finally:
            self._started = False

    def _ask_doctor(self, error: str) -> None:
        """A wait failed: every rank's state, collected through the store (runtime.hang)."""
        if self.hang_watch is not None:
            self.hang_watch.on_failure(error)

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
        extras: Mapping[str, torch.Tensor] | None,
    ) -> StepResult:
        """One pass: ``step`` numbers its messages on the wire, ``where`` names it in errors."""
        device, program = self.device, executors[0].schedule  # evaluation's may differ
        rows = batch_rows(inputs, targets)
        side = split_extras(extras, self.spec, self._extra_names, rows, program, device)
        input_mbs = split_batch("inputs", inputs, self._has_first, program, device)
        if self._vocab is not None and inputs is not None:
            check_token_ids(inputs, self._vocab)
        target_mbs = split_batch("targets", targets, self._has_last, program, device)
        if self._class_targets and targets is not None:
            check_class_targets(targets)
        tokens = count_targets(inputs, targets, self._has_last, denominator)
        divide_by = float(max(tokens, 1)) if denominator is None else positive_count(denominator)
        if training:
            self._reducer.begin()
        for ex in executors:
            ex.begin(step, input_mbs, target_mbs, divide_by, training, where, side)
        self._started = True
        if self._group is None:
            self._transport.begin_step(step, [], where)  # in memory, messages match by name
            return self._run_local(executors, where, tokens, training)
        # The barrier first: gloo's monitored barrier uses point-to-point tags that could
        # match receives posted early.
        dist_barrier(self._group, executors[0].rank, where, self._timeout_s, self.device)
        self._transport.begin_step(step, [executors[0].wire], where, executors[0].acks)
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
        program = ex.schedule
        width = 2 + 2 * max(len(row) for row in program.actions)
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
        timeline = gathered_timeline(program, rows, skip=2)
        return StepResult(loss, int(max(r[1] for r in rows)), timeline, elapsed)


def _nonzero(grad: torch.Tensor | None) -> bool:
    if grad is None:
        return False
    # A sharded (FSDP2) gradient is a DTensor: its local shard answers without a collective.
    return bool(local_tensor(grad).any())
