"""Pushes started from the data plane (a header in the group's store, no HTTP request on the path),
over real gloo groups (CPU): the same guarantees as pushes announced over HTTP."""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import pytest
import torch

from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.protocol import weights as wire
from rewardplane.protocol.naming import select_head
from rewardplane.sdk.retry import RewardServerError
from rewardplane.testing.servers import free_port
from tests.fixtures.models import TEXTS
from tests.fixtures.trainer import load_model, logits, perturbed, run_dying_trainer
from tests.integration.test_weight_sync import (
    DATA_PLANE_TIMELINE,
    TOKEN,
    assert_a_push_is_served,
    close,
    served,
    sync_for,
)

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def last_update(h):
    return httpx.get(f"{h.url}/get_num_background_tasks", headers=AUTH).json()["last_update"]


@pytest.fixture
def server(server_factory, tiny_model_dir):
    return server_factory(tiny_model_dir, token=TOKEN)


def test_later_pushes_start_from_the_data_plane(server, tiny_model_dir):
    sync = sync_for(server, bucket_bytes=1 << 16)
    try:
        sync.push(perturbed(tiny_model_dir, seed=1).state_dict(), version=1)
        assert last_update(server)["via"] == "http"  # the layout is announced once
        for version, seed in ((2, 2), (3, 3)):
            model = perturbed(tiny_model_dir, seed=seed)
            assert sync.push(model.state_dict(), version=version) == version
            # served as soon as the push returns: the commit was confirmed in the status reduction
            after, served_version = served(server)
            assert served_version == version and close(after, logits(model, tiny_model_dir, TEXTS))
            last = last_update(server)
            assert (last["via"], last["version"], last["ok"]) == ("data_plane", version, True)
            ms = last["after_announce_ms"]
            order = DATA_PLANE_TIMELINE
            assert [ms[k] for k in order] == sorted(ms[k] for k in order), ms
            # the cache reset went out once the workers were told to receive, and the commit waited for it
            assert ms["go"] <= ms["reset"] <= ms["committed"], ms
        stats = sync.open().last_stats
        assert (
            stats["announced_at_s"] <= stats["ready_at_s"] <= stats["synchronized_at_s"] <= stats["total_s"]
        )
        # a head-only push: a new layout, announced over HTTP once, then from the data plane
        head = perturbed(tiny_model_dir, seed=4, head_only=True)
        for version in (4, 5):
            sync.push(select_head(head.state_dict()), version=version, training_mode=Mode.HEAD_ONLY)
        assert last_update(server)["via"] == "data_plane"
        model.score.load_state_dict(head.score.state_dict())  # version 3's backbone, the new head
        assert close(served(server)[0], logits(model, tiny_model_dir, TEXTS))
    finally:
        sync.close()


def test_refused_push_says_why_and_keeps_the_group(server, tiny_model_dir):
    sync = sync_for(server)
    try:
        model = perturbed(tiny_model_dir, seed=1)
        sync.push(model.state_dict(), version=3)
        with pytest.raises(RewardServerError) as info:
            sync.push(perturbed(tiny_model_dir, seed=2).state_dict(), version=3)
        assert info.value.status_code == 409 and "not newer than the served version 3" in info.value.message
        assert served(server)[1] == 3 and close(served(server)[0], logits(model, tiny_model_dir, TEXTS))
        newer = perturbed(tiny_model_dir, seed=3)
        sync.push(newer.state_dict(), version=4)  # the same group: nothing moved before the refusal
        assert last_update(server)["via"] == "data_plane"
        assert served(server)[1] == 4 and close(served(server)[0], logits(newer, tiny_model_dir, TEXTS))
    finally:
        sync.close()


def test_a_layout_the_server_does_not_know_is_announced_over_http(server, tiny_model_dir):
    sync = sync_for(server)
    try:
        sync.push(perturbed(tiny_model_dir, seed=1).state_dict(), version=1)
        # a trainer that believes the server knows a layout it never saw (a server that forgot it):
        # the server refuses the header by that reason, the SDK announces the layout over HTTP
        head = select_head(perturbed(tiny_model_dir, seed=2, head_only=True).state_dict())
        publisher = sync.open()
        assert publisher.data_plane is not None
        publisher.data_plane.learned(publisher._layout(head, Mode.HEAD_ONLY, False)[3])
        sync.push(head, version=2, training_mode=Mode.HEAD_ONLY)
        assert last_update(server)["via"] == "http" and served(server)[1] == 2
        sync.push(head, version=3, training_mode=Mode.HEAD_ONLY)
        assert last_update(server)["via"] == "data_plane" and served(server)[1] == 3
    finally:
        sync.close()


def test_two_replicas_one_header(server_factory, tiny_model_dir):
    a, b = server_factory.several(tiny_model_dir, {"token": TOKEN}, {"token": TOKEN})
    sync = sync_for(a, b, bucket_bytes=1 << 16)
    try:
        sync.push(perturbed(tiny_model_dir, seed=1).state_dict(), version=1)
        model = perturbed(tiny_model_dir, seed=2)
        sync.push(model.state_dict(), version=2)
        for h in (a, b):
            assert last_update(h)["via"] == "data_plane"
            after, version = served(h)
            assert version == 2 and close(after, logits(model, tiny_model_dir, TEXTS))
    finally:
        sync.close()


def test_scores_during_data_plane_pushes_carry_their_version(server, tiny_model_dir):
    models = {v: perturbed(tiny_model_dir, seed=10 + v) for v in range(1, 5)}
    expected = {0: served(server)[0]} | {v: logits(m, tiny_model_dir, TEXTS) for v, m in models.items()}
    sync = sync_for(server, bucket_bytes=1 << 14)
    seen: list[tuple[int, list[list[float]]]] = []
    stop = threading.Event()

    def score() -> None:
        while not stop.is_set():
            after, version = served(server)
            seen.append((version, after))

    threads = [threading.Thread(target=score) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for v in range(1, 5):
            sync.push(models[v].state_dict(), version=v)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sync.close()
    assert {v for v, _ in seen} >= {4}
    for version, scores in seen:  # never a mix: every answer is the model of the version it names
        assert close(scores, expected[version]), version


@pytest.mark.parametrize("atomic", [False, True])
def test_trainer_killed_mid_data_plane_push(server, tiny_model_dir, atomic):
    proc = run_dying_trainer(server.url, free_port(), tiny_model_dir, version=2, atomic=atomic, warm=True)
    assert proc.returncode == 17, (
        proc.stdout[-3000:] + proc.stderr[-3000:] + "\nSERVER LOG\n" + server.log()[-6000:]
    )
    version_1 = load_model(tiny_model_dir)  # what the dying trainer pushed whole first: the weights negated
    with torch.no_grad():
        for p in version_1.parameters():
            p.mul_(-1.0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the server gives up within its group timeout (3 s here)
        state = httpx.get(f"{server.url}/runtime_version").json()
        if state["state"] != "updating" and (last_update(server) or {}).get("version") == 2:
            break
        time.sleep(0.2)
    state = httpx.get(f"{server.url}/runtime_version").json()
    assert state["version"] == 1 and last_update(server)["via"] == "data_plane"
    if atomic:  # staged: the old weights kept serving
        assert state["state"] == "serving" and close(
            served(server)[0], logits(version_1, tiny_model_dir, TEXTS)
        )
    else:  # streamed: part of the weights was overwritten → refuse to score
        assert state["state"] == "broken", state
        assert httpx.post(f"{server.url}/score", json={"input": TEXTS}).status_code == 503
    assert_a_push_is_served(server, tiny_model_dir, 3)


def test_atomic_and_http_only_pushes(server, tiny_model_dir):
    atomic = sync_for(server, atomic=True)
    try:
        for v in (1, 2):
            model = perturbed(tiny_model_dir, seed=v)
            atomic.push(model.state_dict(), version=v)
        assert last_update(server)["via"] == "data_plane"
        assert close(served(server)[0], logits(model, tiny_model_dir, TEXTS))
    finally:
        atomic.close()
    http_only = sync_for(server, data_plane=False)  # the HTTP path keeps working on its own
    try:
        for v in (3, 4):
            http_only.push(perturbed(tiny_model_dir, seed=v).state_dict(), version=v)
            assert last_update(server)["via"] == "http"
    finally:
        http_only.close()


def test_the_per_tensor_wire_serves_exactly_the_trainers_weights(server_factory, tiny_model_dir):
    # the server receives each tensor straight into its parameter (no bucket, no loader). Exact
    # weights through the HTTP-announced first push and the data-plane pushes after it; atomic
    # pushes always stage.
    server = server_factory(tiny_model_dir, token=TOKEN)
    sync = sync_for(server, bucket_bytes=1 << 16)
    try:
        for version, via in ((1, "http"), (2, "data_plane")):
            model = perturbed(tiny_model_dir, seed=version)
            sync.push(model.state_dict(), version=version)
            last = last_update(server)
            assert (last["via"], last["version"], last["ok"]) == (via, version, True)
            assert last["bytes"] > 0 and last["in_place_bytes"] == last["bytes"], last
            assert close(served(server)[0], logits(model, tiny_model_dir, TEXTS))
        staged = sync_for(server, bucket_bytes=1 << 16, atomic=True)
        try:
            model = perturbed(tiny_model_dir, seed=3)
            staged.push(model.state_dict(), version=3)
            last = last_update(server)
            assert last["ok"] and last["in_place_bytes"] == 0  # staged, then swapped under the lock
            assert close(served(server)[0], logits(model, tiny_model_dir, TEXTS))
        finally:
            staged.close()
    finally:
        sync.close()


def test_a_trainer_on_another_wire_is_refused_before_anything_moves(
    server_factory, tiny_model_dir, monkeypatch
):
    # the trainer (this process) names another wire in its layout ids, as a rewardplane version with
    # packed buckets did: mismatched broadcasts would corrupt weights, so the layout is refused by
    # name and nothing changes
    monkeypatch.setattr(wire, "WIRE_LAYOUT", "packed buckets")
    server = server_factory(tiny_model_dir, token=TOKEN)
    before, version = served(server)
    sync = sync_for(server, bucket_bytes=1 << 16)
    try:
        with pytest.raises(RewardServerError) as info:
            sync.push(perturbed(tiny_model_dir, seed=1).state_dict(), version=1)
        assert "different wires" in info.value.message
        after, still = served(server)
        assert still == version and close(after, before)
    finally:
        sync.close()


def test_an_atomic_push_without_room_to_stage_is_refused_before_anything_moves(
    server_factory, tiny_model_dir
):
    # a server that may stage almost nothing: an atomic push is refused with the reason and the way
    # out, over HTTP (a new group's first push) and from the data plane (a known layout), before a
    # byte moves; the group stays usable and a streamed push goes through
    env = {"REWARDPLANE_STAGING_MAX_BYTES": "1024"}
    server = server_factory(tiny_model_dir, token=TOKEN, env_extra=env)
    staged = sync_for(server, atomic=True)
    try:
        with pytest.raises(RewardServerError) as info:
            staged.push(perturbed(tiny_model_dir, seed=1).state_dict(), version=1)
        assert info.value.status_code == 409 and "REWARDPLANE_STAGING_MAX_BYTES" in info.value.message
        assert "atomic=False" in info.value.message
        assert served(server)[1] == 0
    finally:
        staged.close()
    sync = sync_for(server)
    try:
        sync.push(perturbed(tiny_model_dir, seed=2).state_dict(), version=2)  # streamed: fine
        publisher = sync.open()
        # the same layout, now atomic: started from the data plane
        publisher.options = dataclasses.replace(publisher.options, atomic=True)
        with pytest.raises(RewardServerError) as info:
            sync.push(perturbed(tiny_model_dir, seed=3).state_dict(), version=3)
        assert "REWARDPLANE_STAGING_MAX_BYTES" in info.value.message
        model = perturbed(tiny_model_dir, seed=2)
        assert served(server)[1] == 2 and close(served(server)[0], logits(model, tiny_model_dir, TEXTS))
        publisher.options = dataclasses.replace(publisher.options, atomic=False)
        newer = perturbed(tiny_model_dir, seed=4)
        sync.push(newer.state_dict(), version=4)  # the same group: nothing moved before the refusal
        assert last_update(server)["via"] == "data_plane" and served(server)[1] == 4
        assert close(served(server)[0], logits(newer, tiny_model_dir, TEXTS))
    finally:
        sync.close()
