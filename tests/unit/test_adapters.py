"""Adapter-only sync's pure parts: sync-mode resolution, the announce's rules, the checks of LoRA
tensors against the served model, the PEFT files written for vLLM, and plain parameter names
under vLLM's LoRA wrappers."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rewardplane.protocol import (
    AdapterConfig,
    ParamMeta,
    UpdateParamBatchRequest,
    WeightSyncMode,
    check_adapter_metadata,
    resolve_sync_mode,
)
from rewardplane.protocol import RewardModelTrainingMode as Mode

MANIFEST = {
    m.name: m
    for m in [
        ParamMeta(name="model.layers.0.self_attn.q_proj.weight", dtype="bfloat16", shape=(64, 32)),
        ParamMeta(name="model.layers.0.mlp.down_proj.weight", dtype="bfloat16", shape=(32, 128)),
        ParamMeta(name="model.norm.weight", dtype="bfloat16", shape=(32,)),
        ParamMeta(name="score.weight", dtype="float32", shape=(1, 32)),
    ]
}
ADAPTER = AdapterConfig(rank=4, alpha=8)


def _trained_lora(base: torch.nn.Module, alpha: int, targets: list[str]) -> torch.nn.Module:
    """``base`` with rank-2 LoRA adapters on ``targets``, both factors random (as after training:
    PEFT starts lora_B at zero, which would make the adapter a no-op)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=alpha, target_modules=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_()
    return model


def lora(module: str, out_f: int, in_f: int, rank: int = 4) -> list[ParamMeta]:
    return [
        ParamMeta(name=f"{module}.lora_A.weight", dtype="float32", shape=(rank, in_f)),
        ParamMeta(name=f"{module}.lora_B.weight", dtype="float32", shape=(out_f, rank)),
    ]


@pytest.mark.parametrize(
    ("mode", "lora_enabled", "want"),
    [
        ("auto", True, WeightSyncMode.ADAPTER),
        ("auto", False, WeightSyncMode.FULL),
        ("adapter", False, WeightSyncMode.ADAPTER),  # explicit: tried, and falls back at run time
        ("full", True, WeightSyncMode.FULL),
        (WeightSyncMode.ADAPTER, True, WeightSyncMode.ADAPTER),
    ],
)
def test_sync_mode_resolution(mode: str, lora_enabled: bool, want: WeightSyncMode) -> None:
    assert resolve_sync_mode(mode, lora_enabled=lora_enabled) is want


def test_multi_process_learners_must_sync_full() -> None:
    assert resolve_sync_mode("auto", lora_enabled=False, learner_world_size=4) is WeightSyncMode.FULL
    for mode in ("adapter", "auto"):
        with pytest.raises(ValueError, match=r"learner has 2 processes.*use mode='full'"):
            resolve_sync_mode(mode, lora_enabled=True, learner_world_size=2)


def test_unknown_sync_mode_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'merged' is not one of \['full', 'adapter', 'auto'\]"):
        resolve_sync_mode("merged", lora_enabled=True)


def test_scaling_follows_peft() -> None:
    assert AdapterConfig(rank=4, alpha=8).scaling == 2.0
    assert AdapterConfig(rank=16, alpha=8, use_rslora=True).scaling == 2.0


def test_announce_needs_the_adapter_config_exactly_in_adapter_mode() -> None:
    metas = lora("model.layers.0.self_attn.q_proj", 64, 32)
    UpdateParamBatchRequest(metadata=metas, training_mode=Mode.ADAPTER, adapter=ADAPTER)
    with pytest.raises(ValidationError, match="adapter"):
        UpdateParamBatchRequest(metadata=metas, training_mode=Mode.ADAPTER)
    with pytest.raises(ValidationError, match="adapter"):
        UpdateParamBatchRequest(metadata=[MANIFEST["score.weight"]], training_mode=Mode.FULL, adapter=ADAPTER)


def test_a_fitting_adapter_with_its_head_passes() -> None:
    metas = [
        *lora("model.layers.0.self_attn.q_proj", 64, 32),
        *lora("model.layers.0.mlp.down_proj", 32, 128),
        ParamMeta(name="score.weight", dtype="bfloat16", shape=(1, 32)),  # cast into the fp32 head
    ]
    assert check_adapter_metadata(metas, MANIFEST, ADAPTER, max_rank=16) == []


def test_adapter_problems_are_each_named() -> None:
    metas = [
        *lora("model.layers.0.self_attn.q_proj", 64, 32, rank=8),  # rank differs from the config's 4
        ParamMeta(name="model.layers.0.mlp.down_proj.lora_A.weight", dtype="float32", shape=(4, 128)),  # no B
        *lora("model.layers.0.self_attn.x_proj", 64, 32),  # no such layer
        *lora("model.norm", 32, 32),  # not a 2-D weight
        ParamMeta(name="model.layers.0.self_attn.q_proj.lora_magnitude_vector", dtype="float32", shape=(64,)),
    ]
    problems = "\n".join(check_adapter_metadata(metas, MANIFEST, ADAPTER, max_rank=2))
    assert "rank 4 exceeds the server's maximum LoRA rank 2" in problems and "--max-lora-rank" in problems
    assert "has shape [8, 32]; rank 4 over 'model.layers.0.self_attn.q_proj' needs [4, 32]" in problems
    assert "'model.layers.0.mlp.down_proj' needs both lora_A and lora_B" in problems
    assert "no 2-D weight 'model.layers.0.self_attn.x_proj.weight'" in problems
    assert "no 2-D weight 'model.norm.weight'" in problems
    assert "DoRA" in problems


def test_a_push_without_lora_tensors_is_not_an_adapter() -> None:
    problems = check_adapter_metadata([MANIFEST["score.weight"]], MANIFEST, ADAPTER, max_rank=16)
    assert any("carries no LoRA tensors" in p for p in problems)


def test_written_adapter_loads_in_peft_and_computes_what_was_pushed(tmp_path) -> None:
    """The directory vLLM loads is a real PEFT adapter: PEFT reads it back to the same function."""
    from peft import PeftModel, get_peft_model_state_dict

    from rewardplane.protocol.naming import normalize_params
    from rewardplane.server.weight_sync.worker.adapters import write_peft_adapter

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 8, bias=False)
            self.v_proj = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.v_proj(self.q_proj(x))

    torch.manual_seed(0)
    base = Net()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    trained = _trained_lora(base, alpha=6, targets=["q_proj", "v_proj"])
    x = torch.randn(3, 8)
    want = trained(x)
    wire = normalize_params(get_peft_model_state_dict(trained), keep_lora=True)  # the names a push carries
    assert sorted(wire) == [
        "q_proj.lora_A.weight",
        "q_proj.lora_B.weight",
        "v_proj.lora_A.weight",
        "v_proj.lora_B.weight",
    ]
    write_peft_adapter(tmp_path, wire, AdapterConfig(rank=2, alpha=6))
    fresh = Net()
    fresh.load_state_dict(base_state)
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path))
    assert torch.equal(loaded(x), want)


def test_hf_hooks_compute_peft_lora_and_swap_whole() -> None:
    from peft import get_peft_model_state_dict

    from rewardplane.protocol.naming import normalize_params
    from rewardplane.server.engines.lora_hooks import LoraHooks

    torch.manual_seed(1)
    served = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    base.load_state_dict(served.state_dict())
    trainer = _trained_lora(base, alpha=4, targets=["0", "2"])
    x = torch.randn(5, 8)
    plain = served(x)
    hooks = LoraHooks(served)
    tensors = normalize_params(get_peft_model_state_dict(trainer), keep_lora=True)
    assert hooks.set(tensors, AdapterConfig(rank=2, alpha=4)) == 2
    assert torch.equal(served(x), trainer(x))
    with pytest.raises(ValueError, match="needs both lora_A and lora_B"):
        hooks.set({"0.lora_A.weight": tensors["0.lora_A.weight"]}, AdapterConfig(rank=2, alpha=4))
    assert torch.equal(served(x), trainer(x))  # a refused adapter leaves the current one serving
    hooks.clear()
    assert torch.equal(served(x), plain)


def test_plain_parameter_names_under_lora_wrappers() -> None:
    """vLLM's LoRA layers hold the original as ``base_layer``; the models' loaders and the
    checksums look parameters up under the plain names."""
    from rewardplane.server.weight_sync.worker.vllm_host import _plain_parameter_names

    class Wrapper(torch.nn.Module):
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.base_layer = base

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj = Wrapper(torch.nn.Linear(2, 2))

        def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
            params = dict(self.named_parameters())
            for name, t in weights:
                params[name].data.copy_(t)

    model = torch.nn.Module()
    model.model = Inner()
    model.score = Wrapper(torch.nn.Linear(2, 1))  # a wrapped head: walked by vLLM's AutoWeightsLoader
    _plain_parameter_names(model)
    assert sorted(n for n, _ in model.named_parameters()) == [
        "model.qkv_proj.bias",
        "model.qkv_proj.weight",
        "score.bias",
        "score.weight",
    ]
    model.model.load_weights([("qkv_proj.weight", torch.ones(2, 2))])
    assert torch.equal(model.model.qkv_proj.base_layer.weight, torch.ones(2, 2))
    # what AutoWeightsLoader looks at for "score.weight": the children and direct parameters
    assert dict(model.score.named_children()) == {}
    assert dict(model.score.named_parameters(recurse=False))["weight"] is model.score.base_layer.weight
