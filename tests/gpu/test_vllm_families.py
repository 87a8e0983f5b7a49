"""Every served decoder family on vLLM, one GPU: a tiny random bf16
``<Family>ForSequenceClassification`` per family of ``rewardplane.tinymodel.FAMILIES`` (Llama,
Qwen2, Qwen3 with q/k norms, Gemma 2 with soft-capping, a sliding window and tied embeddings,
Mistral with a sliding window, Qwen3-MoE and Mixtral with 4 experts), each served by its own vLLM
server (``--enforce-eager``: the shortest start), the trainer in this process on the same GPU.

- Raw scores equal transformers' (fp32 reference of the same weights) within bf16 noise; the
  texts cross the 16-token sliding window. Llama and Mistral run the final layer on the pooled
  rows (the server's log says so), the others every row.
- Full, head-only, LoRA-merged and delta pushes over the same-GPU transport (CUDA IPC, which
  ``backend="auto"`` picks) make the server score like the trainer and hold the trainer's bytes
  in every parameter (``/param_checksums``): fused q/k/v and gate/up, Gemma 2's four norms a
  layer, the experts' fused tensors and their router.

The copy plan against vLLM's own loaders for every family is ``test_copy_plan_vllm.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rewardplane.protocol.families import MOE_FAMILIES, POOLED_ROWS_ARCHS
from rewardplane.testing.servers import ServerHandle
from rewardplane.tinymodel import FAMILIES
from tests.gpu.conftest import SIZES, build_seqcls
from tests.gpu.vllm_support import (
    TEXTS,
    Trainer,
    assert_close,
    assert_same_parameters,
    check_after_push,
    direct_sync,
    fill_prefix_cache,
    load_trainer_model,
    perturb,
    reference_scores,
    served,
    server_checksums,
    start_vllm_server,
    stop,
    vllm_family_checksums,
    vllm_lacks_moe_kernels,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600), pytest.mark.gpus(1)]


def test_engine_args_give_vllm_mistrals_window_on_every_layer(tmp_path: Path) -> None:
    """No server start: a Mistral config (no ``layer_types``) gets them as ``hf_overrides``; a
    user's own ``--hf-overrides`` value is kept; other families get none."""
    import json

    from rewardplane.server.config import ServerConfig
    from rewardplane.server.engines.vllm_engine import build_engine_args
    from rewardplane.tinymodel import family_config

    cfg = ServerConfig(model=str(tmp_path), engine="vllm")
    mistral = family_config("mistral", num_layers=3).to_dict()
    args = build_engine_args(cfg, 1024, hf_config=mistral)
    assert args.hf_overrides["layer_types"] == ["sliding_attention"] * 3  # type: ignore[index]
    own = ServerConfig(
        model=str(tmp_path),
        engine="vllm",
        extra_engine_args=["--hf-overrides", json.dumps({"layer_types": ["x"]})],
    )
    assert build_engine_args(own, 1024, hf_config=mistral).hf_overrides["layer_types"] == ["x"]  # type: ignore[index]
    llama = family_config("llama").to_dict()
    assert "layer_types" not in build_engine_args(cfg, 1024, hf_config=llama).hf_overrides  # type: ignore[operator]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_trainer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Trainer, ServerHandle]]:
    """(family, the trainer's view of its server, the server): one server at a time, stopped after
    its tests."""
    import torch
    from transformers import AutoTokenizer

    family: str = request.param
    if family in MOE_FAMILIES and (why := vllm_lacks_moe_kernels()) is not None:
        pytest.skip(why)
    model_dir = build_seqcls(
        tmp_path_factory.mktemp(f"family-{family}"), SIZES["tiny"], family=family, seed=3
    )
    handle = wait_ready(
        start_vllm_server(model_dir, tmp_path_factory.mktemp(f"logs-{family}"), gpu=0, enforce_eager=True)
    )
    device = torch.device("cuda", 0)  # the server's GPU: the push goes over CUDA IPC
    sync = direct_sync([handle.url], device)
    try:
        model = load_trainer_model(model_dir, device)
        yield (
            family,
            Trainer(model, AutoTokenizer.from_pretrained(model_dir), sync, device, handle.url),
            handle,
        )
    finally:
        sync.close()
        stop(handle)


def test_scores_equal_transformers_within_bf16_noise(
    family_trainer: tuple[str, Trainer, ServerHandle],
) -> None:
    """With the pooled rows where the family has them (``POOLED_ROWS_ARCHS``: the server logs it)."""
    family, t, handle = family_trainer
    got, version = served(t.url)
    assert version == 0
    assert_close(
        got, reference_scores(t.model, t.tokenizer, TEXTS, t.device), f"{family}: vLLM vs transformers"
    )
    pooled = "MLP and norm on each prompt's last token" in handle.log()
    assert pooled is (FAMILIES[family].model_class in POOLED_ROWS_ARCHS), handle.log()[-3000:]


def test_full_push_over_the_same_gpu_transport_lands_bit_for_bit(
    family_trainer: tuple[str, Trainer, ServerHandle],
) -> None:

    from rewardplane.protocol import RewardModelTrainingMode as Mode

    family, t, _ = family_trainer
    before = fill_prefix_cache(t.url)
    perturb(t.model, 0.1, seed=5)
    assert t.sync.push(t.model.state_dict(), version=1, training_mode=Mode.FULL) == 1
    assert str(getattr(t.sync.open().comm, "backend", "?")) == "ipc"
    check_after_push(t, 1, before, f"{family}: full push over CUDA IPC")
    _exact(family, t, 1, "full push over CUDA IPC")


def test_head_only_lora_merged_and_delta_pushes_land_bit_for_bit(
    family_trainer: tuple[str, Trainer, ServerHandle],
) -> None:
    """After the full push: the head alone; a LoRA on the attention's q/v (the targets every family
    has, MoE included) merged before the push, its head in ``modules_to_save``; a delta push of
    the one tensor changed since."""
    import torch
    from peft import LoraConfig, get_peft_model

    from rewardplane.protocol import RewardModelTrainingMode as Mode
    from rewardplane.protocol.naming import select_head
    from rewardplane.sdk.lora import merge_sync_reinit

    family, t, _ = family_trainer
    before = fill_prefix_cache(t.url)
    torch.manual_seed(6)
    with torch.no_grad():
        head = t.model.score.weight
        head.copy_(torch.randn_like(head) * head.shape[1] ** -0.5)
    assert t.sync.push(select_head(t.model.state_dict()), version=2, training_mode=Mode.HEAD_ONLY) == 2
    check_after_push(t, 2, before, f"{family}: head-only")
    _exact(family, t, 2, "head-only")

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], modules_to_save=["score"])
    peft_model = get_peft_model(t.model, config)
    with torch.no_grad():  # as if trained: non-zero B, a changed head copy
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
            if "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.2 * p.shape[-1] ** -0.5)
    before = fill_prefix_cache(t.url)
    peft_model = merge_sync_reinit(peft_model, lambda sd: t.sync.push(sd, version=3, training_mode=Mode.LORA))
    t.model = peft_model.merge_and_unload()  # fresh adapters have B = 0: the same function
    check_after_push(t, 3, before, f"{family}: LoRA merged")
    _exact(family, t, 3, "LoRA merged")

    before = fill_prefix_cache(t.url)
    with torch.no_grad():
        o_proj = dict(t.model.named_parameters())["model.layers.0.self_attn.o_proj.weight"]
        o_proj.mul_(1.0 + 0.3 * torch.randn_like(o_proj))
    assert t.sync.push(t.model.state_dict(), version=4, delta=True) == 4
    check_after_push(t, 4, before, f"{family}: delta")
    _exact(family, t, 4, "delta")


def _exact(family: str, t: Trainer, version: int, what: str) -> None:
    got_version, got = server_checksums(t.url)
    assert got_version == version
    assert_same_parameters(got, vllm_family_checksums(t.model.state_dict(), family), f"{family}: {what}")
