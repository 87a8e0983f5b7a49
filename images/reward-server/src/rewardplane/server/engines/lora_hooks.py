"""A pushed LoRA adapter served by the transformers engine: forward hooks on the target linears.

Each hooked layer returns ``base(x) + B(A(x)) * scaling`` — PEFT's LoRA forward, with the input
cast to the adapter's dtype as PEFT does — while the base weights, their names and the manifest
stay untouched (a later full push or checksum sees the plain model)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from rewardplane.protocol import AdapterConfig
from rewardplane.protocol.adapters import lora_pairs


class LoraHooks:
    """At most one adapter on ``model``; ``set`` swaps it whole or not at all."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._handles: list[Any] = []

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def set(self, tensors: Mapping[str, torch.Tensor], adapter: AdapterConfig) -> int:
        """Replace the adapter with ``tensors`` (``<module>.lora_A.weight`` / ``.lora_B.weight``);
        returns the number of layers adapted. Everything is resolved before the old hooks go."""
        pairs, plain = lora_pairs(list(tensors))
        if plain:
            raise ValueError(f"not LoRA tensors: {plain[:3]}")
        targets: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []
        for module_name, (a, b) in sorted(pairs.items()):
            if a is None or b is None:
                raise ValueError(f"LoRA on {module_name!r} needs both lora_A and lora_B")
            module = self.model.get_submodule(module_name)
            if not isinstance(module, torch.nn.Linear):
                raise ValueError(f"{module_name!r} is a {type(module).__name__}, not a Linear layer")
            targets.append((module, tensors[a], tensors[b]))
        self.clear()
        scaling = adapter.scaling
        for module, lora_a, lora_b in targets:
            self._handles.append(module.register_forward_hook(_lora_hook(lora_a, lora_b, scaling)))
        return len(targets)

    def clear(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _lora_hook(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> Any:
    def hook(_module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        x = args[0].to(lora_a.dtype)
        return (out + F.linear(F.linear(x, lora_a), lora_b) * scaling).to(out.dtype)

    return hook
