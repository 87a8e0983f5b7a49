"""Experts that transformers 5 holds fused (3-D), split into the names its own checkpoints use —
what vLLM's loaders read. The reference is the checkpoint transformers writes for the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rewardplane.server.weight_sync.expert_names import expert_splitter, split_fused_experts
from rewardplane.tinymodel import build_tiny_reward_model
from tests.fixtures.trainer import load_model


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_split_experts_are_the_checkpoint_transformers_writes(tmp_path: Path, family: str) -> None:
    path = build_tiny_reward_model(tmp_path, family=family)
    model = load_model(path)
    fused = [n for n, t in model.state_dict().items() if t.dim() == 3]
    assert fused and all(".mlp.experts." in n for n in fused)  # transformers 5's in-memory layout
    split = dict(split_fused_experts(list(model.state_dict().items()), block_sparse_moe=family == "mixtral"))
    saved = load_file(path / "model.safetensors")
    assert sorted(split) == sorted(saved)
    assert [n for n in saved if not torch.equal(split[n], saved[n])] == []


def test_a_model_without_experts_passes_unchanged() -> None:
    weights = [("model.layers.0.mlp.gate_proj.weight", torch.ones(4, 2))]
    assert expert_splitter(torch.nn.Linear(2, 2))(weights) is weights
