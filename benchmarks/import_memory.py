"""Peak memory of a pipeline rank while it imports a Hugging Face model (``--init-from``).

    .venv/bin/python benchmarks/import_memory.py [--d-model 768] [--layers 12]
                                                 [--vocab 16384] [--pps 1 2 4]
                                                 [--shard-mb 100] [--dir /tmp/bench_import]

A random LlamaForCausalLM (transformers' own class, a few hundred MB in fp32) is saved
with ``save_pretrained`` in shards. Then, for each pipeline size, each rank runs in a
process of its own, as a training rank does: it builds its stage (the layers of the
even block split ``pipetrain train`` uses) and loads it with ``load_hf_weights``. Memory
is the process's resident set from /proc/self/status, counted from the process's own
start-up (torch and pipetrain imported, nothing built): its peak (VmHWM) over building
the stage and importing, and, with the peak reset after the build, what the import
added on top of the stage the rank holds anyway. Columns, in MB over that start-up:
the resident set once the stage is built ("built stage"), the peak over building and
importing, and the import's own addition. For contrast, a process that reads every tensor of the
directory (``safetensors.torch.load_file`` of each shard, as loading the whole model
does) is measured the same way. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

MB = 2**20


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current resident set (Linux >= 4.0).
    Path("/proc/self/clear_refs").write_text("5")


def save_model(args: argparse.Namespace, directory: Path) -> int:
    """A random Llama saved in shards; returns its bytes on disk (the weights)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=args.d_model * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.d_model // 64,
        num_key_value_heads=args.d_model // 64,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size=f"{args.shard_mb}MB")
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def rank_child(directory: str, rank: int, pp: int) -> dict[str, float]:
    """Build rank ``rank`` of ``pp``'s stage, then import its weights; memory in MB."""
    from pipetrain.models import build_stage, model_spec
    from pipetrain.models.hf import load_hf_weights, read_hf_config
    from pipetrain.train.plan import block_split

    config = read_hf_config(directory).config
    layers = block_split(config.n_layers, pp)[rank]
    base = _status("VmRSS")  # torch and pipetrain imported, nothing built
    stage = build_stage(model_spec(config), layers, seed=0, device="cpu")
    held = sum(t.numel() * t.element_size() for t in stage.state_dict().values())
    before, built = _status("VmRSS"), _status("VmHWM")
    _reset_peak()
    load_hf_weights(stage, directory, check=False)
    peak = _status("VmHWM")
    return {
        "stage": held / MB,
        "base": base / MB,
        "before": before / MB,
        "peak": max(built, peak) / MB,
        "import_peak": peak / MB,
    }


def whole_child(directory: str) -> dict[str, float]:
    """Every tensor of the directory read into memory of its own and kept, shard by shard
    (load_file's tensors may stay backed by the file until touched: copied here, as
    loading them into a model does)."""
    from safetensors.torch import load_file

    import pipetrain.models  # noqa: F401  (the same imports as a rank's baseline)

    base = _status("VmRSS")
    _reset_peak()
    kept = [
        {name: t.clone() for name, t in load_file(str(path)).items()}
        for path in sorted(Path(directory).glob("*.safetensors"))
    ]
    peak = _status("VmHWM")
    held = sum(t.numel() * t.element_size() for shard in kept for t in shard.values())
    return {"stage": held / MB, "base": base / MB, "before": base / MB, "peak": peak / MB}


def _child(*args: str) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", *args]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    found: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--pps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_import"))
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, directory, *numbers = args.child
        if kind == "whole":
            print(json.dumps(whole_child(directory)))
        else:
            print(json.dumps(rank_child(directory, int(numbers[0]), int(numbers[1]))))
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    size = save_model(args, args.dir) / MB
    shards = len(list(args.dir.glob("*.safetensors")))
    print(f"model: {size:.0f} MB of fp32 weights in {shards} shards ({args.dir})\n")
    print("| pp | rank | its weights MB | built stage MB | peak MB | import added MB |"
          " peak / its weights | peak / model |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [("whole", "-", _child("whole", str(args.dir)))]
    for pp in args.pps:
        for rank in range(pp):
            rows.append((str(pp), str(rank), _child("rank", str(args.dir), str(rank), str(pp))))
    for layout, which, m in rows:
        peak = m["peak"] - m["base"]
        added = m.get("import_peak", m["peak"]) - m["before"]
        print(
            f"| {layout} | {which} | {m['stage']:.0f} | {m['before'] - m['base']:.0f} | "
            f"{peak:.0f} | {added:.0f} | {peak / m['stage']:.2f} | {peak / size:.2f} |"
        )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
