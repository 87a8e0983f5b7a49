"""The final decoder layer on the pooled rows only (``REWARDPLANE_LAST_TOKEN_ONLY``, on by default)
gives the scores of vLLM's own model, on a real GPU.

A random-weight ``LlamaForSequenceClassification`` (hidden 1024, 8 layers, 16 heads, 8 KV heads,
intermediate 4096; bf16, fp32 head) is served twice: as users get it (the final layer's output
projection, MLP and norm on each prompt's last token, ``server/engines/vllm_last_token.py``) and
with ``REWARDPLANE_LAST_TOKEN_ONLY=0`` (vLLM's model, every row). Both get the same requests in the
same order: texts alone, mixed batches of 1-200 words (many prompts in one engine step, so most
rows are skipped), a prompt whose prefix is cached, and concurrent requests. Their scores must agree
within bf16 noise (``vllm_support.MAX_ABS``, Pearson > 0.999), and both with the transformers model in fp32. A
wrong row would give another text's score (or the head's bias) and fail the correlation.

The first server must log that it runs the pooled rows only, and that a real step ran them; the
second must not. With two GPUs a tensor-parallel (TP=2) server also answers the same texts.

Every comparison is written to ``$OUT/last_token_test.json``. About 3 minutes on one H200.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rewardplane.protocol.settings import LAST_TOKEN_ONLY
from rewardplane.testing.servers import ServerHandle
from tests.gpu.conftest import LlamaSize, build_llama_seqcls
from tests.gpu.vllm_support import (
    REPEATED,
    TEXTS,
    assert_close,
    device_count,
    pearson,
    record_result,
    reference_scores,
    rows_of,
    served,
    start_vllm_server,
    stop,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

SIZE = LlamaSize(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=4096)
CHOSEN = "final decoder layer: output projection, MLP and norm on each prompt's last token"
RAN = "final decoder layer on the pooled rows only:"
RESULT_FILE = "last_token_test.json"
# fmt: off
WORDS = [
    "the", "a", "reward", "model", "policy", "answer", "question", "helpful",
    "honest", "step", "sea", "night", "poem", "kernel", "batch", "score",
]
# fmt: on


def mixed_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 200))) for _ in range(n)]


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for x, y in zip(flat(a), flat(b), strict=True))


async def concurrent(url: str, batches: list[list[str]]) -> list[list[list[float]]]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0)) as client:

        async def one(texts: list[str]) -> list[list[float]]:
            r = await client.post(f"{url}/score", json={"input": texts, "normalize": False})
            assert r.status_code == 200, f"/score answered {r.status_code}: {r.text[:2000]}"
            return rows_of([d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])])

        return await asyncio.wait_for(asyncio.gather(*(one(b) for b in batches)), 300)


def scenario(url: str) -> dict[str, list[list[float]]]:
    """The same requests, in the same order, for every server."""
    out: dict[str, list[list[float]]] = {}
    out["alone"] = [served(url, [t])[0][0] for t in TEXTS[:6]]
    out["texts"] = served(url, TEXTS)[0]
    out["mixed batch of 96"] = served(url, mixed_texts(96, seed=1))[0]
    # REPEATED's blocks are cached by now: these prompts start from them
    tails = (" A second sentence follows.", " Then a question?", " no", " The end of the text, at last.")
    out["cached prefix"] = served(url, [REPEATED + tail for tail in tails])[0]
    rng = random.Random(2)
    batches = [mixed_texts(rng.randint(1, 12), seed=100 + i) for i in range(24)]
    out["concurrent"] = [row for rows in asyncio.run(concurrent(url, batches)) for row in rows]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_seqcls(tmp_path_factory.mktemp("vllm-last-token"), SIZE, num_labels=1, seed=5)


@pytest.fixture(scope="module")
def servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerHandle]]:
    """``pooled-rows``: as users get it; ``every-row``: ``REWARDPLANE_LAST_TOKEN_ONLY=0``. One start
    per GPU at a time (two at once on one GPU disturb vLLM's memory profiling)."""
    log_dir = tmp_path_factory.mktemp("vllm-last-token-logs")
    two = device_count() >= 2
    handles: dict[str, ServerHandle] = {}
    try:
        handles["pooled-rows"] = start_vllm_server(model_dir, log_dir, gpu=0)
        if two:
            handles["every-row"] = start_vllm_server(
                model_dir, log_dir, gpu=1, env={LAST_TOKEN_ONLY.name: "0"}
            )
        wait_ready(handles["pooled-rows"])
        if not two:
            handles["every-row"] = start_vllm_server(
                model_dir, log_dir, gpu=0, env={LAST_TOKEN_ONLY.name: "0"}
            )
        wait_ready(handles["every-row"])
        yield handles
    finally:
        for h in handles.values():
            stop(h)


@pytest.fixture(scope="module")
def every_row_scores(servers: dict[str, ServerHandle]) -> dict[str, list[list[float]]]:
    return scenario(servers["every-row"].url)


def test_pooled_rows_give_the_scores_of_vllms_own_model(
    servers: dict[str, ServerHandle], every_row_scores: dict[str, list[list[float]]], model_dir: Path
) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    pooled = servers["pooled-rows"]
    got = scenario(pooled.url)
    log = pooled.log()
    assert CHOSEN in log, f"the server did not choose the pooled rows ({pooled.log_path})"
    assert RAN in log, f"no engine step ran the pooled rows only ({pooled.log_path})"
    assert "final decoder layer" not in servers["every-row"].log(), (
        "REWARDPLANE_LAST_TOKEN_ONLY=0 was ignored"
    )

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    reference = reference_scores(hf, tokenizer, TEXTS, torch.device("cuda:0"))
    figures = {
        case: {
            "values": len(flat(rows)),
            "max_abs_vs_every_row": max_diff(rows, every_row_scores[case]),
            "pearson_vs_every_row": pearson(flat(rows), flat(every_row_scores[case])),
        }
        for case, rows in got.items()
    }
    figures["texts vs transformers fp32"] = {
        "pooled_rows_max_abs": max_diff(got["texts"], reference),
        "every_row_max_abs": max_diff(every_row_scores["texts"], reference),
    }
    record_result(RESULT_FILE, "TP=1", figures)
    print(json.dumps(figures, indent=1))

    for case, rows in got.items():
        assert_close(rows, every_row_scores[case], f"{case}: pooled rows vs every row")
    assert_close(got["texts"], reference, "pooled rows vs transformers fp32")
    # the texts differ, so equal scores are no accident of a constant output
    assert len({round(x, 4) for x in flat(got["mixed batch of 96"])}) > 48


@pytest.mark.gpus(2)
def test_tensor_parallel_server_runs_the_pooled_rows(
    model_dir: Path,
    every_row_scores: dict[str, list[list[float]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """TP=2: the final layer's projections all-reduce the pooled rows only, on both ranks."""
    handle = start_vllm_server(
        model_dir, tmp_path_factory.mktemp("vllm-last-token-tp"), gpu="0,1", tensor_parallel_size=2
    )
    try:
        wait_ready(handle)
        got = scenario(handle.url)
        log = handle.log()
    finally:
        stop(handle)
    assert log.count(CHOSEN) >= 2, (
        f"both tensor-parallel workers must choose the pooled rows ({handle.log_path})"
    )
    assert RAN in log
    record_result(
        RESULT_FILE, "TP=2", {case: max_diff(rows, every_row_scores[case]) for case, rows in got.items()}
    )
    for case, rows in got.items():
        assert_close(rows, every_row_scores[case], f"TP=2, {case}: pooled rows vs every row (TP=1)")
