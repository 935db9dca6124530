"""The trainer's configuration: one frozen dataclass per TOML table, and ``TrainConfig``.

Every field is documented by the string under it (``pipetrain.config.docs`` reads them
for ``pipetrain train --help``). Each section checks its own fields when it is built
(``__post_init__``, so also on ``dataclasses.replace``) and raises ``ConfigError`` with
one line that names the field and the fix; the checks that relate fields of different
sections, or look at this machine's files, are ``pipetrain.config.checks.validate``.
Loading, ``--set`` overrides and TOML output are ``pipetrain.config.load``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from pipetrain.config.errors import ConfigError
from pipetrain.config.processes import check_processes
from pipetrain.config.steps import parse_steps
from pipetrain.config.values import at_least as _at_least
from pipetrain.config.values import check_split, recomputing_ranks, run_name_error
from pipetrain.config.values import check_values as _check_values
from pipetrain.config.values import one_of as _one_of
from pipetrain.heap import ALLOCATORS
from pipetrain.models.config import PRESETS

__all__ = [
    "ConfigError",
    "DataConfig",
    "ModelSection",
    "OptimConfig",
    "PipelineConfig",
    "RunConfig",
    "TrainConfig",
]

_PRECISIONS = ("fp32", "bf16")
_DEVICES = ("auto", "cpu", "cuda")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_MAX_BATCH_TOKENS = 1 << 31
# Longer waits are hangs; torch's process-group timeout (a timedelta) overflows far above it.
_MAX_TIMEOUT_S = 365 * 24 * 3600.0
_MAX_SEED = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


@dataclass(frozen=True)
class ModelSection:
    """Which model to train."""

    name: str = "llama-default"
    """Preset of pipetrain.models (`llama-default`, `llama-tiny`, `gpt2-tiny`, ...)."""
    init_from: str = ""
    """A local Hugging Face model directory (config.json, model.safetensors or its shards
    with model.safetensors.index.json, tokenizer.json) of LlamaForCausalLM,
    MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM or GPT2LMHeadModel (with
    --ep, a rank reads only its own experts): the model comes from its
    config.json instead of model.name, every rank loads its own layers' weights from it,
    and data.tokenizer defaults to its tokenizer.json (pipetrain.models.hf). "" = none."""

    capacity_factor: float = 0.0
    """MoE models: each expert takes at most capacity_factor x its fair share of a
    micro-batch's token assignments and the overflow is dropped (counted in the metrics);
    0 keeps the preset's routing (dropless for the built-in ones)."""

    def __post_init__(self) -> None:
        if self.name not in PRESETS:
            raise ConfigError(
                f"model.name {self.name!r} is not a model preset: use one of {', '.join(PRESETS)}"
            )
        _check_values("model", self)


@dataclass(frozen=True)
class PipelineConfig:
    """How the model is cut and scheduled."""

    pp: int = 3
    """Pipeline ranks (processes). 1 trains one stage in one process through the same code."""
    dp: int = 1
    """Data-parallel replicas of the pipeline: pp x dp processes, each replica reads 1/dp of
    every batch and gradients are averaged over the replicas (pipetrain.parallel.mesh)."""
    shard: bool = False
    """Shard each stage's parameters, gradients and optimizer state over the dp replicas
    (FSDP2's fully_shard; pipetrain.parallel.sharded) instead of replicating them. Needs
    dp > 1."""
    grad_as_bucket_view: bool = False
    """With replicated dp > 1: keep the all-reduce's flat buckets for the whole run and make
    every .grad a view into them (DDP's gradient_as_bucket_view): no copy into the buckets
    and back each step, and one gradient copy held throughout the step instead of the .grad
    tensors from the first backward plus the buckets after the last (docs/memory_model.md
    says which peak is lower). Not with shard."""
    tp: int = 1
    """Tensor-parallel ranks per stage: each block's projections, the embedding and the head
    are split over tp neighbouring processes (pipetrain.parallel.tp, on torch's DTensor):
    pp x dp x tp processes. heads, KV heads, the MLP width and the vocabulary must divide."""
    ep: int = 1
    """Expert-parallel ranks (MoE models): the experts of every MoE layer are split over ep
    of the dp replicas, tokens reach them by all-to-all (pipetrain.parallel.ep). ep must
    divide dp and the number of experts; dense parameters stay replicated over dp."""
    sequence_parallel: bool = False
    """With tp > 1: the norms and the residual stream run on 1/tp of the sequence (an
    all-gather and a reduce-scatter replace each all-reduce), which divides their
    activation memory by tp. Llama models (gpt2's learned positions are refused)."""
    chunks: int = 1
    """Stages per rank (virtual stages): >1 only for schedules that loop over the ranks."""
    schedule: str = "1f1b"
    """Schedule name from pipetrain.schedules.registry (`1f1b`, `gpipe`, `interleaved-1f1b`,
    `zb-h1`, ...), or a synchronous schedule file ending in .csv or .json
    (pipetrain.schedules.io; `pipetrain simulate --save` writes one), read on every rank."""
    microbatches: int = 8
    """Micro-batches per pipeline step; data.batch_size must be a multiple of it."""
    microbatches_auto: bool = False
    """`--microbatches auto` (microbatches = "auto" in a file): the first steps try up to 5
    counts near `microbatches` that the schedule and batch allow, 2 steps each; the run
    trains on with the fastest (pipetrain.train.microbatch_probe; logged in the metrics)."""
    split: str = ""
    """Blocks per model stage, e.g. "4,3,5" (the embedding goes with the first stage, the
    head with the last; `pipetrain plan` prints a balanced one). Empty: by `balance`."""
    balance: str = "uniform"
    """How to split when `split` is empty: `uniform` (even blocks), `params` (even
    parameters), `cost` (even compute time, estimated from each layer's FLOPs at
    data.seq_len: a large vocabulary's head weighs on the last stage)."""
    single_process: bool = False
    """Run every rank inside one process (the runtime's debug mode; no process group)."""
    device: str = "auto"
    """`auto` picks cuda when available, else cpu; `cpu` or `cuda` force one."""
    precision: str = "fp32"
    """`fp32`, or `bf16` autocast with fp32 master weights and fp32 reductions."""
    recompute: bool = False
    """Recompute each block's activations in backward (torch.utils.checkpoint per block)."""
    recompute_ranks: str = ""
    """Only these pipeline ranks recompute, e.g. "0,1": the first ranks of 1F1B-like
    schedules hold the most micro-batches (`pipetrain plan --auto` balances the split so
    that they get fewer blocks). Empty: `recompute` decides for every rank."""
    compile: bool = False
    """torch.compile each stage module."""
    timeout_s: float = 300.0
    """Seconds any blocking wait of the runtime may take before it fails with an error."""
    threads: int = 0
    """Torch intra-op threads per process; 0 = the machine's cores / local processes (>= 1)."""
    stream_steps: int = 0
    """Asynchronous schedules (pipedream, pipedream-2bw): training steps per stream; the
    pipeline drains only between streams. 0 = as long as evaluation and checkpoints allow."""
    vertical_sync: bool = False
    """PipeDream: every stage uses the weight version the first stage chose for a
    micro-batch."""
    early_grads: bool = True
    """A built-in schedule splits the backwards that another rank waits for into I and W
    and sends the input gradient between them (pipetrain.schedules.early_grads): the
    same order of work (a W may move to the end of its rank) and gradients, a shorter
    1F1B cool-down and GPipe turn. False: the Bs run whole."""

    def __post_init__(self) -> None:
        _at_least("pipeline.pp", self.pp, 1)
        _at_least("pipeline.dp", self.dp, 1)
        _at_least("pipeline.tp", self.tp, 1)
        _at_least("pipeline.ep", self.ep, 1)
        _at_least("pipeline.chunks", self.chunks, 1)
        _at_least("pipeline.microbatches", self.microbatches, 1)
        _at_least("pipeline.threads", self.threads, 0)
        _at_least("pipeline.stream_steps", self.stream_steps, 0)
        if not self.schedule:
            raise ConfigError("pipeline.schedule is empty: name a schedule, e.g. --schedule 1f1b")
        _one_of("pipeline.device", self.device, _DEVICES)
        if self.precision not in _PRECISIONS:
            raise ConfigError(f"pipeline.precision is {self.precision!r}: use fp32 or bf16")
        check_split(self.split, self.balance)
        recomputing_ranks(self.recompute, self.recompute_ranks, self.pp)  # checks them
        if not 0 < self.timeout_s <= _MAX_TIMEOUT_S:
            raise ConfigError(
                f"pipeline.timeout_s is {self.timeout_s}: give a positive number of seconds up "
                f"to {_MAX_TIMEOUT_S:.0f} (a year), e.g. 300"
            )
        check_processes(self)
        _check_values("pipeline", self)

    @property
    def processes(self) -> int:
        """Processes of the run: pp x dp x tp (one, in the single-process mode)."""
        return 1 if self.single_process else self.pp * self.dp * self.tp

    @property
    def recomputing_ranks(self) -> frozenset[int]:
        """The pipeline ranks that recompute their blocks' activations in backward."""
        return recomputing_ranks(self.recompute, self.recompute_ranks, self.pp)


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how batches are cut."""

    path: str = ""
    """Text file, folder of text files, or JSONL with a "text" field; "" = the Python
    standard library's source files on this machine."""
    tokenizer: str = ""
    """Optional local Hugging Face tokenizer.json ("" = bytes, vocabulary 256)."""
    batch_size: int = 32
    """Sequences per pipeline step (all micro-batches together)."""
    seq_len: int = 128
    """Tokens per sequence."""
    eval_fraction: float = 0.05
    """Share of the text held out for eval: whole documents chosen by a fixed hash of their
    name, or the tail of the text read when too few documents make that split lopsided."""
    eval_batches: int = 2
    """Batches of data.batch_size sequences in each evaluation."""
    max_bytes: int = 8_000_000
    """Read at most this many characters of text (the default corpus has ~30 million)."""

    def __post_init__(self) -> None:
        _at_least("data.batch_size", self.batch_size, 1)
        _at_least("data.seq_len", self.seq_len, 1)
        if self.batch_size * (self.seq_len + 1) > _MAX_BATCH_TOKENS:
            # Batches are built as one index array: far past this, numpy fails for memory.
            raise ConfigError(
                f"data.batch_size {self.batch_size} x data.seq_len {self.seq_len} is over "
                f"{_MAX_BATCH_TOKENS:,} tokens per batch: use a smaller --batch-size (and "
                f"optim.grad_accum for a larger effective batch)"
            )
        _at_least("data.eval_batches", self.eval_batches, 1)
        _at_least("data.max_bytes", self.max_bytes, 1024)
        if not 0.0 < self.eval_fraction <= 0.5:
            raise ConfigError(
                f"data.eval_fraction is {self.eval_fraction}: hold out a share in (0, 0.5], "
                f"e.g. 0.05"
            )
        _check_values("data", self)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, the learning-rate schedule, clipping, accumulation and the NaN guard."""

    lr: float = 3e-3
    """Peak learning rate, reached after the warm-up."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of optim.lr."""
    warmup_steps: int = 10
    """Optimizer steps of linear warm-up from 0 to optim.lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay; never applied to norms, biases or other 1-D tensors."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    grad_clip: float = 1.0
    """Clip the gradient to this global norm over all stages; 0 disables clipping."""
    grad_accum: int = 1
    """Pipeline steps whose gradients are summed (averaged) into one optimizer step."""
    max_bad_steps: int = 3
    """Stop the run after this many consecutive skipped (non-finite) updates."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"optim.lr is {self.lr}: give a positive learning rate, e.g. 3e-3")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(
                f"optim.min_lr_ratio is {self.min_lr_ratio}: use a fraction in [0, 1]"
            )
        _at_least("optim.warmup_steps", self.warmup_steps, 0)
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay is {self.weight_decay}: use 0 or more")
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"optim.{name} is {beta}: use a value in [0, 1), e.g. 0.9")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps is {self.eps}: use a small positive number, e.g. 1e-8")
        if self.grad_clip < 0:
            raise ConfigError(
                f"optim.grad_clip is {self.grad_clip}: give a positive norm, or 0 to turn "
                f"clipping off"
            )
        _at_least("optim.grad_accum", self.grad_accum, 1)
        _at_least("optim.max_bad_steps", self.max_bad_steps, 1)
        _check_values("optim", self)


@dataclass(frozen=True)
class RunConfig:
    """Length of the run, its outputs and its logging."""

    steps: int = 120
    """Optimizer steps to train."""
    seed: int = 0
    """Seed of the weights and of the batch order."""
    name: str = ""
    """Run directory name under run.out_dir ("" = model-schedule-ppP-date-time-pid: the
    process id keeps apart runs started in the same second, as a sweep's are)."""
    out_dir: str = "runs"
    """Folder that holds the run directories."""
    metrics: str = ""
    """Metrics JSONL file ("" = <run dir>/metrics.jsonl)."""
    evaluate: bool = True
    """Evaluate at the start, at the end and every run.eval_every steps; false: never
    (`pipetrain tune` measures throughput only)."""
    eval_every: int = 40
    """Evaluate every this many optimizer steps (and always at the start and the end); 0 =
    only then."""
    tensorboard: bool = False
    """Write TensorBoard logs to <run dir>/tensorboard (needs the tensorboard package)."""
    progress_bar: bool = True
    """On a terminal, show the progress as a live bar (tqdm: step, loss, tokens/s, ETA) with
    the other lines above it; false: plain lines there too, as in a log file or a pipe."""
    timeline: str = ""
    """Draw the measured timeline of the last step into this PNG, or write it as a Chrome /
    Perfetto trace (.json, times in microseconds, a track per rank); "" = neither."""
    profile: str = ""
    """Record these training steps with torch.profiler on every rank ("5-6", or "3"; counted
    from 1 as the progress counts them): each pipeline action is a named range (`F stage 1
    mb 3`, NVTX too on CUDA); per-rank traces, their merge into one Chrome/Perfetto trace
    and each rank's top operators go to <run dir>/profile/; "" = none."""
    profile_shapes: bool = False
    """With run.profile: also record the operators' input shapes (record_shapes)."""
    profile_memory: bool = False
    """With run.profile: also record tensor allocations (profile_memory)."""
    map_tensors: bool = False
    """On a CPU with glibc: give every tensor of 128 KiB or more a mapping of its own, returned
    when it is freed, so that the measured peak memory is the tensors' bytes without the
    holes the heap keeps between them (docs/memory_model.md); elsewhere the run says it has
    no effect. Steps run about 1.8x slower: for checking a plan's memory, not training."""
    allocator: str = "auto"
    """On a CPU, the C allocator of the processes the trainer starts (``LD_PRELOAD``):
    "auto" = tcmalloc where the system has it (Debian: libtcmalloc-minimal4), else the C
    library's; "tcmalloc" or "jemalloc" = that one (refused where not installed);
    "system" = the C library's (glibc's heap kept between steps). tcmalloc's resident set
    follows the tensors' bytes, as the plan counts them, at glibc's speed or better
    (docs/memory_model.md). A launcher of your own (torchrun) preloads as you tell it."""
    sample_tokens: int = 200
    """Bytes (tokens) of text to generate from the trained model at the end; 0 = none."""
    sample_temperature: float = 0.8
    """Sampling temperature of that text; 0 = greedy."""
    sample_prompt: str = "def "
    """Text the sample starts from."""
    checkpoint_dir: str = ""
    """Directory of the run's checkpoints ("" = none); every rank must see the same one."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many optimizer steps (0 = only at a stop signal and the
    end)."""
    keep: int = 0
    """Complete checkpoints kept in run.checkpoint_dir, the newest ones (0 = all)."""
    resume: bool = False
    """Continue from the newest valid checkpoint in run.checkpoint_dir (step 0 if there is
    none)."""
    stop_grace_s: float = 20.0
    """Seconds a step may still take after SIGTERM (then save, exit 0); past them it is given
    up unsaved, status 143. Launchers SIGKILL 30 s after SIGTERM: stay below (launch.guard)."""
    grad_report: int = 0
    """At the first optimizer step and every this many, every parameter's gradient norm,
    weight norm and ratio, flagged (no gradient, zero, non-finite, outside the two bounds
    below), printed in short and written to <run dir>/grad_report.jsonl; 0 = never."""
    grad_vanishing: float = 1e-8
    """run.grad_report flags a gradient norm below this as vanishing (0 = no lower bound)."""
    grad_exploding: float = 10.0
    """run.grad_report flags a gradient norm above this as exploding (0 = no upper bound)."""

    def __post_init__(self) -> None:
        _at_least("run.steps", self.steps, 1)
        _at_least("run.seed", self.seed, 0)
        if self.seed > _MAX_SEED:
            # torch.Generator.manual_seed takes 64 bits: the sample after the last step was a
            # ValueError traceback ("Overflow when unpacking long long").
            raise ConfigError(f"run.seed is {self.seed}: use 0 to {_MAX_SEED}")
        _at_least("run.eval_every", self.eval_every, 0)
        _at_least("run.sample_tokens", self.sample_tokens, 0)
        _at_least("run.checkpoint_every", self.checkpoint_every, 0)
        _at_least("run.keep", self.keep, 0)
        if not 0 < self.stop_grace_s <= _MAX_TIMEOUT_S:
            raise ConfigError(f"run.stop_grace_s is {self.stop_grace_s}: use seconds > 0, e.g. 20")
        _at_least("run.grad_report", self.grad_report, 0)
        for key, bound in (("vanishing", self.grad_vanishing), ("exploding", self.grad_exploding)):
            if bound < 0:
                raise ConfigError(f"run.grad_{key} is {bound}: use 0 (no bound) or more")
        if (self.resume or self.checkpoint_every or self.keep) and not self.checkpoint_dir:
            # run.keep too: without a checkpoint directory it would be ignored without a word.
            raise ConfigError(
                "run.resume, run.checkpoint_every and run.keep need run.checkpoint_dir: "
                "add --checkpoint-dir DIR"
            )
        self._check_sample()
        # "" until load_config names the run; validate refuses a config left without one.
        if self.name and not _RUN_NAME.match(self.name):
            raise ConfigError(run_name_error(self.name))
        if self.timeline and not self.timeline.endswith((".png", ".json")):
            raise ConfigError(
                f"run.timeline {self.timeline!r} must name a .png picture or a .json "
                f"Chrome/Perfetto trace, e.g. --timeline step.png"
            )
        parse_steps("run.profile", self.profile, self.steps)  # parsing it is its check
        _one_of("run.allocator", self.allocator, ALLOCATORS)
        if self.map_tensors and self.allocator in ("tcmalloc", "jemalloc"):
            raise ConfigError(
                f"run.map_tensors maps tensors through glibc's malloc, not {self.allocator}'s: "
                f"drop one, or --set run.allocator=system"
            )
        if (self.profile_shapes or self.profile_memory) and not self.profile:
            raise ConfigError("run.profile_shapes, run.profile_memory need --profile STEPS")
        _check_values("run", self)

    @property
    def profile_steps(self) -> range:
        """The steps run.profile names, counted from 1 (empty when it is "")."""
        return parse_steps("run.profile", self.profile, self.steps)

    def _check_sample(self) -> None:
        if self.sample_tokens and not self.sample_prompt:
            # The sample is drawn after the last step: an empty prompt crashed the run there.
            raise ConfigError(
                "run.sample_prompt is empty: give text for the sample to start from, "
                "or --set run.sample_tokens=0 for no sample"
            )
        if self.sample_temperature < 0:
            raise ConfigError(
                f"run.sample_temperature is {self.sample_temperature}: use 0 (greedy) or more"
            )


@dataclass(frozen=True)
class TrainConfig:
    """The whole resolved configuration of a training run."""

    model: ModelSection = field(default_factory=ModelSection)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def microbatch_size(self) -> int:
        return self.data.batch_size // self.pipeline.microbatches

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    @property
    def metrics_path(self) -> Path:
        return Path(self.run.metrics) if self.run.metrics else self.run_dir / "metrics.jsonl"
