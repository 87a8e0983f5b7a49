"""Pushed weights persisted by the server (--weights-dir) and restored after a restart (/restore_weights)."""

from __future__ import annotations

import json
import time

import httpx

from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.protocol.naming import select_head
from rewardplane.tinymodel import build_tiny_reward_model
from tests.fixtures.models import TEXTS
from tests.fixtures.trainer import logits, perturbed
from tests.integration.test_weight_sync import TOKEN, close, served, sync_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_union_of_pushes_is_persisted_and_restored_after_a_restart(server_factory, tiny_model_dir, tmp_path):
    weights = tmp_path / "weights"
    server = server_factory(tiny_model_dir, token=TOKEN, weights_dir=weights)
    full = perturbed(tiny_model_dir, seed=11)
    head = perturbed(tiny_model_dir, seed=12, head_only=True)
    sync = sync_for(server, bucket_bytes=1 << 16)
    try:
        sync.push(full.state_dict(), version=1, training_mode=Mode.FULL)
        sync.push(select_head(head.state_dict()), version=2, training_mode=Mode.HEAD_ONLY)
    finally:
        sync.close()
    # The union: full's backbone, head's head.
    expected = perturbed(tiny_model_dir, seed=11)
    expected.score.load_state_dict(head.score.state_dict())
    want = logits(expected, tiny_model_dir, TEXTS)
    assert close(served(server)[0], want)

    def saved() -> dict:
        path = weights / "version.json"
        return json.loads(path.read_text()) if path.exists() else {}

    deadline = time.monotonic() + 10
    while saved().get("version") != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert saved()["version"] == 2

    server.kill()
    restarted = server_factory(tiny_model_dir, token=TOKEN, weights_dir=weights)
    assert served(restarted)[1] == 0
    wrong = httpx.post(f"{restarted.url}/restore_weights", json={"version": 3}, headers=AUTH, timeout=30)
    assert wrong.status_code == 409 and "version 2, not 3" in wrong.json()["error"]
    assert httpx.post(f"{restarted.url}/restore_weights", json={"version": 2}, timeout=30).status_code == 401
    ok = httpx.post(f"{restarted.url}/restore_weights", json={"version": 2}, headers=AUTH, timeout=30)
    assert ok.status_code == 200, ok.text
    got, version = served(restarted)
    assert version == 2 and close(got, want)


def test_back_to_back_pushes_are_not_refused_while_the_last_one_is_being_saved(
    server_factory, tiny_model_dir, tmp_path
):
    """With --weights-dir an update hands its host copies to the saving thread after it commits; a
    trainer pushing again right away (the SDK returns once the version is served) must not get a
    409 "another weight update is in progress" for that moment."""
    server = server_factory(tiny_model_dir, token=TOKEN, weights_dir=tmp_path / "weights")
    full = perturbed(tiny_model_dir, seed=21).state_dict()
    head = select_head(perturbed(tiny_model_dir, seed=22, head_only=True).state_dict())
    sync = sync_for(server, bucket_bytes=1 << 16)
    try:
        for version in range(1, 21):  # alternating layouts: every push is announced over HTTP
            if version % 2:
                sync.push(full, version=version, training_mode=Mode.FULL)
            else:
                sync.push(head, version=version, training_mode=Mode.HEAD_ONLY)
    finally:
        sync.close()
    assert served(server)[1] == 20


def test_restore_without_weights_dir_says_how_to_enable_it(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir, token=TOKEN)
    resp = httpx.post(f"{server.url}/restore_weights", json={"version": 1}, headers=AUTH, timeout=30)
    assert resp.status_code == 409 and "--weights-dir" in resp.json()["error"]


def test_saved_weights_are_never_restored_onto_another_base_model(server_factory, tiny_model_dir, tmp_path):
    """Weights pushed onto one base model, saved, then offered to a server that loaded another
    checkpoint of the same architecture (e.g. spec.model.source changed in place): refused."""
    weights = tmp_path / "weights"
    server = server_factory(tiny_model_dir, token=TOKEN, weights_dir=weights)
    head = perturbed(tiny_model_dir, seed=31, head_only=True)
    sync = sync_for(server, bucket_bytes=1 << 16)
    try:
        sync.push(select_head(head.state_dict()), version=1, training_mode=Mode.HEAD_ONLY)
    finally:
        sync.close()
    deadline = time.monotonic() + 10
    while not (weights / "version.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    server.kill()

    other_base = build_tiny_reward_model(tmp_path / "other-base", num_labels=1, seed=7)
    other = server_factory(other_base, token=TOKEN, weights_dir=weights)
    resp = httpx.post(f"{other.url}/restore_weights", json={"version": 1}, headers=AUTH, timeout=30)
    assert resp.status_code == 409, resp.text
    assert "another base model" in resp.json()["error"] and "push the weights again" in resp.json()["error"]
    assert served(other)[1] == 0  # still the base weights it loaded, nothing mixed in
