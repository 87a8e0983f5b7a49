"""``rewardplane check-model`` on tiny configs of every served family, read from disk as a user's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import (
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from rewardplane.cli import main as cli_main
from rewardplane.modelcheck import PRM_STEP_TAG, count_params
from rewardplane.protocol.families import KNOWN_FAMILIES, MOE_FAMILIES
from rewardplane.tinymodel import FAMILIES, build_tiny_reward_model

SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
SIZES |= {"num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512}


def save(
    tmp_path: Path, config: Any, arch: str, *, pad: str | None = "<pad>", special: list[str] = ()
) -> Path:
    config.architectures = [arch]
    config.save_pretrained(tmp_path)
    tok = {"pad_token": pad, "additional_special_tokens": list(special)}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok))
    return tmp_path


def run(path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    rc = cli_main(["check-model", str(path), "--json", *args])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("config", "arch", "pooled"),
    [
        (LlamaConfig(**SIZES), "LlamaForSequenceClassification", True),
        (Qwen2Config(**SIZES), "Qwen2ForSequenceClassification", False),
        (Qwen3Config(**SIZES, head_dim=16), "Qwen3ForSequenceClassification", False),
        (Gemma2Config(**SIZES, head_dim=16), "Gemma2ForSequenceClassification", False),
        (MistralConfig(**SIZES), "MistralForSequenceClassification", True),
    ],
)
def test_dense_families_pass(tmp_path, capsys, config, arch, pooled):
    rc, report = run(save(tmp_path, config, arch), capsys, "--max-model-len", "256")
    assert rc == 0 and report["ok"], report["failures"]
    assert report["architecture"] == arch
    assert report["pooled_rows"] is pooled
    assert report["tensor_parallel_sizes"] == [1, 2, 4]  # 4 heads, 2 kv heads
    assert "gate_proj" in report["lora_targets"]
    # KV cache: 2 (k, v) x 2 layers x 2 kv heads x 16 dims x 256 tokens x 2 bytes (bf16)
    assert report["kv_cache_bytes"] == 2 * 2 * 2 * 16 * 256 * 2
    assert report["weights_bytes"] == 2 * report["params"]


def test_moe_counts_experts_and_targets_attention(tmp_path, capsys):
    cfg = Qwen3MoeConfig(**SIZES, head_dim=16, num_experts=4, moe_intermediate_size=32)
    rc, report = run(
        save(tmp_path, cfg, "Qwen3MoeForSequenceClassification"),
        capsys,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
    )
    assert rc == 0, report["failures"]
    assert "gate_proj" not in report["lora_targets"]
    assert report["params"] > 0 and report["weights_bytes"] == 4 * report["params"]
    assert report["family"] == "qwen3_moe"
    # every expert is counted: four MLPs of width 32 and the router outweigh one dense MLP of 128
    assert report["params"] > count_params(Qwen3Config(**SIZES, head_dim=16).to_dict())


def test_process_reward_model_needs_its_step_tag(tmp_path, capsys):
    arch = "Qwen2ForProcessRewardModel"
    rc, report = run(
        save(tmp_path / "ok", Qwen2Config(**SIZES), arch, special=[PRM_STEP_TAG]),
        capsys,
        "--max-model-len",
        "256",
    )
    assert rc == 0 and report["prm_step_tag"] is True
    rc, report = run(save(tmp_path / "bad", Qwen2Config(**SIZES), arch), capsys, "--max-model-len", "256")
    assert rc == 1 and report["prm_step_tag"] is False
    assert any(PRM_STEP_TAG in f for f in report["failures"])


def test_broken_config_says_what_fails(tmp_path, capsys):
    cfg = LlamaConfig(**{**SIZES, "num_key_value_heads": 3, "pad_token_id": None})
    path = save(tmp_path, cfg, "LlamaForCausalLM", pad=None)
    rc = cli_main(["check-model", str(path), "--max-model-len", "4096"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "not divisible by 3 key/value heads" in out
    assert "no score head" in out
    assert "exceeds max_position_embeddings 512" in out
    assert "no pad token" in out


def test_missing_tokenizer_fails(tmp_path, capsys):
    LlamaConfig(**SIZES, architectures=["LlamaForSequenceClassification"]).save_pretrained(tmp_path)
    rc, report = run(tmp_path, capsys)
    assert rc == 1 and any("no tokenizer files" in f for f in report["failures"])


def built_params(config: Any, model_class: str) -> int:
    """What transformers builds of ``config`` (on the meta device: no memory, no init)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, model_class)(config)
    return sum(p.numel() for p in model.parameters())


def test_every_tiny_family_is_a_served_family() -> None:
    assert set(FAMILIES) == KNOWN_FAMILIES


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_passes_with_exactly_its_parameters(family, tmp_path, capsys):
    """The tiny model of each family, as built and saved (weights, trained tokenizer), checks OK,
    and its parameter count is transformers' own: q/k norms (Qwen3), four norms per layer
    (Gemma 2), experts and their router (Qwen3-MoE, Mixtral)."""
    path = build_tiny_reward_model(tmp_path / family, family=family, num_labels=2)
    rc, report = run(path, capsys, "--max-model-len", "256", "--dtype", "float32")
    assert rc == 0 and report["ok"], report["failures"]
    assert (report["family"], report["architecture"]) == (family, FAMILIES[family].model_class)
    from transformers import AutoConfig

    assert report["params"] == built_params(AutoConfig.from_pretrained(path), FAMILIES[family].model_class)
    assert report["weights_bytes"] == 4 * report["params"]
    assert ("gate_proj" in report["lora_targets"]) is (family not in MOE_FAMILIES)
    # Mistral's window is on every layer in transformers; vLLM is told so (its config has no layer_types)
    want = {"layer_types": ["sliding_attention"] * 2} if family == "mistral" else {}
    assert report["vllm_overrides"] == want


@pytest.mark.parametrize(
    ("config", "model_class"),
    [
        # biases everywhere: attention_bias (q/k/v/o) and mlp_bias (gate/up/down)
        (LlamaConfig(**SIZES, attention_bias=True, mlp_bias=True), "LlamaForSequenceClassification"),
        (Gemma2Config(**SIZES, head_dim=16, attention_bias=True), "Gemma2ForSequenceClassification"),
        # dense layers among the sparse ones: layer 0 by name, every second by the step
        (
            Qwen3MoeConfig(
                **{**SIZES, "num_hidden_layers": 4},
                head_dim=16,
                num_experts=4,
                moe_intermediate_size=32,
                mlp_only_layers=[0],
                decoder_sparse_step=2,
            ),
            "Qwen3MoeForSequenceClassification",
        ),
    ],
)
def test_count_params_is_exact_for_biases_and_mixed_layers(config, model_class):
    config.num_labels = 3
    assert count_params(config.to_dict()) == built_params(config, model_class)


def test_count_params_counts_a_shared_expert_and_its_gate():
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        **SIZES, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48
    )
    assert count_params(config.to_dict()) == built_params(config, "Qwen2MoeForSequenceClassification")


def test_tiny_model_cli_builds_the_family_asked_for(tmp_path, capsys):
    assert cli_main(["tiny-model", "--family", "gemma2", "--out", str(tmp_path / "g")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "g")
    rc, report = run(tmp_path / "g", capsys, "--max-model-len", "256")
    assert rc == 0 and report["architecture"] == "Gemma2ForSequenceClassification"


def test_an_untied_gemma2_fails_naming_vllms_need(tmp_path, capsys):
    cfg = Gemma2Config(**SIZES, head_dim=16, tie_word_embeddings=False)
    rc, report = run(save(tmp_path, cfg, "Gemma2ForSequenceClassification"), capsys, "--max-model-len", "256")
    assert rc == 1 and any("tie_word_embeddings" in f for f in report["failures"]), report["failures"]


def test_tensor_parallel_sizes_divide_the_experts_width(tmp_path, capsys):
    cfg = Qwen3MoeConfig(**SIZES, head_dim=16, num_experts=4, moe_intermediate_size=30)
    rc, report = run(
        save(tmp_path, cfg, "Qwen3MoeForSequenceClassification"), capsys, "--max-model-len", "256"
    )
    assert rc == 0 and report["tensor_parallel_sizes"] == [1, 2]  # 4 heads would allow 4; 30 rows do not
