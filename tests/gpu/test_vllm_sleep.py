"""Sleep and wake on the vLLM engine (``--enable-sleep-mode``), one GPU.

Level 1 offloads the weights to host memory, level 2 discards them and the wake reloads the base
checkpoint. Both free most of the server's GPU memory — seen from outside the server, by this
process's ``torch.cuda.mem_get_info`` — and after the wake every live parameter is bit for bit the
one served before (``/param_checksums``) and the scores match. While asleep, scoring answers 503
naming ``/wake`` and a push is refused with 409 before anything moves. The last test does the
same for the transformers engine on CUDA.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rewardplane.testing.gpus import visible_gpus
from tests.gpu.vllm_support import (
    TEXTS,
    TOKEN,
    served,
    server_checksums,
    start_vllm_server,
    stop,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.gpus(1)]

AUTH = {"Authorization": f"Bearer {TOKEN}"}
GPU_MEMORY_UTILIZATION = 0.3
SAME_SCORE = 1e-3  # same weights, same kernels: far inside bf16 noise (0.05)


def _free_bytes() -> int:
    import torch

    torch.cuda.synchronize(0)
    return int(torch.cuda.mem_get_info(0)[0])


def _control(url: str, path: str, body: dict | None = None) -> dict:
    r = httpx.post(url + path, json=body, headers=AUTH, timeout=600)
    assert r.status_code == 200, f"{path} answered {r.status_code}: {r.text[:2000]}"
    return r.json()


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_sleep_levels_free_gpu_memory_and_wake_to_the_same_weights(
    tiny_seqcls_1label: Path, tmp_path: Path
) -> None:
    import torch

    # The server runs on the first GPU this process sees, which is this process's cuda:0.
    total = int(torch.cuda.mem_get_info(0)[1])
    server = wait_ready(
        start_vllm_server(
            tiny_seqcls_1label,
            tmp_path,
            gpu=0,
            gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
            enable_sleep_mode=True,
        )
    )
    try:
        url = server.url
        before, version = served(url)
        checksums = server_checksums(url)
        manifest = httpx.get(f"{url}/param_manifest", headers=AUTH, timeout=30).json()
        head = next(m for m in manifest if m["name"] == "score.weight")
        for level in (1, 2):
            awake_free = _free_bytes()
            asleep = _control(url, "/sleep", {"level": level})
            assert (asleep["state"], asleep["level"], asleep["changed"]) == ("sleeping", level, True)
            freed = _free_bytes() - awake_free
            # vLLM held ~0.3 of the GPU (weights + KV cache); most of it comes back while asleep.
            assert freed > 0.5 * GPU_MEMORY_UTILIZATION * total, (
                f"level {level}: only {freed / 2**30:.2f} GiB freed of {total / 2**30:.0f} GiB"
            )
            assert asleep["device_bytes_freed"] is not None and asleep["device_bytes_freed"] > 0
            assert _control(url, "/sleep", {"level": level})["changed"] is False  # idempotent

            health = httpx.get(f"{url}/health", timeout=10).json()
            assert (health["state"], health["sleep_level"]) == ("sleeping", level)
            refused = httpx.post(f"{url}/score", json={"input": TEXTS, "normalize": False}, timeout=60)
            assert refused.status_code == 503 and "/wake" in refused.json()["error"]
            pushed = httpx.post(
                f"{url}/update_param_batch",
                json={"metadata": [head], "training_mode": "head_only"},
                headers=AUTH,
                timeout=60,
            )
            assert pushed.status_code == 409 and "asleep" in pushed.json()["error"]

            woke = _control(url, "/wake")
            assert (woke["state"], woke["weights"], woke["version"]) == ("awake", "serving", version), woke
            assert _free_bytes() < awake_free + 0.1 * GPU_MEMORY_UTILIZATION * total  # memory taken back
            # every live parameter as before (level 2: reloaded from the checkpoint by vLLM's loader)
            assert server_checksums(url) == checksums, f"level {level}: the weights changed"
            after, after_version = served(url)
            assert after_version == version
            assert _max_diff(after, before) <= SAME_SCORE, f"level {level}: {_max_diff(after, before)}"
    finally:
        stop(server)


def test_sleep_without_sleep_mode_says_how_to_enable_it(tiny_seqcls_1label: Path, tmp_path: Path) -> None:
    server = wait_ready(
        start_vllm_server(tiny_seqcls_1label, tmp_path, gpu=0, gpu_memory_utilization=GPU_MEMORY_UTILIZATION)
    )
    try:
        r = httpx.post(f"{server.url}/sleep", json={"level": 1}, headers=AUTH, timeout=60)
        assert r.status_code == 409 and "--enable-sleep-mode" in r.json()["error"]
        assert served(server.url)[1] == 0  # still serving
    finally:
        stop(server)


@pytest.mark.timeout(900)
def test_transformers_engine_on_cuda_frees_its_parameters_and_wakes_to_the_same_scores(
    seqcls_0_4b: Path, tmp_path: Path
) -> None:
    """The transformers engine (no vLLM needed): a 0.4B model's parameters leave the GPU and come
    back; large tensors, so the driver sees their memory returned (a tiny model's share segments)."""
    from rewardplane.testing.servers import start_server

    server = start_server(
        seqcls_0_4b,
        tmp_path,
        token=TOKEN,
        device="cuda",
        env_extra={"CUDA_VISIBLE_DEVICES": visible_gpus(0)},
        startup_timeout_s=300,
    )
    try:
        before, _ = served(server.url)
        for level in (1, 2):
            awake_free = _free_bytes()
            asleep = _control(server.url, "/sleep", {"level": level})
            # every parameter left the GPU (the engine counts them; the driver sees the cache emptied)
            assert asleep["device_bytes_freed"] > 0.5 * 2**30  # ~0.39B bf16 parameters: 0.72 GiB
            assert _free_bytes() - awake_free >= 0.5 * asleep["device_bytes_freed"]
            assert _control(server.url, "/wake")["weights"] == "serving"
            assert served(server.url)[0] == before, f"level {level}: scores changed"
    finally:
        server.stop()
