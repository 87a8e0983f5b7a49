"""Admission on a real server process (``--require-admission``, as the operator starts replicas):
until admitted at the version it serves, the readiness probe answers 503 and scoring is refused
(503, on every scoring route) while health, version and the control plane answer; an admission
for another version is refused; a push keeps the admission; taking it back takes the replica out
again; and a server started without the flag is ready from the start."""

from __future__ import annotations

import httpx
import pytest

from tests.fixtures.models import TEXTS
from tests.fixtures.trainer import perturbed
from tests.integration.test_weight_sync import TOKEN, sync_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def get(server, path: str) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", timeout=10)


def admission(server, version: int, admit: bool = True, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{server.url}/admission",
        json={"version": version, "admit": admit},
        headers=AUTH if headers is None else headers,
        timeout=10,
    )


def score(server) -> httpx.Response:
    return httpx.post(f"{server.url}/score", json={"input": TEXTS, "normalize": False}, timeout=30)


@pytest.fixture
def gated(server_factory, tiny_model_dir):
    return server_factory(tiny_model_dir, token=TOKEN, extra_args=["--require-admission"])


def test_an_unadmitted_replica_takes_no_traffic_until_admitted_at_its_version(gated, tiny_model_dir) -> None:
    ready = get(gated, "/ready")
    assert ready.status_code == 503
    assert ready.json()["admitted"] is False and "not admitted" in ready.json()["reason"]
    health = get(gated, "/health")  # the startup and liveness probes stay green
    assert health.status_code == 200 and health.json()["admitted"] is False
    refused = score(gated)
    assert refused.status_code == 503 and "not admitted" in refused.json()["error"]
    classify = httpx.post(f"{gated.url}/classify", json={"input": TEXTS[:1]}, timeout=30)
    assert classify.status_code == 503
    reward = httpx.post(f"{gated.url}/get_reward", json={"query": TEXTS[:1]}, timeout=30)
    assert reward.status_code == 503

    assert admission(gated, 0, headers={}).status_code == 401  # the control plane's token
    wrong = admission(gated, 7)
    assert wrong.status_code == 409 and "serves weights version 0, not 7" in wrong.json()["error"]
    assert get(gated, "/ready").status_code == 503

    ok = admission(gated, 0)
    assert ok.status_code == 200 and ok.json() == {"admitted": True, "version": 0, "changed": True}
    assert admission(gated, 0).json()["changed"] is False  # idempotent
    assert get(gated, "/ready").status_code == 200
    served = score(gated)
    assert served.status_code == 200 and served.json()["version"] == 0

    # A push moves an admitted replica with it: still admitted, at the new version.
    sync = sync_for(gated, bucket_bytes=1 << 16)
    try:
        sync.push(perturbed(tiny_model_dir, seed=3).state_dict(), version=1)
    finally:
        sync.close()
    ready = get(gated, "/ready")
    assert ready.status_code == 200 and ready.json()["version"] == 1
    assert score(gated).json()["version"] == 1

    back = admission(gated, 1, admit=False)
    assert back.status_code == 200 and back.json()["admitted"] is False
    assert get(gated, "/ready").status_code == 503 and score(gated).status_code == 503


def test_a_server_without_the_flag_is_ready_from_the_start(server_factory, tiny_model_dir) -> None:
    server = server_factory(tiny_model_dir, token=TOKEN)
    ready = get(server, "/ready")
    assert ready.status_code == 200 and ready.json()["admitted"] is True
    assert score(server).status_code == 200
