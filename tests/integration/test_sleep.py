"""Sleep and wake of a real server process (transformers engine on CPU): scoring while asleep is
refused with a message naming /wake, a push while asleep is refused with 409, a wake serves the
very same weights (bit for bit), a level-2 wake rebuilds them from the checkpoint and the saved
pushes or refuses to score, and the SDK's ``awake()`` block wakes and puts back to sleep."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from rewardplane.api.names import RM_PLURAL, custom_path
from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.protocol.naming import select_head
from rewardplane.sdk import AsyncRewardClient, RetryPolicy, RewardClient, RewardServerUnavailable
from rewardplane.sdk.cluster import RewardModelHandle
from rewardplane.testing.kube import MemoryKube
from tests.fixtures.models import TEXTS
from tests.fixtures.trainer import perturbed
from tests.integration.test_weight_sync import TOKEN, served, sync_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def post(server, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60, **kw)


def health(server) -> httpx.Response:
    return httpx.get(f"{server.url}/health", timeout=10)


def score(server) -> httpx.Response:
    return httpx.post(f"{server.url}/score", json={"input": TEXTS, "normalize": False}, timeout=30)


def push(server, model, version: int, mode: Mode = Mode.FULL) -> None:
    sync = sync_for(server, bucket_bytes=1 << 16)
    try:
        state = model.state_dict() if mode is Mode.FULL else select_head(model.state_dict())
        sync.push(state, version=version, training_mode=mode)
    finally:
        sync.close()


def wait_saved(server, version: int) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        tasks = httpx.get(f"{server.url}/get_num_background_tasks", headers=AUTH, timeout=10).json()
        if tasks["num_background_tasks"] == 0 and (tasks.get("last_update") or {}).get("version") == version:
            return
        time.sleep(0.05)
    raise AssertionError(f"version {version} was not persisted in time")


@pytest.fixture
def server(server_factory, tiny_model_dir):
    return server_factory(tiny_model_dir, token=TOKEN)


def test_level1_refuses_scoring_while_asleep_and_wakes_to_identical_scores(server):
    before, version = served(server)
    assert httpx.post(f"{server.url}/sleep", json={"level": 1}, timeout=10).status_code == 401

    asleep = post(server, "/sleep", {"level": 1})
    assert asleep.status_code == 200, asleep.text
    assert asleep.json() | {"seconds": 0} == asleep.json() | {
        "state": "sleeping",
        "level": 1,
        "changed": True,
        "seconds": 0,
        "weights": "asleep",
        "version": version,
    }
    again = post(server, "/sleep", {"level": 1})  # idempotent
    assert again.status_code == 200 and again.json()["changed"] is False
    other = post(server, "/sleep", {"level": 2})
    assert other.status_code == 409 and "/wake" in other.json()["error"]

    h = health(server)  # asleep is healthy: the operator reads the state from here
    assert h.status_code == 200 and h.json()["state"] == "sleeping" and h.json()["sleep_level"] == 1
    refused = score(server)
    assert refused.status_code == 503 and "asleep" in refused.json()["error"]
    assert "/wake" in refused.json()["error"]
    assert httpx.get(f"{server.url}/runtime_version", timeout=10).json()["state"] == "sleeping"

    woke = post(server, "/wake")
    assert woke.status_code == 200, woke.text
    assert woke.json()["state"] == "awake" and woke.json()["weights"] == "serving" and woke.json()["changed"]
    assert post(server, "/wake", {}).json()["changed"] is False  # idempotent
    after, after_version = served(server)
    assert after == before and after_version == version  # bit for bit
    assert health(server).json()["state"] == "serving"


def test_level2_releases_the_weights_and_reloads_the_base_checkpoint(server, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    before, _ = served(server)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    asleep = post(server, "/sleep", {"level": 2})
    assert asleep.status_code == 200, asleep.text
    # Every parameter's memory left the engine's device (the CPU here): nothing is kept.
    assert asleep.json()["device_bytes_freed"] == param_bytes
    assert score(server).status_code == 503

    woke = post(server, "/wake").json()
    assert woke["weights"] == "serving" and woke["detail"] is None
    assert served(server)[0] == before


def test_level2_after_pushes_restores_the_saved_version(server_factory, tiny_model_dir, tmp_path):
    server = server_factory(tiny_model_dir, token=TOKEN, weights_dir=tmp_path / "weights")
    push(server, perturbed(tiny_model_dir, seed=3, head_only=True), version=1, mode=Mode.HEAD_ONLY)
    wait_saved(server, 1)
    before, version = served(server)
    assert version == 1

    assert post(server, "/sleep", {"level": 2}).status_code == 200
    woke = post(server, "/wake").json()
    # the base checkpoint under the saved head: exactly what served version 1
    assert woke["weights"] == "serving" and woke["version"] == 1
    assert served(server) == (before, 1)


def test_level2_without_a_saved_copy_refuses_to_score_until_a_full_push(server, tiny_model_dir):
    push(server, perturbed(tiny_model_dir, seed=5, head_only=True), version=1, mode=Mode.HEAD_ONLY)
    assert post(server, "/sleep", {"level": 2}).status_code == 200
    woke = post(server, "/wake").json()
    assert woke["state"] == "awake" and woke["weights"] == "broken"
    assert "--weights-dir" in woke["detail"] and "push the full weights" in woke["detail"]
    assert health(server).status_code == 503
    assert score(server).status_code == 503  # never scores with weights it did not serve

    with pytest.raises(Exception, match="every parameter"):  # a head alone cannot repair it
        push(server, perturbed(tiny_model_dir, seed=6, head_only=True), version=2, mode=Mode.HEAD_ONLY)
    full = perturbed(tiny_model_dir, seed=7)
    push(server, full, version=3)
    assert health(server).status_code == 200 and served(server)[1] == 3


def test_push_and_restore_while_asleep_are_refused_with_409(server, tiny_model_dir):
    assert post(server, "/sleep", {"level": 1}).status_code == 200
    manifest = httpx.get(f"{server.url}/param_manifest", headers=AUTH, timeout=10).json()
    meta = next(m for m in manifest if m["name"] == "score.weight")
    pushed = post(server, "/update_param_batch", {"metadata": [meta], "training_mode": "head_only"})
    assert pushed.status_code == 409 and "asleep" in pushed.json()["error"]
    assert "/wake" in pushed.json()["error"]
    restored = post(server, "/restore_weights", {"version": 1})
    assert restored.status_code == 409
    assert post(server, "/wake").status_code == 200
    with pytest.raises(Exception):  # noqa: B017 - awake, the same push is accepted (and then needs a group)
        push(server, perturbed(tiny_model_dir, seed=8, head_only=True), version=1, mode=Mode.HEAD_ONLY)
        raise AssertionError("unreachable")


def test_sleep_waits_for_scoring_in_flight(server_factory, tiny_model_dir):
    """A request the engine is scoring finishes (the sleep waits for it); one that has not reached
    the engine yet when the sleep starts gets the 503 of a sleeping replica (nothing was computed)."""
    # small micro-batches: a large request holds the weights lock through many forwards
    server = server_factory(tiny_model_dir, token=TOKEN, max_batch_items=2)
    texts = [t * 15 for t in TEXTS] * 64
    results: list[httpx.Response] = []
    scoring = threading.Thread(
        target=lambda: results.append(
            httpx.post(
                f"{server.url}/score",
                json={"input": texts, "normalize": False, "truncate": True},
                timeout=120,
            )
        )
    )
    scoring.start()
    # once the first micro-batch ran, the request holds the weights lock for its whole round
    deadline = time.monotonic() + 60
    while (
        time.monotonic() < deadline
        and "rewardplane:batch_items_count 0.0" in httpx.get(f"{server.url}/metrics", timeout=10).text
    ):
        time.sleep(0.02)
    asleep = post(server, "/sleep", {"level": 1})
    scoring.join(120)
    assert results and results[0].status_code == 200, results[0].text if results else "no answer"
    assert len(results[0].json()["data"]) == len(texts)  # finished, not cut off
    assert asleep.status_code == 200 and asleep.json()["state"] == "sleeping"


def test_sdk_clients_sleep_and_wake_every_server(server_factory, tiny_model_dir):
    a, b = server_factory.several(tiny_model_dir, {"token": TOKEN}, {"token": TOKEN})
    with RewardClient([a.url, b.url], token=TOKEN, retry=RetryPolicy.no_retry()) as client:
        before = client.score_batch(TEXTS, normalize=False)
        states = client.sleep(level=1)
        assert set(states) == {a.url, b.url} and all(s.state == "sleeping" for s in states.values())
        with pytest.raises(RewardServerUnavailable, match="asleep.*/wake"):  # a 503, not retried here
            client.score_batch(TEXTS, normalize=False)
        assert all(s.state == "awake" for s in client.wake().values())
        assert client.score_batch(TEXTS, normalize=False) == before
        with pytest.raises(ValueError, match="level is 1 or 2"):
            client.sleep(level=3)

    async def run() -> None:
        async with AsyncRewardClient([a.url, b.url], token=TOKEN) as aclient:
            assert all(s.level == 2 for s in (await aclient.sleep(level=2)).values())
            assert all(s.weights == "serving" for s in (await aclient.wake()).values())
            assert await aclient.score_batch(TEXTS, normalize=False) == before

    asyncio.run(run())


def _handle_over(*servers) -> RewardModelHandle:
    kube = MemoryKube()
    kube.put(
        custom_path("default", None, RM_PLURAL),
        {
            "metadata": {"name": "rm"},
            "spec": {"replicas": len(servers)},
            "status": {
                "phase": "Sleeping",
                "endpoints": [
                    {"replica": i, "pod": f"rm-{i}", "url": s.url, "ready": True, "weightsVersion": 0}
                    for i, s in enumerate(servers)
                ],
            },
        },
    )
    return RewardModelHandle("rm", kube=kube, token=TOKEN)  # type: ignore[arg-type]


def test_handle_awake_wakes_for_the_block_and_sleeps_after_it_even_on_error(server_factory, tiny_model_dir):
    a, b = server_factory.several(tiny_model_dir, {"token": TOKEN}, {"token": TOKEN})
    handle = _handle_over(a, b)
    handle.sleep(level=1)
    assert {health(s).json()["state"] for s in (a, b)} == {"sleeping"}

    async def phase() -> list:
        async with handle.awake(level=2) as awake:
            assert {r.state for r in awake.woken.values()} == {"awake"}
            assert {health(s).json()["state"] for s in (a, b)} == {"serving"}
            async with AsyncRewardClient([a.url, b.url]) as client:
                return await client.score_batch(TEXTS, normalize=False)

    scores = asyncio.run(phase())
    assert len(scores) == len(TEXTS)
    assert {health(s).json()["sleep_level"] for s in (a, b)} == {2}  # back to sleep, at the level asked

    async def failing_phase() -> None:
        async with handle.awake():
            raise KeyError("the trainer failed")

    with pytest.raises(KeyError):
        asyncio.run(failing_phase())
    assert {health(s).json()["state"] for s in (a, b)} == {"sleeping"}

    with handle.awake():  # the blocking form
        assert {health(s).json()["state"] for s in (a, b)} == {"serving"}
    assert {health(s).json()["state"] for s in (a, b)} == {"sleeping"}
    with pytest.raises(RewardServerUnavailable):
        RewardClient(a.url, retry=RetryPolicy.no_retry()).score_batch(TEXTS)
