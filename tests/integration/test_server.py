"""The reward server over real HTTP: scores equal the model's own logits, batching does not mix
requests, bad input gets a 4xx with a message, and the process survives all of it."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.models import TEXTS, reference_logits

TOL = 1e-4


@pytest.fixture(scope="module")
def one_label(tiny_model_dir, tmp_path_factory):
    from rewardplane.testing.servers import start_server

    h = start_server(
        tiny_model_dir, tmp_path_factory.mktemp("srv1"), max_items_per_request=32, max_model_len=64
    )
    yield h
    h.stop()


@pytest.fixture(scope="module")
def three_labels(tiny_model_dir_3labels, tmp_path_factory):
    from rewardplane.testing.servers import start_server

    h = start_server(tiny_model_dir_3labels, tmp_path_factory.mktemp("srv3"))
    yield h
    h.stop()


def _close(a: list[float], b: list[float], tol: float = TOL) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, abs_tol=tol, rel_tol=tol) for x, y in zip(a, b, strict=True)
    )


def test_health_and_info(one_label):
    r = httpx.get(f"{one_label.url}/health")
    assert r.status_code == 200
    assert r.json()["status"] == "ok" and r.json()["type"] == "reward_model"
    assert httpx.get(f"{one_label.url}/runtime_version").json()["version"] == 0
    assert httpx.get(f"{one_label.url}/get_world_size").json() == {"world_size": 1}


@pytest.mark.parametrize("fixture_name", ["one_label", "three_labels"])
def test_score_classify_pooling_equal_model_logits(request, fixture_name):
    h = request.getfixturevalue(fixture_name)
    model_dir = request.getfixturevalue(
        "tiny_model_dir" if fixture_name == "one_label" else "tiny_model_dir_3labels"
    )
    expected = reference_logits(model_dir, TEXTS)
    nl = len(expected[0])

    body = httpx.post(f"{h.url}/score", json={"input": TEXTS, "normalize": False}).json()
    got = [d["score"] if isinstance(d["score"], list) else [d["score"]] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert all(_close(g, e) for g, e in zip(got, expected, strict=True)), (got, expected)
    assert body["version"] == 0 and body["usage"]["prompt_tokens"] > 0

    # normalize: sigmoid for one label, softmax for several
    norm = httpx.post(f"{h.url}/score", json={"input": TEXTS, "normalize": True}).json()["data"]
    for d, e in zip(norm, expected, strict=True):
        if nl == 1:
            assert math.isclose(d["score"], 1 / (1 + math.exp(-e[0])), abs_tol=TOL)
        else:
            z = sum(math.exp(v) for v in e)
            assert _close(d["score"], [math.exp(v) / z for v in e])

    # vLLM shapes: /classify reads data[-1]["probs"][-1] in the peer reward loop; raw by default
    cls = httpx.post(
        f"{h.url}/classify", json={"model": "reward-model", "input": TEXTS, "activation": False}
    ).json()
    assert all(_close(d["probs"], e) for d, e in zip(cls["data"], expected, strict=True))
    assert cls["data"][0]["num_classes"] == nl
    cls_raw_default = httpx.post(f"{h.url}/classify", json={"input": TEXTS[0]}).json()
    assert _close(cls_raw_default["data"][-1]["probs"], expected[0])
    act = httpx.post(f"{h.url}/classify", json={"input": TEXTS[0], "use_activation": True}).json()
    assert not _close(act["data"][0]["probs"], expected[0])
    pool = httpx.post(f"{h.url}/pooling", json={"input": TEXTS}).json()
    assert all(_close(d["data"], e) for d, e in zip(pool["data"], expected, strict=True))


def test_token_id_input_matches_text(one_label, tiny_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(TEXTS[:3])["input_ids"]
    by_ids = httpx.post(f"{one_label.url}/classify", json={"input": ids}).json()["data"]
    by_text = httpx.post(f"{one_label.url}/classify", json={"input": TEXTS[:3]}).json()["data"]
    assert all(_close(a["probs"], b["probs"]) for a, b in zip(by_ids, by_text, strict=True))


def test_concurrent_clients_get_their_own_scores(one_label, tiny_model_dir):
    texts = [f"{TEXTS[i % len(TEXTS)]} (client {i})" for i in range(64)]
    expected = reference_logits(tiny_model_dir, texts)

    async def one(client: httpx.AsyncClient, i: int) -> float:
        r = await client.post(f"{one_label.url}/score", json={"input": [texts[i]], "normalize": False})
        r.raise_for_status()
        return r.json()["data"][0]["score"]

    async def main() -> list[float]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    got = asyncio.run(main())
    for i in range(64):
        assert math.isclose(got[i], expected[i][0], abs_tol=TOL), i
    # batches formed: at least one micro-batch held more than one item
    metrics = httpx.get(f"{one_label.url}/metrics").text
    counts = {
        line.split("le=")[1].split("}")[0].strip('"'): float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("rewardplane:batch_items_bucket")
    }
    assert counts["1.0"] < counts["+Inf"], "every micro-batch held a single item: no dynamic batching"


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/score", {"input": ["x"] * 33}, 400, "at most 32"),
        ("/score", {"input": ["word " * 200]}, 400, "limit is 64"),
        ("/score", {"input": [1, 2]}, 422, "input"),
        ("/score", {"texts": ["a"]}, 422, "input"),
        ("/score", {"input": ["a"], "n_labels": 3}, 400, "n_labels 3"),
        ("/score", {"input": ["a"], "model": "other"}, 400, "not served"),
        ("/score", {"input": ["a"], "pooling_type": "step"}, 400, "pooling_type"),
        ("/classify", {"input": [[1, 99999]]}, 400, "vocabulary"),
        ("/classify", {"input": [[1, -3]]}, 400, "vocabulary"),
        ("/pooling", {"input": [[1, 2.5]]}, 422, "input"),
        ("/pooling", {"input": [[1, "two"]]}, 422, "input"),
        ("/pooling", {"input": [[1, 2], "text"]}, 422, "input"),
        ("/classify", {"input": {"a": 1}}, 422, "input"),
    ],
)
def test_bad_input_is_4xx_with_message(one_label, path, body, status, needle):
    r = httpx.post(f"{one_label.url}{path}", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]
    assert httpx.get(f"{one_label.url}/health").status_code == 200  # still alive


def test_truncate_keeps_the_end(one_label, tiny_model_dir):
    long = "word " * 200 + "the end"
    r = httpx.post(f"{one_label.url}/score", json={"input": [long], "truncate": True, "normalize": False})
    assert r.status_code == 200
    assert r.json()["data"][0]["num_tokens"] == 64


def test_metrics_exposed(one_label):
    httpx.post(f"{one_label.url}/score", json={"input": ["a"]})
    text = httpx.get(f"{one_label.url}/metrics").text
    for name in (
        "rewardplane:requests_total",
        "rewardplane:e2e_request_latency_seconds",
        "rewardplane:batch_items",
        "rewardplane:prompt_tokens_total",
        "rewardplane:request_errors_total",
        "rewardplane:weights_version",
        'rewardplane:engine_sleep_state{sleep_state="awake"} 1.0',
        "rewardplane:num_requests_running 0.0",
        "rewardplane:num_requests_waiting 0.0",
        "rewardplane:request_queue_time_seconds_count",
    ):
        assert name in text, name


def _stage_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        sample.labels["stage"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "rewardplane:request_stage_seconds_count"
    }


def test_each_stage_of_a_scoring_request_is_timed(one_label):
    # texts are parsed, tokenized and scored; token ids skip tokenization; a control-plane body is
    # not a scoring request's stage
    before = _stage_counts(one_label.url)
    assert httpx.post(f"{one_label.url}/score", json={"input": ["a b", "c"]}).status_code == 200
    assert httpx.post(f"{one_label.url}/pooling", json={"input": [[1, 2, 3]]}).status_code == 200
    httpx.post(f"{one_label.url}/init_communicator", json={"host": "127.0.0.1", "port": 1, "world_size": 2})
    after = _stage_counts(one_label.url)
    grew = {stage: after[stage] - before.get(stage, 0.0) for stage in after}
    assert grew == {"parse": 2.0, "tokenize": 1.0, "engine": 2.0}, grew


def test_control_plane_needs_a_token(one_label):
    r = httpx.post(
        f"{one_label.url}/init_communicator", json={"host": "127.0.0.1", "port": 1, "world_size": 2}
    )
    assert r.status_code == 403 and "REWARDPLANE_TOKEN" in r.json()["error"]
