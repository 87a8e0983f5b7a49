"""Serving a pushed LoRA adapter on vLLM straight from the received GPU tensors.

vLLM 0.24's public way in (``add_lora``) loads an adapter from a directory: the worker would copy
the tensors to the host, write safetensors, read them back, pin each one and copy it to the GPU
again — 249 ms for a 7B adapter of 160 MB on an H100, against 39 ms for a merged push of all
13 GB. Here the worker builds vLLM's ``LoRAModel`` from the tensors where they already are and
hands it to vLLM's own ``add_adapter`` sequence (validation, cache bookkeeping, activation), so
only the activation's device-to-device copies remain.

It reaches into vLLM's worker LoRA manager (``_load_adapter``, ``_lora_model_cls``), which is not
a public API: where those differ (another vLLM version), ``VLLMInternalsChanged`` says so and the
caller falls back to the directory (vLLM's public path, 4.3x slower at 7B), for good.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rewardplane.protocol import AdapterConfig
from rewardplane.protocol.adapters import lora_pairs

# PEFT saves adapter tensors under this prefix; vLLM's name parser expects it.
PEFT_PREFIX = "base_model.model."
# The ``lora_path`` of an adapter built in memory. vLLM reads the path only to reload an evicted
# adapter, and the server keeps one adapter (max_cpu_loras 1) until the next replaces it; if it
# ever did, vLLM's error names this.
IN_MEMORY_PATH = "in-memory (rewardplane adapter push)"


class VLLMInternalsChanged(RuntimeError):
    """The installed vLLM's LoRA manager is not shaped as this module expects."""


def peft_adapter_config(names: list[str], adapter: AdapterConfig) -> dict[str, Any]:
    """``adapter_config.json`` as PEFT writes it, for the LoRA tensors named."""
    pairs, _ = lora_pairs(names)
    return {
        "peft_type": "LORA",
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "use_rslora": adapter.use_rslora,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in pairs}),
        "bias": "none",
        "modules_to_save": None,
    }


def expected_lora_modules(manager: Any) -> set[str]:
    """The module names vLLM accepts LoRA weights for (packed modules by their parts), as its
    directory loader computes them."""
    expected: set[str] = set()
    for module in manager.supported_lora_modules:
        expected.update(manager.packed_modules_mapping.get(module, [module]))
        if module == "experts":
            expected.add(module)
    return expected


def unexpected_modules(names: list[str], expected: set[str]) -> list[str]:
    """The LoRA tensors' modules vLLM has no LoRA layer for (the directory loader refuses these)."""
    pairs, _ = lora_pairs(names)
    return sorted(m for m in pairs if m.rsplit(".", 1)[-1] not in expected)


def lora_model_from_tensors(
    worker_manager: Any, adapter_id: int, tensors: dict[str, torch.Tensor], adapter: AdapterConfig
) -> Any:
    """vLLM's ``LoRAModel`` for ``tensors`` (pushed names: ``…q_proj.lora_A.weight``), on the
    tensors' device, checked as vLLM checks an adapter read from a directory."""
    try:
        from vllm.lora.peft_helper import PEFTHelper

        manager = worker_manager._adapter_manager
        expected = expected_lora_modules(manager)
        model = manager.model
        config = peft_adapter_config(list(tensors), adapter)
        config["vllm_max_position_embeddings"] = worker_manager.max_position_embeddings
        peft_helper = PEFTHelper.from_dict(config)
        lora_dtype = worker_manager.lora_config.lora_dtype
        build = worker_manager._lora_model_cls.from_lora_tensors
    except (AttributeError, ImportError) as e:
        raise VLLMInternalsChanged(f"vLLM's LoRA manager differs from 0.24's: {e}") from e
    if bad := unexpected_modules(list(tensors), expected):
        raise ValueError(
            f"the adapter has LoRA weights for modules this model has no LoRA layer for: {bad[:5]} "
            f"(vLLM adapts {sorted(expected)}); train the adapter on those target modules only"
        )
    peft_helper.validate_legal(worker_manager.lora_config)  # rank and features vLLM was started for
    device = next(iter(tensors.values())).device
    return build(
        lora_model_id=adapter_id,
        tensors={PEFT_PREFIX + n: t for n, t in tensors.items()},
        peft_helper=peft_helper,
        device=str(device),
        dtype=lora_dtype if isinstance(lora_dtype, torch.dtype) else None,
        model_vocab_size=worker_manager.vocab_size,
        weights_mapper=getattr(model, "hf_to_vllm_mapper", None),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )


@contextmanager
def loading_from_memory(worker_manager: Any, adapter_id: int, lora: Any) -> Iterator[None]:
    """While open, vLLM's ``add_lora`` for ``adapter_id`` takes ``lora`` instead of reading a
    directory; everything else of vLLM's ``add_adapter`` (replacing, evicting, activating) runs as
    it is."""
    if not hasattr(worker_manager, "_load_adapter"):
        raise VLLMInternalsChanged("vLLM's worker LoRA manager has no _load_adapter")
    own = vars(worker_manager)
    patched_before, previous = "_load_adapter" in own, own.get("_load_adapter")
    from_directory = worker_manager._load_adapter

    def load(request: Any) -> Any:
        return lora if request.lora_int_id == adapter_id else from_directory(request)

    worker_manager._load_adapter = load
    try:
        yield
    finally:
        if patched_before:
            worker_manager._load_adapter = previous
        else:
            del worker_manager._load_adapter  # the class's method again
