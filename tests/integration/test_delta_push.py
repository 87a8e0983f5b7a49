"""Delta pushes (docs/weight-sync.md "Delta pushes") into real servers over gloo: only the tensors
that changed move, the replicas end up bit-for-bit the trainer's, and a replica that no longer holds
the base version refuses the delta before any byte moves (the SDK then pushes everything)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import torch

from rewardplane.protocol import Endpoints, ParamChecksumsResponse
from rewardplane.testing.servers import ServerHandle
from rewardplane.transport.checksums import digests
from tests.fixtures.models import TEXTS
from tests.fixtures.trainer import logits, perturbed
from tests.integration.test_weight_sync import TOKEN, close, served, sync_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}
LAYER = "model.layers.0.mlp.up_proj.weight"  # the one backbone tensor a step changes
CHANGED = ("score.weight", LAYER)


def step(model: torch.nn.Module, seed: int) -> None:
    """A training step that touches the head and one layer only (the rest is frozen)."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in CHANGED:
            params[name].add_(torch.randn(params[name].shape, generator=g) * 0.05)


def last_update(url: str) -> dict:
    return httpx.get(f"{url}/get_num_background_tasks", headers=AUTH, timeout=30).json()["last_update"]


def assert_holds(h: ServerHandle, model: torch.nn.Module, model_dir: Path, version: int) -> None:
    """``h`` serves ``version``, scores as the trainer's model, and holds its exact bytes."""
    url = h.url
    got, served_version = served(h)
    assert served_version == version
    assert close(got, logits(model, model_dir, TEXTS))
    body = ParamChecksumsResponse.model_validate(
        httpx.get(url + Endpoints.PARAM_CHECKSUMS, headers=AUTH, timeout=60).json()
    )
    want = digests(model.named_parameters())
    held = body.workers[0].checksums
    assert body.version == version
    assert [n for n in want if tuple(held[n]) != tuple(want[n])] == []


def wait_saved(weights: Path, version: int) -> None:
    path = weights / "version.json"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if path.exists() and json.loads(path.read_text()).get("version") == version:
            return
        time.sleep(0.05)
    raise AssertionError(f"version {version} was not saved in {weights}")


def restore(url: str, version: int) -> None:
    r = httpx.post(f"{url}/restore_weights", json={"version": version}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_delta_push_moves_only_changed_tensors_and_falls_back_after_a_restore(
    server_factory, tiny_model_dir, tmp_path, caplog
):
    weights = tmp_path / "weights"
    a, b = server_factory.several(tiny_model_dir, {"token": TOKEN}, {"token": TOKEN, "weights_dir": weights})
    model = perturbed(tiny_model_dir, seed=41)
    sizes = {n: t.numel() * t.element_size() for n, t in model.state_dict().items()}
    full_bytes = sum(sizes.values())
    sync = sync_for(a, b, delta=True)
    try:
        # v1: nothing acknowledged yet, so everything moves
        sync.push(model.state_dict(), version=1)
        stats = sync.open().last_stats
        assert stats["bytes"] >= full_bytes

        # (a) v2: the head and one layer changed → only their bytes move (plus 256-byte alignment)
        step(model, seed=1)
        sync.push(model.state_dict(), version=2)
        moved = sync.open().last_stats["bytes"]
        changed = sum(sizes[n] for n in CHANGED)
        assert changed <= moved <= changed + 256 * len(CHANGED) < full_bytes
        for h in (a, b):
            assert {k: last_update(h.url)[k] for k in ("version", "ok", "bytes")} == {
                "version": 2,
                "ok": True,
                "bytes": moved,
            }
            assert_holds(h, model, tiny_model_dir, 2)

        # (c) v3: nothing changed → v3 is served; only the smallest tensor travels (a push carries one)
        sync.push(model.state_dict(), version=3)
        assert sync.open().last_stats["bytes"] == min(sizes.values())
        for h in (a, b):
            assert_holds(h, model, tiny_model_dir, 3)

        # the same two tensors again: their layout is known, so the delta starts from the data plane
        step(model, seed=2)
        sync.push(model.state_dict(), version=4)
        assert sync.open().last_stats["bytes"] == moved
        for h in (a, b):
            assert last_update(h.url)["via"] == "data_plane"
            assert_holds(h, model, tiny_model_dir, 4)

        # (b) b is restored to v4: same version, but not the weights a push left, so it refuses deltas
        wait_saved(weights, 4)
        restore(b.url, 4)
        assert httpx.get(b.url + Endpoints.RUNTIME_VERSION, timeout=30).json()["delta_base"] is None
        r = httpx.post(  # over HTTP: 409 before anything is received
            b.url + Endpoints.UPDATE_PARAM_BATCH,
            json={
                "metadata": [
                    {"name": "score.weight", "dtype": "float32", "shape": list(model.score.weight.shape)}
                ],
                "version": 5,
                "base_version": 4,
            },
            headers=AUTH,
            timeout=30,
        )
        assert r.status_code == 409 and r.json()["detail"] == {"code": "stale_base"}, r.text
        assert "restored" in r.json()["error"]
        # the SDK's delta (from the data plane) is refused by b in the ready step; it pushes everything
        step(model, seed=3)
        with caplog.at_level(logging.WARNING, logger="rewardplane.sdk.push.pusher"):
            sync.push(model.state_dict(), version=5)
        assert any("pushing all" in r.message for r in caplog.records), caplog.text
        assert sync.open().last_stats["bytes"] >= full_bytes
        for h in (a, b):
            assert last_update(h.url)["bytes"] >= full_bytes
            assert_holds(h, model, tiny_model_dir, 5)

        # and the next one is a delta again
        step(model, seed=4)
        sync.push(model.state_dict(), version=6)
        assert sync.open().last_stats["bytes"] == moved
        for h in (a, b):
            assert_holds(h, model, tiny_model_dir, 6)
    finally:
        sync.close()


def test_delta_announced_over_http_checks_the_replicas_first(
    server_factory, tiny_model_dir, tmp_path, caplog
):
    """Without the data plane a delta is announced over HTTP: the SDK first reads every replica's
    delta base, and pushes everything where one does not hold the base as pushed."""
    weights = tmp_path / "weights"
    server = server_factory(tiny_model_dir, token=TOKEN, weights_dir=weights)
    model = perturbed(tiny_model_dir, seed=42)
    full_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    sync = sync_for(server, data_plane=False)
    try:
        sync.push(model.state_dict(), version=1, delta=True)
        step(model, seed=5)
        sync.push(model.state_dict(), version=2, delta=True)
        assert sync.open().last_stats["bytes"] < full_bytes
        wait_saved(weights, 2)
        restore(server.url, 2)
        step(model, seed=6)
        with caplog.at_level(logging.WARNING, logger="rewardplane.sdk.push.pusher"):
            sync.push(model.state_dict(), version=3, delta=True)
        assert any("pushing all" in r.message for r in caplog.records), caplog.text
        assert sync.open().last_stats["bytes"] >= full_bytes
        assert_holds(server, model, tiny_model_dir, 3)
        # a push without delta forgets what was acknowledged: the next delta sends everything
        sync.push(model.state_dict(), version=4)
        sync.push(model.state_dict(), version=5, delta=True)
        assert sync.open().last_stats["bytes"] >= full_bytes
    finally:
        sync.close()
