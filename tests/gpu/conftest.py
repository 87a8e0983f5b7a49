"""GPU tests: skipped (not errors) without a CUDA GPU; vLLM tests skipped without vllm.

Models are random-weight ``LlamaForSequenceClassification`` checkpoints (other families:
``build_seqcls``) built here (bf16 on disk, tokenizer trained with
``rewardplane.tinymodel.train_tokenizer``): no downloads.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rewardplane.testing.servers import ServerHandle
from tests.gpu.vllm_support import Trainer, running_replicas, trainer_views

GPU_DIR = Path(__file__).resolve().parent


def cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs the vllm package (skipped where it is not importable)")
    config.addinivalue_line("markers", "gpus(n): needs at least n CUDA GPUs")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Collection hooks see every collected item: touch only this folder's tests.
    ngpu = cuda_device_count()
    has_vllm = vllm_available()
    for item in items:
        if GPU_DIR not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if ngpu == 0:
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU (torch.cuda.is_available() is False)"))
            continue
        if item.get_closest_marker("vllm") is not None and not has_vllm:
            item.add_marker(
                pytest.mark.skip(reason="vllm is not importable: pip install 'rewardplane[vllm]'")
            )
            continue
        need = item.get_closest_marker("gpus")
        if need is not None and ngpu < int(need.args[0]):
            item.add_marker(pytest.mark.skip(reason=f"needs {need.args[0]} CUDA GPUs, found {ngpu}"))


@dataclass(frozen=True)
class LlamaSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 32000
    max_positions: int = 2048


# ~0.39B parameters (the README's measured model) and a tiny one for correctness checks.
# Head dims are 64 (FlashAttention 3 needs multiples of 8).
SIZES: dict[str, LlamaSize] = {
    "tiny": LlamaSize(
        hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=512, max_positions=1024
    ),
    "0.4b": LlamaSize(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864),
    "1.4b": LlamaSize(hidden=2048, layers=24, heads=16, kv_heads=8, intermediate=6656),
}


def build_seqcls(
    out_dir: Path, size: LlamaSize, *, family: str = "llama", num_labels: int = 1, seed: int = 0
) -> Path:
    """Save a random-weight bf16 ``<Family>ForSequenceClassification`` of ``size`` (``family``: a key
    of ``rewardplane.tinymodel.FAMILIES``) plus a trained tokenizer.

    Scores of order 1 that differ between texts: the final norm's output has norm ~sqrt(hidden),
    so a head with std 1/sqrt(hidden) gives unit-scale scores."""
    from rewardplane.tinymodel import build_tiny_reward_model

    return build_tiny_reward_model(
        out_dir,
        family=family,
        num_labels=num_labels,
        hidden_size=size.hidden,
        num_layers=size.layers,
        num_heads=size.heads,
        num_kv_heads=size.kv_heads,
        intermediate_size=size.intermediate,
        vocab_size=size.vocab,
        max_position_embeddings=size.max_positions,
        head_std=size.hidden**-0.5,
        dtype="bfloat16",
        seed=seed,
    )


def build_llama_seqcls(out_dir: Path, size: LlamaSize, *, num_labels: int = 1, seed: int = 0) -> Path:
    """``build_seqcls`` of the Llama family."""
    return build_seqcls(out_dir, size, num_labels=num_labels, seed=seed)


@pytest.fixture(scope="session")
def tiny_seqcls_1label(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_seqcls(tmp_path_factory.mktemp("vllm-tiny-1"), SIZES["tiny"], num_labels=1, seed=0)


@pytest.fixture(scope="session")
def tiny_seqcls_3labels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_seqcls(tmp_path_factory.mktemp("vllm-tiny-3"), SIZES["tiny"], num_labels=3, seed=1)


@pytest.fixture(scope="session")
def seqcls_0_4b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_seqcls(tmp_path_factory.mktemp("vllm-0.4b"), SIZES["0.4b"], num_labels=1, seed=2)


# Multi-replica modules declare where their servers and trainer run: ``PLACEMENTS`` (one
# ``start_vllm_server`` options dict per replica) and ``TRAINER_GPU``.
@pytest.fixture(scope="module")
def replicas(
    request: pytest.FixtureRequest, tiny_seqcls_1label: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerHandle]]:
    log_dir = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    with running_replicas(tiny_seqcls_1label, log_dir, request.module.PLACEMENTS) as handles:
        yield handles


@pytest.fixture(scope="module")
def trainers(
    request: pytest.FixtureRequest, replicas: list[ServerHandle], tiny_seqcls_1label: Path
) -> Iterator[list[Trainer]]:
    import torch

    with trainer_views(
        replicas, tiny_seqcls_1label, torch.device("cuda", request.module.TRAINER_GPU)
    ) as views:
        yield views
