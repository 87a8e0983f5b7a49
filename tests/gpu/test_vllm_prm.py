"""A process reward model on vLLM, on one GPU: step scores equal transformers', vLLM's own request
shape, incremental scoring over the prefix cache, and a push into the PRM.

The PRM is the project's tiny random one of the Qwen2.5-Math-PRM shape (``Qwen2ForProcessRewardModel``,
bf16 on disk, step tag ``<extra_0>``). Two servers start one after the other on GPU 0: ``--prm-pooling
step`` (vLLM's STEP pooler selects the tag rows) and ``--prm-pooling token`` (every token's row comes
back, the server selects; prefix caching stays on). The reference is the same checkpoint in
transformers, fp32, on the same token ids the server scored.

The push needs a trainer beside the server: over NCCL on a second GPU, or on the same GPU through the
same-host transport (``rewardplane.transport.same_host``); with neither it is skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rewardplane.testing.servers import ServerHandle
from tests.gpu.vllm_support import (
    MAX_ABS,
    TINY_LLAMA,
    assert_close,
    device_count,
    direct_sync,
    post,
    record_result,
    start_vllm_server,
    stop,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

TAG = "<extra_0>"
QUESTION = "Question: a shop sells pens at 3 dollars each. How much do 4 pens cost?\n"
SOLUTIONS = [
    [
        "Each pen costs 3 dollars.",
        "Four pens cost 4 times 3 dollars.",
        "4 times 3 is 12.",
        "The answer is 12.",
    ],
    ["Each pen costs 3 dollars.", "Four pens cost 4 plus 3 dollars.", "That is 7.", "The answer is 7."],
    ["Let me think step by step.", "The price of one pen is 3.", "So the answer is 12 dollars."],
    ["The capital of France is Paris."],
    [f"Step {i}: add one more pen and {i * 3} dollars are spent so far." for i in range(1, 17)],
]
SERVER_FLAGS = {"model_kind": "process", "step_tag": TAG, "step_aggregation": "min"}


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rewardplane.tinymodel import build_tiny_process_reward_model

    # a vocabulary a little over the tokenizer's
    return build_tiny_process_reward_model(
        tmp_path_factory.mktemp("vllm-prm"), **TINY_LLAMA, intermediate_size=512, vocab_size=1024, seed=5
    )


@pytest.fixture(scope="module")
def prm_servers(prm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerHandle]]:
    log_dir = tmp_path_factory.mktemp("vllm-prm-logs")
    handles: dict[str, ServerHandle] = {}
    try:
        # one after the other: two vLLM starts at once on one GPU disturb its memory profiling
        for mode in ("step", "token"):
            handles[mode] = wait_ready(
                start_vllm_server(prm_dir, log_dir, gpu=0, prm_pooling=mode, **SERVER_FLAGS)
            )
        yield handles
    finally:
        for h in handles.values():
            stop(h)


@pytest.fixture(scope="module")
def reference(prm_dir: Path) -> Any:
    """The checkpoint in transformers, fp32 on the last GPU: raw rows at given tags of given ids."""
    import torch

    from rewardplane.server.engines.prm_model import Qwen2ForProcessRewardModel

    device = torch.device("cuda", device_count() - 1)
    model = Qwen2ForProcessRewardModel.from_pretrained(prm_dir, dtype=torch.float32).to(device).eval()

    def rows(ids: list[int], tags: list[int]) -> list[list[float]]:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()
        return logits[tags].tolist()

    return rows


def scored(url: str, **body: Any) -> dict[str, Any]:
    return post(url, "/score", {"normalize": False, **body})


def token_ids(prm_dir: Path, steps: list[str], prompt: str = QUESTION) -> tuple[list[int], list[int]]:
    """The ids and tag positions the server scores (its own step-insertion code)."""
    from transformers import AutoTokenizer

    from rewardplane.server.http.steps import build_solution, step_spans

    tok = AutoTokenizer.from_pretrained(prm_dir)
    tag_id = tok.convert_tokens_to_ids(TAG)
    sol = build_solution(tok, prompt, steps, step_spans(steps, "\n\n"), tag_id=tag_id, tag=TAG, index=0)
    return sol.ids, sol.tags


def log_odds_rows(rows: list[list[float]]) -> list[list[float]]:
    from rewardplane.protocol.steps import good_log_odds

    return [[good_log_odds(r, 1)] for r in rows]


@pytest.mark.parametrize("mode", ["step", "token"])
def test_step_scores_equal_transformers(
    prm_servers: dict[str, ServerHandle], prm_dir: Path, reference: Any, mode: str
) -> None:
    body = scored(prm_servers[mode].url, steps=SOLUTIONS, prompts=[QUESTION] * len(SOLUTIONS))
    got: list[list[float]] = []
    ref: list[list[float]] = []
    for steps, item in zip(SOLUTIONS, sorted(body["data"], key=lambda d: d["index"]), strict=True):
        assert [s["index"] for s in item["steps"]] == list(range(len(steps)))
        ids, tags = token_ids(prm_dir, steps)
        assert [s["tokens"][1] - 1 for s in item["steps"]] == tags
        got += [[s["score"]] for s in item["steps"]]
        ref += log_odds_rows(reference(ids, tags))
        assert item["score"] == pytest.approx(min(s["score"] for s in item["steps"]), abs=1e-9)
    assert_close(got, ref, f"vLLM --prm-pooling {mode} step log-odds vs transformers fp32")
    gap = max(abs(a[0] - b[0]) for a, b in zip(got, ref, strict=True))
    record_result("vllm_prm.json", f"step_gap_{mode}", gap)


def test_step_and_token_pooling_agree(prm_servers: dict[str, ServerHandle]) -> None:
    a = scored(prm_servers["step"].url, steps=SOLUTIONS)
    b = scored(prm_servers["token"].url, steps=SOLUTIONS)
    sa = [[s["score"]] for d in a["data"] for s in d["steps"]]
    sb = [[s["score"]] for d in b["data"] for s in d["steps"]]
    assert_close(sa, sb, "STEP pooling vs token pooling with the selection on the server")


def test_vllm_pooling_shape_gives_the_tag_rows(prm_servers: dict[str, ServerHandle]) -> None:
    """vLLM's own request: the text carries its tags, each input's data is one row per tag."""
    from rewardplane.protocol.steps import good_log_odds

    text = QUESTION + "".join(s + TAG for s in SOLUTIONS[0])
    for url in (h.url for h in prm_servers.values()):
        body = post(url, "/pooling", {"input": [text]})
        rows = body["data"][0]["data"]
        assert len(rows) == len(SOLUTIONS[0]) and all(len(r) == 2 for r in rows)
        ours = scored(url, steps=[SOLUTIONS[0]], prompts=[QUESTION])["data"][0]["steps"]
        assert [good_log_odds(r, 1) for r in rows] == pytest.approx([s["score"] for s in ours], abs=MAX_ABS)


def test_incremental_scoring_reuses_the_prefix(prm_servers: dict[str, ServerHandle]) -> None:
    """Token pooling keeps prefix caching on: scoring step k+1 after steps 1..k (``first_step``) gives
    the score the whole solution gives it, and costs less than rescoring the whole solution."""
    url = prm_servers["token"].url
    steps = SOLUTIONS[-1]
    full = scored(url, steps=[steps], prompts=[QUESTION])["data"][0]["steps"]
    incremental, rescored = [], []
    for k in range(1, len(steps)):
        scored(url, steps=[steps[:k]], prompts=[QUESTION])  # steps 1..k: now in the prefix cache
        t0 = time.perf_counter()
        one = scored(url, steps=[steps[: k + 1]], prompts=[QUESTION], first_step=k)["data"][0]["steps"]
        incremental.append(time.perf_counter() - t0)
        assert [s["index"] for s in one] == [k]
        assert one[0]["score"] == pytest.approx(full[k]["score"], abs=MAX_ABS)
        t0 = time.perf_counter()
        scored(url, steps=[steps[: k + 1]], prompts=[QUESTION])
        rescored.append(time.perf_counter() - t0)
    ratio = sum(incremental) / sum(rescored)
    print(f"incremental / full rescoring: {ratio:.3f} ({len(incremental)} steps, tiny PRM)")
    record_result("vllm_prm.json", "incremental_over_full_tiny", ratio)


def _push_possible() -> str | None:
    if device_count() >= 2:
        return None
    if importlib.util.find_spec("rewardplane.transport.same_host") is not None:
        return None
    return (
        "a push into the PRM needs the trainer beside the server: a second GPU (NCCL), or on this one GPU "
        "the same-host transport (rewardplane.transport.same_host), which this tree does not have"
    )


def _pusher(url: str, device: Any) -> Any:
    """The trainer's pusher; where the SDK picks a transport (``backend``), ``auto``: CUDA IPC when
    the trainer shares the server's GPU, NCCL from another one."""
    import inspect

    from rewardplane.sdk.push.pusher import WeightPusher

    if "backend" not in inspect.signature(WeightPusher).parameters:
        return direct_sync([url], device)
    return direct_sync([url], device, backend="auto")


def test_full_push_into_prm_follows_the_trainer(
    prm_servers: dict[str, ServerHandle], prm_dir: Path, reference: Any
) -> None:
    reason = _push_possible()
    if reason is not None:
        pytest.skip(reason)
    import torch

    from rewardplane.protocol import RewardModelTrainingMode as Mode
    from rewardplane.server.engines.prm_model import Qwen2ForProcessRewardModel

    device = torch.device("cuda", device_count() - 1)
    url = prm_servers["step"].url
    model = Qwen2ForProcessRewardModel.from_pretrained(prm_dir, dtype=torch.bfloat16).to(device)
    model.score.to(torch.float32)  # as a trainer holds it: fp32 head
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    sync = _pusher(url, device)
    try:
        assert sync.push(model.state_dict(), version=1, training_mode=Mode.FULL) == 1
    finally:
        sync.close()
    body = scored(url, steps=SOLUTIONS[:3], prompts=[QUESTION] * 3)
    assert body["version"] == 1
    got = [[s["score"]] for d in body["data"] for s in d["steps"]]
    ref_model = model.to(torch.float32).eval()
    ref = []
    for steps in SOLUTIONS[:3]:
        ids, tags = token_ids(prm_dir, steps)
        with torch.inference_mode():
            logits = ref_model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()
        ref += log_odds_rows(logits[tags].tolist())
    assert_close(got, ref, "PRM step scores after a full push vs the trainer's model")
