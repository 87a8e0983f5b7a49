"""Pushes from a trainer of two processes (a gloo world of their own), each sending its own part:
FSDP2 on CPU (every parameter a DTensor sharded by rows), Megatron-style slices by rows and by
columns, and replicated tensors, into two real server processes. Scores equal the trainer's model,
through HTTP-announced and data-plane pushes alike; a rank killed mid-push leaves no replica
serving a mix (atomic: the old version serves; streamed: the replica refuses to score until a
full push repairs it). Tensor-parallel replicas (TP=2) receive sharded pushes on the GPU only
(tests/gpu/test_sharded_push.py): the CPU engine does not shard."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from rewardplane.testing.servers import free_port
from tests.fixtures.models import TEXTS
from tests.fixtures.trainer import load_model, logits, perturbed, run_sharded_trainers, sharded_model
from tests.integration.test_weight_sync import TOKEN, close, served, sync_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def last_update(h):
    return httpx.get(f"{h.url}/get_num_background_tasks", headers=AUTH).json()["last_update"]


@pytest.fixture
def pair(server_factory, tiny_model_dir):
    return server_factory.several(tiny_model_dir, {"token": TOKEN}, {"token": TOKEN})


def _pair_saving_b(server_factory, model_dir, tmp_path):
    """Two servers started side by side; the second saves its pushes in the returned directory."""
    weights = tmp_path / "weights"
    a, b = server_factory.several(model_dir, {"token": TOKEN}, {"token": TOKEN, "weights_dir": weights})
    return a, b, weights


def _push(tmp_path, handles, model_dir, **options):
    """Two trainer ranks push ``options`` (layout, versions, ...) into ``handles``' servers."""
    urls = [h.url for h in handles]
    return run_sharded_trainers(
        tmp_path / "out", urls=urls, group_port=free_port(), model_dir=str(model_dir), **options
    )


def _serves(handles, model_dir, version):
    want = logits(sharded_model(model_dir, version), model_dir, TEXTS)
    for h in handles:
        got, v = served(h)
        assert v == version and close(got, want), (h.url, v, got, want)


@pytest.mark.parametrize("layout", ["fsdp", "tp", "replicated"])
def test_two_trainer_ranks_each_send_their_part(pair, tiny_model_dir, tmp_path, layout):
    results = _push(tmp_path, pair, tiny_model_dir, layout=layout, versions=[1, 2, 3])
    for r in results:
        assert r is not None and r.get("error") is None and r["pushed"] == [1, 2, 3], r
    sent = results[0]["sent_by"]
    assert min(sent) > 0.35 * sum(sent), sent  # both ranks send, about half each
    assert results[1]["sent_by"] == sent  # both ranks planned alike
    # the first push was announced over HTTP, the later ones started from the data plane
    assert "ready_at_s" not in results[0]["stats"][0] and "ready_at_s" in results[0]["stats"][2]
    # the trainer's steps around the publisher's header → commit, on every rank
    for st in results[0]["stats"]:
        assert {"parts_s", "plan_s", "done_s"} <= st.keys() and st["push_s"] > st["total_s"], st
    assert all({"parts_s", "plan_s", "push_s"} <= st.keys() for st in results[1]["stats"]), results[1]
    assert last_update(pair[0])["via"] == "data_plane"
    assert last_update(pair[0])["wire"] == "broadcast"  # whole tensors everywhere: broadcast moves less
    _serves(pair, tiny_model_dir, 3)


@pytest.mark.parametrize("atomic", [False, True])
def test_a_sliced_push_from_two_ranks_lands_exactly(pair, tiny_model_dir, tmp_path, monkeypatch, atomic):
    # The CPU engine keeps whole tensors, so ``auto`` broadcasts; forced, every server rank gets
    # each sender's part point to point once it published where they go: into its parameters
    # (streamed), or staged in its slices' shapes and copied in at the swap (atomic).
    monkeypatch.setenv("REWARDPLANE_PUSH_SLICING", "always")
    results = _push(
        tmp_path,
        pair,
        tiny_model_dir,
        layout="tp",  # pieces by rows and by columns
        versions=[1, 2, 3],
        atomic=atomic,
    )
    for r in results:
        assert r is not None and r.get("error") is None and r["pushed"] == [1, 2, 3], r
    for h in pair:
        update = last_update(h)
        assert update["via"] == "data_plane" and update["wire"] == "sliced", update
        if atomic:  # staged: nothing lands in a parameter before the swap
            assert update["in_place_bytes"] == 0 < update["bytes"], update
        else:  # one-box messages straight into the parameters, the rest packed
            assert 0 < update["in_place_bytes"] < update["bytes"], update
    _serves(pair, tiny_model_dir, 3)


def test_a_persisting_replica_takes_sliced_pushes_and_restores_them(
    server_factory, tiny_model_dir, tmp_path, monkeypatch
):
    # --weights-dir (podCopy and persistDir in a cluster): the worker saves what it received of each
    # tensor, so keeping a copy no longer turns the replica's pushes into broadcasts.
    monkeypatch.setenv("REWARDPLANE_PUSH_SLICING", "always")
    a, b, weights = _pair_saving_b(server_factory, tiny_model_dir, tmp_path)
    results = _push(tmp_path, (a, b), tiny_model_dir, layout="tp", versions=[1, 2, 3])
    for r in results:
        assert r is not None and r.get("error") is None and r["pushed"] == [1, 2, 3], r
    assert last_update(b)["wire"] == "sliced", last_update(b)
    deadline = time.monotonic() + 30
    while '"version": 3' not in (
        (weights / "version.json").read_text() if (weights / "version.json").exists() else ""
    ):
        assert time.monotonic() < deadline, "version 3 was not saved"
        time.sleep(0.05)
    b.kill()
    restarted = server_factory(tiny_model_dir, token=TOKEN, weights_dir=weights)
    got = httpx.post(f"{restarted.url}/restore_weights", json={"version": 3}, headers=AUTH, timeout=60)
    assert got.status_code == 200, got.text
    _serves([a, restarted], tiny_model_dir, 3)


def test_a_head_only_push_from_two_ranks(pair, tiny_model_dir, tmp_path):
    # the one-row head is all on rank 0 under FSDP2 (rank 1's shard of it is empty): rank 0 sends it
    results = _push(tmp_path, pair, tiny_model_dir, layout="fsdp", mode="head_only", versions=[1, 2])
    for r in results:
        assert r is not None and r.get("error") is None and r["pushed"] == [1, 2], r
    assert results[0]["sent_by"][1] == 0 < results[0]["sent_by"][0]
    head = sharded_model(tiny_model_dir, 2)
    model = load_model(tiny_model_dir)  # the served backbone, version 2's head
    with torch.no_grad():
        model.score.weight.copy_(head.score.weight)
    want = logits(model, tiny_model_dir, TEXTS)
    for h in pair:
        got, v = served(h)
        assert v == 2 and close(got, want), (got, want)


@pytest.mark.parametrize(("atomic", "sliced"), [(False, False), (True, False), (True, True)])
def test_a_trainer_rank_killed_mid_push_leaves_no_replica_serving_a_mix(
    pair, tiny_model_dir, tmp_path, monkeypatch, atomic, sliced
):
    if sliced:  # version 1 (announced over HTTP, applied at the swap) publishes the slices
        monkeypatch.setenv("REWARDPLANE_PUSH_SLICING", "always")
    results = _push(
        tmp_path,
        pair,
        tiny_model_dir,
        layout="fsdp",
        versions=[1, 2],
        die=1,  # rank 1 dies a few buckets into version 2
        atomic=atomic,
        timeout_s=5,
    )
    assert results[1] is None  # it died
    leader = results[0]
    assert leader is not None and leader["pushed"] == [1] and "version 2" in str(leader.get("error")), leader
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # each server gives up within its group timeout (5 s)
        states = [httpx.get(f"{h.url}/runtime_version").json()["state"] for h in pair]
        if "updating" not in states:
            break
        time.sleep(0.2)
    for h in pair:
        if sliced:  # the push that failed was the sliced one, staged in the workers' slices
            assert last_update(h)["wire"] == "sliced" and not last_update(h)["ok"], last_update(h)
        state = httpx.get(f"{h.url}/runtime_version").json()
        assert state["version"] == 1, state
        if atomic:  # staged: version 1 keeps serving, whole
            assert state["state"] == "serving", state
        else:  # streamed: part of version 2 was written → refuse to score, never serve a mix
            assert state["state"] == "broken", state
            assert httpx.post(f"{h.url}/score", json={"input": TEXTS}).status_code == 503
    if atomic:
        _serves(pair, tiny_model_dir, 1)
    model = perturbed(tiny_model_dir, seed=9)  # a one-process trainer repairs both
    sync = sync_for(*pair)
    try:
        sync.push(model.state_dict(), version=3)
    finally:
        sync.close()
    want = logits(model, tiny_model_dir, TEXTS)
    for h in pair:
        got, v = served(h)
        assert v == 3 and close(got, want)


def test_a_layout_naming_a_sender_the_group_lacks_is_refused(pair):
    # a server that joined with one sender refuses pieces from a second before anything moves
    body = {
        "metadata": [
            {
                "name": "score.weight",
                "dtype": "float32",
                "shape": [1, 64],
                "split_dim": 1,
                "pieces": [{"sender": 0, "start": 0, "stop": 32}, {"sender": 1, "start": 32, "stop": 64}],
            }
        ],
        "training_mode": "head_only",
    }
    r = httpx.post(f"{pair[0].url}/update_param_batch", json=body, headers=AUTH)
    assert r.status_code == 400 and "sending rank(s); join with senders=2" in r.text, r.text


DELTA_KEYS = ("score.weight", "model.layers.0.mlp.up_proj.weight")  # what each later step changes


def test_delta_pushes_from_two_ranks_send_only_what_changed(server_factory, tiny_model_dir, tmp_path):
    """FSDP2 ranks with ``delta=True``: v1 moves everything; v2 only the two changed tensors (every
    rank's part of them); v3, the same weights, the smallest tensor alone; v4 the two again; v5,
    after replica b was restored (it no longer holds v4 as pushed), is refused as a delta on both
    ranks and pushed whole, as v5."""
    a, b, weights = _pair_saving_b(server_factory, tiny_model_dir, tmp_path)
    results = _push(
        tmp_path,
        (a, b),
        tiny_model_dir,
        layout="fsdp",
        versions=[1, 2, 3, 4, 5],
        delta=True,
        delta_base=1,
        delta_keys=list(DELTA_KEYS),
        same_as={"3": 2},
        restore={"url": b.url, "version": 4, "weights": str(weights), "before": 5},
    )
    for r in results:
        assert r is not None and r.get("error") is None and r["pushed"] == [1, 2, 3, 4, 5], r
    sizes = {n: t.numel() * t.element_size() for n, t in load_model(tiny_model_dir).state_dict().items()}
    full = sum(sizes.values())
    moved = [s["bytes"] for s in results[0]["stats"]]
    changed = sum(sizes[k] for k in DELTA_KEYS)
    assert moved[0] >= full
    assert changed <= moved[1] <= changed + 2 * 256 * len(DELTA_KEYS) < full  # two senders' parts, aligned
    assert moved[2] == min(sizes.values())  # nothing changed: the smallest tensor (a push carries one)
    assert moved[3] == moved[1]
    assert moved[4] >= full  # refused by b: everything, as the same version
    log = (tmp_path / "out.0.log").read_text()
    assert "version 5 on version 4 refused" in log and "pushing all" in log, log[-3000:]
    want = logits(sharded_model(tiny_model_dir, 5, 1, DELTA_KEYS), tiny_model_dir, TEXTS)
    for h in (a, b):
        got, v = served(h)
        assert v == 5 and close(got, want), (h.url, v, got, want)
        assert last_update(h)["bytes"] >= full
