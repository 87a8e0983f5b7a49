"""The base checkpoint's safetensors files: where the vLLM engine reads its manifest, and what a
level-2 wake (``sleep.py``) reloads the base weights from."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files (those the index names, when there is one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one at a time (host memory for one tensor at a time)."""
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
