"""The parts of building a vLLM LoRA adapter in memory that need no GPU: the PEFT config, which
modules vLLM accepts, putting vLLM's directory loader back, and the fallback signal where vLLM is
not shaped as expected. The build itself runs on GPUs (tests/gpu/test_vllm_adapter.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rewardplane.protocol import AdapterConfig
from rewardplane.server.engines.vllm_lora import (
    VLLMInternalsChanged,
    expected_lora_modules,
    loading_from_memory,
    lora_model_from_tensors,
    peft_adapter_config,
    unexpected_modules,
)

NAMES = [
    "model.layers.0.self_attn.q_proj.lora_A.weight",
    "model.layers.0.self_attn.q_proj.lora_B.weight",
    "model.layers.0.mlp.down_proj.lora_A.weight",
    "model.layers.0.mlp.down_proj.lora_B.weight",
]


def test_the_config_names_the_adapted_projections_and_scaling() -> None:
    config = peft_adapter_config(NAMES, AdapterConfig(rank=8, alpha=16, use_rslora=True))
    assert config["target_modules"] == ["down_proj", "q_proj"]
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"]) == (
        "LORA",
        8,
        16,
        True,
    )


def test_packed_modules_are_accepted_by_their_parts() -> None:
    manager = SimpleNamespace(
        supported_lora_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        packed_modules_mapping={
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
        },
    )
    expected = expected_lora_modules(manager)
    assert expected == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert unexpected_modules(NAMES, expected) == []
    odd = [*NAMES, "model.layers.0.mlp.router.lora_A.weight", "model.layers.0.mlp.router.lora_B.weight"]
    assert unexpected_modules(odd, expected) == ["model.layers.0.mlp.router"]


class DirectoryLoader:
    def _load_adapter(self, request: Any) -> str:
        return f"read {request.lora_path}"


def test_only_the_pushed_id_is_taken_from_memory_and_the_loader_comes_back() -> None:
    manager = DirectoryLoader()
    built = object()
    with loading_from_memory(manager, 7, built):
        assert manager._load_adapter(SimpleNamespace(lora_int_id=7, lora_path="-")) is built
        assert manager._load_adapter(SimpleNamespace(lora_int_id=6, lora_path="/x")) == "read /x"
    assert "_load_adapter" not in vars(manager)
    assert manager._load_adapter(SimpleNamespace(lora_int_id=7, lora_path="/y")) == "read /y"


def test_the_loader_comes_back_when_loading_fails() -> None:
    manager = DirectoryLoader()
    with pytest.raises(RuntimeError, match="activation failed"), loading_from_memory(manager, 1, object()):
        raise RuntimeError("activation failed")
    assert "_load_adapter" not in vars(manager)


def test_a_manager_not_shaped_like_vllms_says_so_for_the_fallback() -> None:
    tensors = {n: torch.zeros(2, 2) for n in NAMES}
    with pytest.raises(VLLMInternalsChanged):
        lora_model_from_tensors(SimpleNamespace(), 1, tensors, AdapterConfig(rank=2, alpha=4))
    with pytest.raises(VLLMInternalsChanged), loading_from_memory(SimpleNamespace(), 1, object()):
        pass
