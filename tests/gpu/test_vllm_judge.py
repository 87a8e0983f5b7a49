"""vLLM engine in generate mode (``--task generate``, an LLM judge) with a tiny random causal LM:
OpenAI's chat completions, a full NCCL push from a trainer on a second GPU (every live parameter
bit for bit, and the same answers as a server loaded from disk with the trainer's weights: a stale
prefix cache would show), wrong-task requests refused, and GenerativeJudge end to end.

    bash scripts/gpu-run.sh tests tests/gpu/test_vllm_judge.py     # 1 GPU; the push tests need 2
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rewardplane.testing.servers import ServerHandle
from tests.gpu.vllm_support import (
    TINY_LLAMA,
    assert_same_parameters,
    direct_sync,
    post,
    server_checksums,
    start_vllm_server,
    stop,
    vllm_llama_checksums,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

CHATS = [
    [
        {
            "role": "user",
            "content": "Rate the answer 'Paris' to 'What is the capital of France?' from 1 to 10.",
        }
    ],
    [{"role": "user", "content": "Is 2 + 2 = 5 correct? Answer with a score."}],
    [
        {"role": "system", "content": "You are a strict judge."},
        {"role": "user", "content": "Score this poem: 'The sea at night is dark and wide.'"},
    ],
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random bf16 LlamaForCausalLM with a chat template (head dim 64, vocab 512: no padding)."""
    from rewardplane.tinymodel import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-lm"), **TINY_LLAMA, seed=0)


def test_engine_args_in_generate_mode(tiny_lm: Path) -> None:
    from rewardplane.protocol import ModelTask
    from rewardplane.server.config import ServerConfig
    from rewardplane.server.engines.vllm_engine import build_engine_args

    args = build_engine_args(ServerConfig(model=str(tiny_lm), engine="vllm", task=ModelTask.GENERATE), 1024)
    assert args.runner == "generate" and args.pooler_config is None
    assert "head_dtype" not in (args.hf_overrides or {})  # type: ignore[operator]
    assert args.worker_extension_cls.endswith("RewardWeightSyncExtension")


@pytest.fixture(scope="module")
def judge_server(tiny_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    handle = start_vllm_server(tiny_lm, tmp_path_factory.mktemp("vllm-judge-logs"), gpu=0, task="generate")
    try:
        yield wait_ready(handle)
    finally:
        stop(handle)


def answers(url: str, **sampling: Any) -> list[str]:
    """The first choice's text for each of CHATS (greedy unless asked otherwise)."""
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, **sampling}
    return [
        post(url, "/v1/chat/completions", {"messages": c, **sampling})["choices"][0]["message"]["content"]
        for c in CHATS
    ]


def test_chat_completion_has_openai_shape_and_greedy_is_repeatable(judge_server: ServerHandle) -> None:
    body = post(
        judge_server.url,
        "/v1/chat/completions",
        {"messages": CHATS[0], "max_tokens": MAX_TOKENS, "temperature": 0},
    )
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(body)
    assert body["object"] == "chat.completion" and body["version"] == 0
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert 0 < usage["completion_tokens"] <= MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert answers(judge_server.url) == answers(judge_server.url)
    # greedy with n: n equal answers; sampling with a seed: n answers, the same for the same seed
    many = post(
        judge_server.url,
        "/v1/chat/completions",
        {"messages": CHATS[0], "max_tokens": 8, "temperature": 0, "n": 3},
    )
    assert len({c["message"]["content"] for c in many["choices"]}) == 1 and len(many["choices"]) == 3
    sampled = [
        post(
            judge_server.url,
            "/v1/chat/completions",
            {"messages": CHATS[0], "max_tokens": 8, "temperature": 1.0, "n": 2, "seed": 3},
        )
        for _ in range(2)
    ]
    assert [c["message"]["content"] for c in sampled[0]["choices"]] == [
        c["message"]["content"] for c in sampled[1]["choices"]
    ]
    info = httpx.get(f"{judge_server.url}/model_info", timeout=30).json()
    assert (info["engine"], info["task"]) == ("vllm", "generate")


def test_scoring_requests_are_refused(judge_server: ServerHandle) -> None:
    r = httpx.post(f"{judge_server.url}/score", json={"input": ["x"]}, timeout=30)
    assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]


def test_judge_scores_rollouts(judge_server: ServerHandle) -> None:
    from rewardplane.sdk import AsyncRewardClient, GenerativeJudge, Rollout, Step

    rollouts = [Rollout(id=f"r{i}", steps=[Step(0, f"What is {i} + {i}?", f"{2 * i}")]) for i in range(8)]

    async def main() -> tuple[GenerativeJudge, GenerativeJudge]:
        async with AsyncRewardClient(judge_server.url, request_timeout_s=120) as client:
            # the default parser on a random model's answers: mostly unreadable, written as 0.0, counted
            lenient = GenerativeJudge(
                client, "Q: {prompt}\nA: {response}\nScore 1-10:", default=0.0, max_tokens=8
            )
            await lenient.score(rollouts)
            counted = GenerativeJudge(
                client, "Q: {prompt}\nA: {response}", lambda t: float(len(t)), max_tokens=8, score_key="n"
            )
            await counted.score(rollouts)
            return lenient, counted

    lenient, counted = asyncio.run(main())
    assert lenient.stats.answers == 8 and lenient.stats.parsed + lenient.stats.defaulted == 8
    assert all(isinstance(r.meta["rm_score"], float) for r in rollouts)
    assert counted.stats.failures == 0 and all(r.meta["n"] >= 0 for r in rollouts)


@pytest.mark.gpus(2)
def test_full_push_from_a_trainer_matches_a_server_loaded_with_its_weights(
    judge_server: ServerHandle, tiny_lm: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rewardplane.protocol import RewardModelTrainingMode as Mode

    device = torch.device("cuda", 1)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm, dtype=torch.bfloat16).to(device)
    before = answers(judge_server.url)  # also fills the prefix cache with the old weights' blocks
    torch.manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    sync = direct_sync([judge_server.url], device)
    try:
        assert sync.push(model.state_dict(), version=1, training_mode=Mode.FULL) == 1
    finally:
        sync.close()
    version, got = server_checksums(judge_server.url)
    want = vllm_llama_checksums(model.state_dict())
    assert version == 1
    assert tuple(got[0]["lm_head.weight"]) == tuple(want[0]["lm_head.weight"]), (
        "lm_head differs after the push"
    )
    assert_same_parameters(
        got,
        {r: {n: v for n, v in w.items() if not n.startswith("lm_head.")} for r, w in want.items()},
        "full",
    )
    pushed = answers(judge_server.url)
    assert pushed != before

    # a server started from the trainer's weights on disk answers the same (greedy, same engine):
    # a prefix cache left from the old weights would make the pushed server differ
    disk = tmp_path / "pushed"
    model.save_pretrained(disk)
    del model
    torch.cuda.empty_cache()  # GPU 1 hosts the second server now
    for f in tiny_lm.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, disk / f.name)
    fresh = start_vllm_server(disk, tmp_path, gpu=1, task="generate")
    try:
        wait_ready(fresh)
        assert answers(fresh.url) == pushed
    finally:
        stop(fresh)
