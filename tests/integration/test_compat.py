"""Drop-in compatibility: each framework's own client code against a real reward server, with the
scores compared to the transformers model on the same token ids.

verl and OpenRLHF are driven by their client code copied verbatim (``tests/fixtures/upstream``, the
commits named there); the ``openai`` package is used as is; TRL through its documented reward
function contract (``reward_func(prompts=..., completions=..., completion_ids=..., **columns)``).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import aiohttp
import httpx
import pytest

from rewardplane.protocol import decode_base64_floats
from rewardplane.sdk.integrations import TRLRewardFunction, openrlhf_remote_url, verl_compute_score
from rewardplane.testing.servers import ServerHandle, start_server
from rewardplane.tinymodel import build_tiny_reward_model
from tests.fixtures.upstream.openrlhf_remote_rm import OpenRLHFRemoteRM
from tests.fixtures.upstream.verl_reward_loop import OneItemBatch, VerlRewardLoopClient

TOL = 1e-4
MAX_LEN = 48
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny reward model whose tokenizer adds BOS (like Llama's) and has a chat template."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    out = build_tiny_reward_model(
        tmp_path_factory.mktemp("tiny-rm-chat"), seed=3, max_position_embeddings=MAX_LEN
    )
    tok = AutoTokenizer.from_pretrained(out)
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)]
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    assert AutoTokenizer.from_pretrained(out)("hi")["input_ids"][0] == tok.bos_token_id
    return out


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerHandle:
    # What the operator renders for a RewardModel named tiny-rm with spec.model.source = model_dir
    # and one alias: verl's defaults (model = the model path) must be accepted as they are.
    h = start_server(
        model_dir,
        tmp_path_factory.mktemp("compat-srv"),
        served_model_name="tiny-rm",
        extra_args=["--model-alias", "/trainer/ckpt/rm"],
    )
    yield h
    h.stop()


def hf_scores(model_dir: Path, texts: list[str], *, add_special_tokens: bool = True) -> list[list[float]]:
    """The transformers model's raw logits, one text at a time (no padding involved)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            model(**tok(t, return_tensors="pt", add_special_tokens=add_special_tokens)).logits[0].tolist()
            for t in texts
        ]


def hf_scores_of_ids(model_dir: Path, ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].tolist()


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, abs_tol=TOL, rel_tol=TOL)


def rendered(model_dir: Path, chat: list[dict[str, str]]) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(model_dir).apply_chat_template(chat, tokenize=False))


# ------------------------------------------------------------------ verl


def verl_rollout(model_dir: Path) -> OneItemBatch:
    """One rollout as verl's reward loop holds it: chat prompt, right-padded response ids."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    response = tok(ANSWER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    pad = 5
    prompt_len = 7
    return OneItemBatch(
        batch={
            "responses": torch.tensor(response + [tok.pad_token_id] * pad),
            "attention_mask": torch.tensor([1] * prompt_len + [1] * len(response) + [0] * pad),
        },
        non_tensor_batch={"raw_prompt": list(CHAT)},
    )


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_verl_reward_loop_client_with_default_settings(server, model_dir, engine):
    """verl's own request and parsing (``/classify`` → probs[-1]; SGLang: ``/v1/embeddings`` →
    embedding[-1]), model = the reward model's path, equal the transformers score."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    address = server.url.removeprefix("http://")
    client = VerlRewardLoopClient(address, engine, str(model_dir), tok, tok)
    data = verl_rollout(model_dir)
    result = asyncio.run(client.compute_score_disrm(data))

    prompt = asyncio.run(client._preprocess_reward_inputs(data))
    assert not prompt.startswith("<s>") and ANSWER in prompt  # verl strips BOS; the server adds it back
    (expected,) = hf_scores(model_dir, [prompt])
    assert close(result["reward_score"], expected[-1]), (result, expected)


def test_verl_with_an_unknown_model_name_fails_at_once_with_the_accepted_names(server, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    client = VerlRewardLoopClient(server.url.removeprefix("http://"), "vllm", "/other/model", tok, tok)
    with pytest.raises(aiohttp.ClientResponseError) as err:  # 4xx: verl does not retry
        asyncio.run(asyncio.wait_for(client.compute_score_disrm(verl_rollout(model_dir)), 30))
    assert err.value.status == 400
    body = httpx.post(f"{server.url}/classify", json={"model": "/other/model", "input": "x"}).json()
    assert "tiny-rm" in body["error"] and str(model_dir) in body["error"] and "alias" in body["error"]


def test_model_may_be_served_name_path_alias_or_absent(server, model_dir):
    for name in ["tiny-rm", str(model_dir), str(model_dir) + "/", "/trainer/ckpt/rm", "reward-model", None]:
        body = {"input": "hello", **({"model": name} if name is not None else {})}
        r = httpx.post(f"{server.url}/classify", json=body)
        assert r.status_code == 200, (name, r.text)
        assert r.json()["model"] == "tiny-rm"


def test_verl_custom_reward_function_entry_point(server, model_dir):
    """verl's custom_reward_function calls ``compute_score(data_source, solution_str, ground_truth,
    extra_info, **reward_kwargs)``; ours scores prompt + response (text or chat)."""
    text = asyncio.run(
        verl_compute_score(
            "gsm8k", ANSWER, "Paris", {"prompt": "Q: capital of France? A: "}, url=server.url, model="tiny-rm"
        )
    )
    (expected,) = hf_scores(model_dir, ["Q: capital of France? A: " + ANSWER])
    assert close(text["score"], expected[0])

    chat = asyncio.run(verl_compute_score("gsm8k", ANSWER, "Paris", {"prompt": CHAT}, url=server.url))
    full = rendered(model_dir, [*CHAT, {"role": "assistant", "content": ANSWER}])
    (expected_chat,) = hf_scores(model_dir, [full], add_special_tokens=False)  # the template writes BOS
    assert close(chat["score"], expected_chat[0])


# ------------------------------------------------------------------ OpenRLHF


def test_openrlhf_remote_rm_client(server, model_dir):
    """OpenRLHF decodes the whole sequence with its special tokens and posts it as ``query``; the
    server tokenizes it without adding any (as OpenRLHF's serve_rm does)."""
    query = "<s>Question: capital of France?\nAnswer: Paris.</s>"
    rm = OpenRLHFRemoteRM(openrlhf_remote_url(server.url))
    out = asyncio.run(asyncio.wait_for(rm.score(query, "Question: capital of France?", "Paris"), 60))
    (expected,) = hf_scores(model_dir, [query], add_special_tokens=False)
    assert len(out["reward"]) == 1 and close(out["reward"][0], expected[0]), out
    assert out["scores"] == out["reward"]
    assert out["extra_logs"] == {"reward_model_version": [0]}


def test_get_reward_batch_and_mismatched_labels(server, model_dir):
    queries = ["<s>one</s>", "<s>two words</s>", "<s>three little words</s>"]
    body = httpx.post(f"{server.url}/get_reward", json={"query": queries}).json()
    expected = hf_scores(model_dir, queries, add_special_tokens=False)
    assert all(close(r, e[0]) for r, e in zip(body["rewards"], expected, strict=True))
    r = httpx.post(f"{server.url}/get_reward", json={"query": queries, "labels": ["a"]})
    assert r.status_code == 400 and "labels has 1 items but query has 3" in r.json()["error"]


# ------------------------------------------------------------------ openai package


def test_openai_package_against_v1(server, model_dir):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == ["tiny-rm", "/trainer/ckpt/rm"]

    texts = ["a short answer", "a much longer and more careful answer"]
    expected = hf_scores(model_dir, texts)
    # Without encoding_format the package asks for base64 and decodes it itself.
    for emb in (
        client.embeddings.create(model=str(model_dir), input=texts),
        client.embeddings.create(model="tiny-rm", input=texts, encoding_format="float"),
    ):
        assert [close(d.embedding[-1], e[0]) for d, e in zip(emb.data, expected, strict=True)] == [True, True]
    raw = client.embeddings.create(model="tiny-rm", input=texts, encoding_format="base64")
    assert close(decode_base64_floats(str(raw.data[0].embedding))[0], expected[0][0])

    cls = client.post("/classify", body={"model": "tiny-rm", "input": texts}, cast_to=httpx.Response)
    assert close(cls.json()["data"][1]["probs"][0], expected[1][0])
    pooled = client.post(
        "/pooling", body={"model": "tiny-rm", "messages": CHAT}, cast_to=httpx.Response
    ).json()
    (expected_chat,) = hf_scores(model_dir, [rendered(model_dir, CHAT)], add_special_tokens=False)
    assert close(pooled["data"][0]["data"][0], expected_chat[0])

    # Errors under /v1/ come in OpenAI's shape, so the package shows the message, not just the code
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="gpt-4o", input="x")
    assert "not served here" in str(err.value) and err.value.code == "400", str(err.value)
    assert err.value.type == "invalid_request_error"
    with pytest.raises(openai.UnprocessableEntityError) as invalid:
        client.post("/classify", body={"model": "tiny-rm", "input": 5}, cast_to=httpx.Response)
    assert "input" in str(invalid.value) and invalid.value.param == "input", str(invalid.value)
    with pytest.raises(openai.NotFoundError) as missing:
        client.get("/no_such_route", cast_to=httpx.Response)
    assert "/v1/no_such_route" in str(missing.value)
    # outside /v1/ the project's one shape stays
    root = httpx.post(f"{server.url}/embeddings", json={"model": "gpt-4o", "input": "x"})
    assert root.status_code == 400 and "not served here" in root.json()["error"]


# ------------------------------------------------------------------ vLLM request shapes


def test_vllm_tokenize_detokenize_and_special_tokens(server, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for prefix in ("", "/v1"):
        with_bos = httpx.post(f"{server.url}{prefix}/tokenize", json={"prompt": "hello there"}).json()
        without = httpx.post(
            f"{server.url}{prefix}/tokenize",
            json={"prompt": "hello there", "add_special_tokens": False, "return_token_strs": True},
        ).json()
        assert with_bos["tokens"] == [tok.bos_token_id, *without["tokens"]]
        assert without["count"] == len(without["tokens"]) and with_bos["max_model_len"] == MAX_LEN
        assert "".join(without["token_strs"]).replace("Ġ", " ") == "hello there"
        back = httpx.post(f"{server.url}{prefix}/detokenize", json={"tokens": without["tokens"]}).json()
        assert back == {"prompt": "hello there"}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == tok(rendered(model_dir, CHAT), add_special_tokens=False)["input_ids"]
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]


def test_vllm_pooling_options(server, model_dir):
    text = "The assistant answered clearly."
    (with_bos,) = hf_scores(model_dir, [text])
    (no_bos,) = hf_scores(model_dir, [text], add_special_tokens=False)
    assert not close(with_bos[0], no_bos[0])  # the flag must matter for this test to mean anything

    def classify(path: str = "/classify", **body: object) -> httpx.Response:
        return httpx.post(f"{server.url}{path}", json={"model": "tiny-rm", **body}, timeout=30)

    assert close(classify(input=text).json()["data"][0]["probs"][0], with_bos[0])
    assert close(classify(input=text, add_special_tokens=False).json()["data"][0]["probs"][0], no_bos[0])
    sigmoid = 1 / (1 + math.exp(-with_bos[0]))
    for flag in ("use_activation", "activation", "softmax"):
        assert close(
            classify("/v1/classify", input=text, **{flag: True}).json()["data"][0]["probs"][0], sigmoid
        )

    b64 = classify("/v1/pooling", input=[text], encoding_format="base64").json()["data"][0]["data"]
    assert isinstance(b64, str) and close(decode_base64_floats(b64)[0], with_bos[0])

    # messages go through the chat template; equal to sending the rendered text without special tokens
    chat = classify("/pooling", messages=CHAT).json()["data"][0]["data"][0]
    as_text = classify("/pooling", input=rendered(model_dir, CHAT), add_special_tokens=False).json()
    assert close(chat, as_text["data"][0]["data"][0])

    # truncate_prompt_tokens: -1 keeps the last max_model_len tokens instead of a 400
    long_ids = [5 + (i % 100) for i in range(MAX_LEN + 20)]
    refused = classify(input=long_ids)
    assert refused.status_code == 400 and "truncate" in refused.json()["error"]
    cut = classify(input=long_ids, truncate_prompt_tokens=-1).json()
    assert close(cut["data"][0]["probs"][0], hf_scores_of_ids(model_dir, long_ids[-MAX_LEN:])[0])
    assert cut["usage"]["prompt_tokens"] == MAX_LEN
    assert classify(input=text, truncate_prompt_tokens=-2).status_code == 422
    assert classify(input=text, messages=CHAT).status_code == 422


def test_messages_without_a_chat_template_is_a_clear_400(tiny_model_dir, server_factory):
    h = server_factory(tiny_model_dir)
    r = httpx.post(f"{h.url}/pooling", json={"messages": CHAT})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]


# ------------------------------------------------------------------ Ludic /score, TRL


def test_ludic_score_shape(server, model_dir):
    texts = ["first answer", "second answer"]
    body = httpx.post(
        f"{server.url}/score",
        json={"model": "tiny-rm", "inputs": texts, "pooling_type": "last", "normalize": False, "n_labels": 1},
    ).json()
    expected = hf_scores(model_dir, texts)
    assert [close(s, e[0]) for s, e in zip(body["scores"], expected, strict=True)] == [True, True]
    assert body["scores"] == [d["score"] for d in body["data"]]
    assert body["metadata"]["version"] == body["version"] == 0 and body["usage"]["prompt_tokens"] > 0


def test_trl_reward_function_contract(server, model_dir):
    reward = TRLRewardFunction(endpoints=[server.url], model_name="tiny-rm")
    assert reward.__name__ == "rewardplane"
    # GRPOTrainer calls reward_func(prompts=..., completions=..., completion_ids=..., **dataset columns)
    prompts = ["Q: 2+2? A:", "Q: capital of France? A:"]
    completions = [" 4", " Paris"]
    got = reward(prompts=prompts, completions=completions, completion_ids=[[1], [2]], answer=["4", "Paris"])
    expected = hf_scores(model_dir, [p + c for p, c in zip(prompts, completions, strict=True)])
    assert all(isinstance(g, float) for g in got)
    assert [close(g, e[0]) for g, e in zip(got, expected, strict=True)] == [True, True]

    conv = reward(
        prompts=[CHAT], completions=[[{"role": "assistant", "content": ANSWER}]], completion_ids=[[1]]
    )
    full = rendered(model_dir, [*CHAT, {"role": "assistant", "content": ANSWER}])
    assert close(conv[0], hf_scores(model_dir, [full], add_special_tokens=False)[0][0])
    reward.client.close()


def test_openrlhf_with_two_reward_urls_gets_its_reward(server, model_dir):
    """OpenRLHF shards a call over its URLs: with one rollout and two URLs the second gets empty
    lists, which must be answered (200, no rewards), not refused, or OpenRLHF retries and fails."""
    query = "<s>Question: capital of France?\nAnswer: Paris.</s>"
    url = openrlhf_remote_url(server.url)
    rm = OpenRLHFRemoteRM([url, url])
    out = asyncio.run(asyncio.wait_for(rm.score(query, "Question: capital of France?", "Paris"), 30))
    (expected,) = hf_scores(model_dir, [query], add_special_tokens=False)
    assert len(out["reward"]) == 1 and close(out["reward"][0], expected[0]), out


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        ("/score", {"input": []}, "data"),
        ("/classify", {"input": []}, "data"),
        ("/pooling", {"input": []}, "data"),
        ("/v1/embeddings", {"input": []}, "data"),
        ("/get_reward", {"query": [], "prompts": [], "labels": []}, "rewards"),
    ],
)
def test_an_empty_batch_is_answered_with_no_results(server, path, body, key):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()[key] == [] and r.json()["version"] == 0


def test_get_reward_checks_the_model_name_like_every_route(server, model_dir):
    query = {"query": ["<s>one</s>"]}
    assert httpx.post(f"{server.url}/get_reward", json={**query, "model": "tiny-rm"}).status_code == 200
    assert httpx.post(f"{server.url}/get_reward", json={**query, "model": str(model_dir)}).status_code == 200
    wrong = httpx.post(f"{server.url}/get_reward", json={**query, "model": "another-rm"})
    assert wrong.status_code == 400 and "another-rm" in wrong.json()["error"]


def test_model_info_tells_clients_the_item_limit(server):
    info = httpx.get(f"{server.url}/model_info").json()
    assert info["max_items_per_request"] == 1024


def test_trl_reward_function_scores_a_grpo_step_beyond_the_server_limit(server):
    """A GRPO step of 512 prompts x 8 completions is 4,096 texts, four times the server's 1,024 per
    request: the client reads the limit from /model_info and splits, in order."""
    reward = TRLRewardFunction(endpoints=[server.url], model_name="tiny-rm")
    prompts = [f"Q: {i} + {i}? A:" for i in range(4096)]
    completions = [f" {2 * i}" for i in range(4096)]
    got = reward(prompts=prompts, completions=completions, completion_ids=[[1]] * 4096)
    assert len(got) == 4096
    picks = [0, 1023, 1024, 2500, 4095]
    alone = reward(
        prompts=[prompts[i] for i in picks],
        completions=[completions[i] for i in picks],
        completion_ids=[[1]] * 5,
    )
    assert [close(got[i], a) for i, a in zip(picks, alone, strict=True)] == [True] * 5
    reward.client.close()
