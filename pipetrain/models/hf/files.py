"""The files of a Hugging Face model directory: which safetensors file holds each tensor
(``model.safetensors``, or the shards ``model.safetensors.index.json`` names), and a
check of every tensor a model needs against config.json, from the files' headers only
(torch-free: ``pipetrain train`` runs it before it starts a process).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from pipetrain.models.hf.config import HFImportError
from pipetrain.models.hf.names import Source

__all__ = ["INDEX_NAME", "SINGLE_NAME", "check_weights", "tensor_files", "tokenizer_file"]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def tensor_files(directory: Path | str) -> dict[str, Path]:
    """Tensor name -> the file that holds it. Only the index is read for a sharded model;
    a single file's header for an unsharded one."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {key: directory / name for key, name in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HFImportError(f"{index}: not a safetensors index ({exc})") from None
        for path in sorted(set(files.values())):
            if not path.exists():
                raise HFImportError(
                    f"{index} names the shard {path.name}, which is missing from {directory}: "
                    "copy every shard of the model"
                )
        return files
    single = directory / SINGLE_NAME
    if not single.exists():
        raise HFImportError(
            f"{directory} holds neither {SINGLE_NAME} nor {INDEX_NAME}: save the model with "
            "safetensors (save_pretrained(..., safe_serialization=True))"
        )
    try:
        with safe_open(str(single), framework="numpy") as f:
            return dict.fromkeys(f.keys(), single)
    except Exception as exc:  # safetensors raises its own error type for a damaged header
        raise HFImportError(f"{single}: not a safetensors file ({exc})") from None


def check_weights(directory: Path | str, sources: Mapping[str, Source]) -> None:
    """Every tensor ``sources`` reads is in the directory with the shape config.json
    implies; else one line that names the tensor and the file."""
    from safetensors import safe_open

    files = tensor_files(directory)
    wanted: dict[str, Source] = {s.key: s for s in sources.values()}
    by_file: dict[Path, list[Source]] = {}
    for key, source in sorted(wanted.items()):
        if key not in files:
            raise HFImportError(
                f"{directory} has no tensor {key!r}, which config.json's model needs: the "
                "weights and config.json are of different models; put the config.json saved "
                "with these weights beside them"
            )
        by_file.setdefault(files[key], []).append(source)
    for path, needed in by_file.items():
        try:
            with safe_open(str(path), framework="numpy") as f:
                shapes = {s.key: tuple(f.get_slice(s.key).get_shape()) for s in needed}
        except Exception as exc:
            raise HFImportError(f"{path}: unreadable safetensors file ({exc})") from None
        for source in needed:
            if shapes[source.key] != source.shape:
                raise HFImportError(
                    f"{path.name}: {source.key} has shape {shapes[source.key]} but config.json "
                    f"gives {source.shape}: the weights and config.json disagree; put the "
                    "config.json saved with these weights beside them"
                )


def tokenizer_file(directory: Path | str) -> Path | None:
    """The directory's tokenizer.json, or None."""
    path = Path(directory) / "tokenizer.json"
    return path if path.exists() else None
