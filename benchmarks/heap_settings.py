"""What glibc's settings, tcmalloc and jemalloc do to a CPU process's heap holes, and speed.

``malloc_replay.py`` finds the holes made by small objects placed in freed activations.
This script trains two layouts of llama-default (2 processes) under each setting glibc
offers without another allocator, and prints each process's measured peak beside the
tensors' bytes (the run with ``run.map_tensors``) and the run's tokens/s:

- the trainer's heap (``pipetrain.heap.keep_heap``), the reference;
- glibc tunables read at start (``GLIBC_TUNABLES``): small frees coalesced at once (no
  thread cache, no fast bins), a larger thread cache;
- ``malloc_trim(0)`` before every F, B and W (free pages in the heap's middle given back);
- a larger mmap threshold for the mapped run (1 MiB, 4 MiB), and the mapped run with huge
  pages for its mappings (``glibc.malloc.hugetlb=1``);
- and, where installed, the allocators with size classes that ``run.allocator`` preloads:
  tcmalloc (the trainer's choice where found) and jemalloc.

The trims and thresholds reach the trainer's processes through a ``sitecustomize`` module
written to a folder put first on their ``PYTHONPATH``.

    .venv/bin/python benchmarks/heap_settings.py --out /tmp/heap_settings
    .venv/bin/python benchmarks/heap_settings.py --out /tmp/alloc --steps 8 --repeats 3 \
        --only "heap kept,tensors mapped,tcmalloc,jemalloc"

About 15 s a run; BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from heap_replay import train_layout

_MIB = 2**20

LAYOUTS = (
    "--pp 2 --schedule zb-h2 --microbatches 4",
    "--pp 2 --schedule 1f1b --microbatches 4 --no-early-grads",
)

_MAPPED = ["--set", "run.map_tensors=true"]

# (name, environment added, trainer flags added)
SETTINGS: tuple[tuple[str, dict[str, str], list[str]], ...] = (
    ("glibc's heap kept (run.allocator=system)", {}, []),
    ("tensors mapped (run.map_tensors)", {}, _MAPPED),
    ("no thread cache, no fast bins",
     {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"}, []),
    ("thread cache of 50 a size", {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=50"}, []),
    ("malloc_trim before every F, B, W", {"HEAP_SETTINGS_TRIM": "1"}, []),
    ("mapped from 1 MiB", {"HEAP_SETTINGS_MMAP": str(2**20)}, _MAPPED),
    ("mapped from 4 MiB", {"HEAP_SETTINGS_MMAP": str(4 * 2**20)}, _MAPPED),
    ("mapped, huge pages", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, _MAPPED),
    ("tcmalloc (run.allocator=auto, the trainer's)", {}, ["--set", "run.allocator=tcmalloc"]),
    ("jemalloc (run.allocator=jemalloc)", {}, ["--set", "run.allocator=jemalloc"]),
)  # fmt: skip

# Runs first in every Python process of a run: the mapped runs' threshold is read from
# pipetrain.heap by the trainer when it starts, and the trims wrap the executor's actions.
_SITE = """
import ctypes, os

if os.environ.get("HEAP_SETTINGS_MMAP"):
    import pipetrain.heap
    pipetrain.heap.MAPPED_TENSORS = int(os.environ["HEAP_SETTINGS_MMAP"])
if os.environ.get("HEAP_SETTINGS_TRIM"):
    import pipetrain.runtime.executor as executor
    trim = ctypes.CDLL("libc.so.6").malloc_trim

    def trimmed(run):
        def action(self, *args, **kwargs):
            trim(0)
            return run(self, *args, **kwargs)
        return action

    cls = executor.RankExecutor
    cls._forward = trimmed(cls._forward)
    cls._run_backward = trimmed(cls._run_backward)
    cls._weight = trimmed(cls._weight)
"""


def _tokens_per_s(run: Path) -> float:
    """The median tokens/s of the run's steps after the first."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
    return statistics.median(rates) if rates else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the runs made here")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=1, help="rounds of every setting (medians)")
    p.add_argument("--only", default="", help="settings whose name holds one of these, by comma")
    args = p.parse_args()
    site = args.out / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE)
    path = os.pathsep.join(x for x in (str(site), os.environ.get("PYTHONPATH", "")) if x)
    wanted = [w for w in args.only.split(",") if w]
    chosen = [
        (k, s) for k, s in enumerate(SETTINGS) if not wanted or any(w in s[0] for w in wanted)
    ]
    results: dict[tuple[str, str], list[tuple[list[float], float]]] = {}
    print("| layout | setting | measured MiB, per process | tokens/s |")
    print("|---|---|---|---|")
    for r in range(args.repeats):
        for i, flags in enumerate(LAYOUTS):
            for k, (name, env, extra) in chosen:
                run = f"l{i}-s{k}-r{r}"
                environment = dict(os.environ, PYTHONPATH=path, **env)
                check = train_layout(flags, args.out, run, args.steps, extra, env=environment)
                peaks = [b / _MIB for b in check["measured_peak"]]
                rate = _tokens_per_s(args.out / run)
                results.setdefault((flags, name), []).append((peaks, rate))
                shown = ", ".join(f"{b:.1f}" for b in peaks)
                print(f"| {flags} | {name} | {shown} | {rate:,.0f} |", flush=True)
    if args.repeats > 1:
        print(f"\nmedians of {args.repeats} runs:\n")
        print("| layout | setting | measured MiB, per process | tokens/s |")
        print("|---|---|---|---|")
        for (flags, name), runs in results.items():
            peaks = [statistics.median(p) for p in zip(*(p for p, _ in runs), strict=True)]
            rate = statistics.median(r for _, r in runs)
            shown = ", ".join(f"{b:.1f}" for b in peaks)
            print(f"| {flags} | {name} | {shown} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
