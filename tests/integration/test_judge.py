"""Generative reward models (task generate): a real server with the transformers engine and a tiny
random causal LM answers OpenAI's chat completions, takes full, LoRA-merged and head (lm_head)
pushes over gloo, refuses the other task's requests, and serves a GenerativeJudge end to end."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rewardplane.protocol import ChatCompletionResponse
from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.protocol.naming import select_head
from rewardplane.sdk import (
    AsyncRewardClient,
    GenerativeJudge,
    JudgeParseError,
    RewardClient,
    RewardModelCreditAssigner,
    RewardModelScorer,
    Rollout,
    Step,
)
from rewardplane.sdk._exceptions import _error_message  # reads both error shapes
from rewardplane.sdk.push.pusher import WeightPusher
from rewardplane.testing.servers import free_port

TOKEN = "secret"
CHAT = [{"role": "user", "content": "Rate the answer 'Paris' to 'What is the capital of France?'"}]
MAX_TOKENS = 12


@pytest.fixture
def judge_server(server_factory, tiny_causal_lm_dir):
    return server_factory(tiny_causal_lm_dir, token=TOKEN, task="generate")


def chat(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, **body}, timeout=60)


def load_lm(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def greedy_answer(model: Any, model_dir: Path, messages: list[dict[str, str]], max_tokens: int) -> str:
    """What transformers itself answers greedily (the reference the server must match)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    if tok.eos_token_id in new:
        new = new[: new.index(tok.eos_token_id)]
    return str(tok.decode(new, skip_special_tokens=True))


def perturbed_lm(model_dir: Path, seed: int, only: str | None = None) -> Any:
    model = load_lm(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only is None or name.startswith(only):
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def sync_for(handle: Any) -> WeightPusher:
    return WeightPusher(
        [handle.url], group_port=free_port(), token=TOKEN, trainer_host="127.0.0.1", connect_timeout_s=30
    )


def test_chat_completion_has_openai_shape_and_greedy_answers_match_transformers(
    judge_server, tiny_causal_lm_dir
):
    resp = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=0, model="reward-model")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(body)
    parsed = ChatCompletionResponse.model_validate(body)
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    assert resp.headers["X-Rewardplane-Weights-Version"] == "0"
    (choice,) = parsed.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = parsed.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # greedy: repeatable, and what transformers answers with the same weights
    expected = greedy_answer(load_lm(tiny_causal_lm_dir), tiny_causal_lm_dir, CHAT, MAX_TOKENS)
    assert choice.message.content == expected
    assert (
        chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=0).json()["choices"][0]["message"][
            "content"
        ]
        == expected
    )
    # greedy with n: n equal answers (as in vLLM)
    many = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=0, n=3).json()["choices"]
    assert [c["index"] for c in many] == [0, 1, 2] and {c["message"]["content"] for c in many} == {expected}


def test_sampling_follows_the_seed_and_stop_strings_cut_the_answer(judge_server):
    def answers(**kw: Any) -> list[str]:
        body = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=1.0, n=2, **kw).json()
        return [c["message"]["content"] for c in body["choices"]]

    assert answers(seed=7) == answers(seed=7)
    assert answers(seed=7) != answers(seed=8)
    full = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=0).json()["choices"][0]
    stop = full["message"]["content"][3:5]
    cut = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]).json()["choices"][0]
    assert cut["message"]["content"] == full["message"]["content"][: full["message"]["content"].index(stop)]
    assert cut["finish_reason"] == "stop"


def test_wrong_task_requests_get_a_clear_400(judge_server, server_factory, tiny_model_dir):
    for path, body in [
        ("/score", {"input": ["x"]}),
        ("/classify", {"input": "x"}),
        ("/v1/embeddings", {"input": "x"}),
        ("/get_reward", {"query": ["x"]}),
    ]:
        resp = httpx.post(judge_server.url + path, json=body, timeout=30)
        assert resp.status_code == 400, (path, resp.text)
        assert "/v1/chat/completions" in _error_message(resp)[0]
    info = httpx.get(f"{judge_server.url}/model_info").json()
    assert info["task"] == "generate"
    # tokenizing works on either task
    assert httpx.post(f"{judge_server.url}/tokenize", json={"prompt": "hi"}).json()["count"] > 0

    scorer = server_factory(tiny_model_dir)
    resp = chat(scorer.url, max_tokens=4)
    assert resp.status_code == 400
    assert "--task generate" in resp.json()["error"]["message"]  # OpenAI's error shape under /v1
    assert httpx.get(f"{scorer.url}/model_info").json()["task"] == "score"


def test_bad_chat_requests_are_refused_with_what_to_change(judge_server):
    assert "stream" in chat(judge_server.url, stream=True).json()["error"]["message"]
    too_long = chat(judge_server.url, max_tokens=100_000)
    assert too_long.status_code == 400 and "lower max_tokens" in too_long.json()["error"]["message"]
    assert chat(judge_server.url, temperature=-1).status_code == 422
    resp = httpx.post(f"{judge_server.url}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert resp.status_code == 422


def test_fixed_length_answers_with_ignore_eos_and_min_tokens(judge_server):
    """vLLM's extra sampling fields: ignore_eos answers max_tokens tokens every time (benchmarks and
    length controls send it), min_tokens above max_tokens is refused with what to change."""
    body = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=1.0, n=4, seed=3, ignore_eos=True).json()
    assert body["usage"]["completion_tokens"] == 4 * MAX_TOKENS
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    body = chat(judge_server.url, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0).json()
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    bad = chat(judge_server.url, max_tokens=4, min_tokens=5)
    assert bad.status_code == 422 and "lower min_tokens" in bad.text


def test_a_judge_sleeps_and_wakes_to_the_same_answers(judge_server):
    """The generative engine sleeps as the scoring one does (it once lacked sleep and wake: /sleep
    answered 500), and a level-2 wake reloads its base checkpoint."""
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def greedy() -> str:
        resp = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=0)
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["message"]["content"])

    before = greedy()
    for level in (1, 2):
        asleep = httpx.post(f"{judge_server.url}/sleep", json={"level": level}, headers=auth, timeout=60)
        assert asleep.status_code == 200, asleep.text
        assert asleep.json()["state"] == "sleeping" and asleep.json()["level"] == level
        refused = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=0)
        assert refused.status_code == 503 and "/wake" in _error_message(refused)[0]
        woke = httpx.post(f"{judge_server.url}/wake", headers=auth, timeout=60)
        assert woke.status_code == 200 and woke.json()["weights"] == "serving", woke.text
        assert greedy() == before


def test_pushes_change_the_answers_to_the_trainers(judge_server, tiny_causal_lm_dir):
    before = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=0).json()["choices"][0]["message"]
    sync = sync_for(judge_server)
    try:
        model = perturbed_lm(tiny_causal_lm_dir, seed=1)
        assert sync.push(model.state_dict(), version=1, training_mode=Mode.FULL) == 1
        resp = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=0)
        assert resp.json()["version"] == 1
        after = resp.json()["choices"][0]["message"]
        assert after["content"] == greedy_answer(model, tiny_causal_lm_dir, CHAT, MAX_TOKENS)
        assert after != before
        # head_only on a causal LM pushes its output projection, lm_head
        head = perturbed_lm(tiny_causal_lm_dir, seed=2, only="lm_head.")
        model.lm_head.weight.data.copy_(head.lm_head.weight)
        sync.push(select_head(model.state_dict()), version=2, training_mode=Mode.HEAD_ONLY)
        got = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=0).json()
        assert got["version"] == 2
        assert got["choices"][0]["message"]["content"] == greedy_answer(
            model, tiny_causal_lm_dir, CHAT, MAX_TOKENS
        )
    finally:
        sync.close()


def test_lora_merged_push_on_a_causal_lm(judge_server, tiny_causal_lm_dir):
    from peft import LoraConfig, get_peft_model

    from rewardplane.sdk.lora import merge_sync_reinit

    peft_model = get_peft_model(
        load_lm(tiny_causal_lm_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # stand-in for training: non-zero adapters
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    expected = greedy_answer(peft_model, tiny_causal_lm_dir, CHAT, MAX_TOKENS)
    sync = sync_for(judge_server)
    try:
        merge_sync_reinit(peft_model, lambda sd: sync.push(sd, version=1, training_mode=Mode.LORA))
        got = chat(judge_server.url, max_tokens=MAX_TOKENS, temperature=0).json()["choices"][0]
        assert got["message"]["content"] == expected
    finally:
        sync.close()


def rollouts(n: int) -> list[Rollout]:
    return [
        Rollout(id=f"r{i}", steps=[Step(0, f"Question {i}: what is {i} + {i}?", f"It is {2 * i}.")])
        for i in range(n)
    ]


def test_judge_scores_rollouts_and_counts_unreadable_answers(judge_server, caplog):
    template = "Question: {prompt}\nAnswer: {response}\nRate the answer from 1 to 10."

    async def main() -> None:
        async with AsyncRewardClient(judge_server.url) as client:
            # what the judge will see, asked directly: the chats it renders, answered greedily
            probe = GenerativeJudge(client, template, max_tokens=MAX_TOKENS)
            rs = rollouts(6)
            answers = [
                (await client.chat(probe.messages(r), max_tokens=MAX_TOKENS, temperature=0))
                .choices[0]
                .message.content
                for r in rs
            ]

            # a parser that reads the first three answers only: a known set of failures
            readable = set(answers[:3])

            def parser(text: str) -> float | None:
                return float(len(text)) if text in readable else None

            unreadable = [r.id for r, a in zip(rs, answers, strict=True) if a not in readable]
            assert unreadable, answers  # the random model answers each question differently
            judge = GenerativeJudge(
                client, template, parser, max_tokens=MAX_TOKENS, max_concurrency=2, batch_size=4
            )
            with pytest.raises(JudgeParseError) as err:
                await judge.score(rs)
            assert all(f"rollout {i!r}" in str(err.value) for i in unreadable)
            assert all("rm_score" not in r.meta for r in rs)  # nothing written
            assert judge.stats.failures == len(unreadable) and judge.stats.answers == len(rs)

            lenient = GenerativeJudge(
                client, template, parser, default=-1.0, max_tokens=MAX_TOKENS, batch_size=4
            )
            with caplog.at_level(logging.WARNING, logger="rewardplane.sdk.judge"):
                await lenient.score(rs)
            assert [r.meta["rm_score"] for r in rs] == [
                float(len(a)) if a in readable else -1.0 for a in answers
            ]
            st = lenient.stats
            assert (st.answers, st.failures, st.defaulted) == (6, len(unreadable), len(unreadable))
            assert st.parsed == 6 - len(unreadable) and st.versions == {0}
            assert "could not be read as scores" in caplog.text
            assert len(st.examples) == min(len(unreadable), 5)
            # the credit assigner reads the judge's scores like a reward model's
            weights = RewardModelCreditAssigner().compute(rs)  # bonus: env 0 + the judge's score
            assert [weights[(r.id, 0)] for r in rs] == [r.meta["rm_score"] for r in rs]

            # the judge stands in for a scoring client (RewardModelScorer, RewardLoop)
            scorer = RewardModelScorer(lenient, score_key="judge")
            step_rollouts = rollouts(2)
            await scorer.score(step_rollouts)
            assert all(isinstance(r.meta["judge"], float) for r in step_rollouts)

            # a step-level judge writes one score per step
            steps = GenerativeJudge(
                client, "{prompt} -> {response}", parser, default=0.0, score_level="step", max_tokens=4
            )
            await steps.score(step_rollouts)
            assert all("rm_score" in s.info for r in step_rollouts for s in r.steps)

    asyncio.run(main())


def test_the_blocking_client_chats_too(judge_server):
    with RewardClient(judge_server.url) as client:
        reply = client.chat(CHAT, max_tokens=4, temperature=0, n=2)
    assert len(reply.choices) == 2 and reply.usage.completion_tokens <= 8
