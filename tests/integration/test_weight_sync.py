"""Weight pushes into running servers over real gloo process groups (CPU), in every training mode."""

from __future__ import annotations

import json
import math
import threading
import time

import httpx
import pytest
import torch

from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.protocol.naming import WeightValidationError, select_head
from rewardplane.sdk.push.pusher import WeightPusher
from rewardplane.sdk.retry import RewardServerError
from rewardplane.testing.servers import free_port
from tests.fixtures.models import TEXTS
from tests.fixtures.trainer import load_model, logits, perturbed, run_dying_trainer, run_rank0_learners

TOKEN = "secret"
TOL = 1e-4


def served(h, texts=TEXTS):
    body = httpx.post(f"{h.url}/score", json={"input": texts, "normalize": False}, timeout=30).json()
    return [d["score"] if isinstance(d["score"], list) else [d["score"]] for d in body["data"]], body[
        "version"
    ]


def close(a, b, tol=TOL):
    return all(
        math.isclose(x, y, abs_tol=tol, rel_tol=tol)
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


# A data-plane push's stamps in the order they happen (``last_update.after_announce_ms``); the
# engine's cache reset ("reset") goes out between the lock and the commit, at its configured moment.
DATA_PLANE_TIMELINE = [
    "task",
    "locked",
    "go",
    "worker_in",
    "worker_ready_posting",
    "worker_ready_posted",
    "worker_agreed",
    "worker_posting",
    "worker_posted",
    "worker_enqueued",
    "worker_out",
    "reported",
    "returned",
    "committed",
]


def sync_for(*handles, **kw):
    kw.setdefault("connect_timeout_s", 30)
    return WeightPusher(
        [h.url for h in handles], group_port=free_port(), token=TOKEN, trainer_host="127.0.0.1", **kw
    )


def assert_a_push_is_served(server, model_dir, version, seed=8):
    """A full push of a new model goes through and ``server`` scores with it at ``version``: what a
    replica left broken (or refusing) by a failed push must still take."""
    model = perturbed(model_dir, seed=seed)
    with sync_for(server) as sync:
        sync.push(model.state_dict(), version=version)
    assert served(server)[1] == version and close(served(server)[0], logits(model, model_dir, TEXTS))


@pytest.fixture
def server(server_factory, tiny_model_dir):
    return server_factory(tiny_model_dir, token=TOKEN)


def test_full_push_scores_equal_trainer_and_version_served(server, tiny_model_dir):
    before, _ = served(server)
    model = perturbed(tiny_model_dir, seed=1)
    sync = sync_for(server, bucket_bytes=1 << 16)  # several buckets
    try:
        assert sync.push(model.state_dict(), version=5, training_mode=Mode.FULL) == 5
        after, version = served(server)
        assert version == 5
        assert httpx.get(f"{server.url}/runtime_version").json()["version"] == 5
        assert close(after, logits(model, tiny_model_dir, TEXTS))
        assert not close(after, before)
        # a second push on the same communicator
        model2 = perturbed(tiny_model_dir, seed=2)
        sync.push(model2.state_dict(), version=6)
        assert close(served(server)[0], logits(model2, tiny_model_dir, TEXTS))
        # where the push's time went: the server's timeline, in order, on the trainer's clock
        tasks = httpx.get(
            f"{server.url}/get_num_background_tasks", headers={"Authorization": f"Bearer {TOKEN}"}
        ).json()
        last = tasks["last_update"]
        assert (last["version"], last["ok"], last["mode"]) == (6, True, "full")
        ms = last["after_announce_ms"]
        order = DATA_PLANE_TIMELINE
        assert set(ms) == {*order, "reset"} and [ms[k] for k in order] == sorted(ms[k] for k in order), ms
        assert ms["go"] <= ms["reset"] <= ms["committed"], ms  # the engine's cache reset, after the go
        stats = sync.open().last_stats
        assert stats["started_at"] < last["announced_at"] < stats["started_at"] + stats["total_s"]
    finally:
        sync.close()


def test_head_only_push_changes_only_the_head(server, tiny_model_dir):
    model = perturbed(tiny_model_dir, seed=3, head_only=True)
    sync = sync_for(server)
    try:
        with pytest.raises(WeightValidationError, match="backbone"):
            sync.push(model.state_dict(), version=1, training_mode=Mode.HEAD_ONLY)
        sync.push(select_head(model.state_dict()), version=1, training_mode=Mode.HEAD_ONLY)
        assert close(served(server)[0], logits(model, tiny_model_dir, TEXTS))
        stats = sync.open().last_stats
        assert stats["bytes"] == model.score.weight.numel() * 4
    finally:
        sync.close()


def test_push_completes_when_the_early_version_wait_expires_first(server, tiny_model_dir, monkeypatch):
    """The long-poll sent right after the announce is bounded; when it answers before the commit
    (here: at once), finalize waits on by itself and the push still reports the served version."""
    from rewardplane.sdk.push.wire import http as http_wire

    monkeypatch.setattr(http_wire, "EARLY_WAIT_S", 0.0)
    model = perturbed(tiny_model_dir, seed=6)
    sync = sync_for(server, bucket_bytes=1 << 16)
    try:
        for version in (1, 2):
            assert sync.push(model.state_dict(), version=version) == version
            assert served(server)[1] == version
        assert close(served(server)[0], logits(model, tiny_model_dir, TEXTS))
    finally:
        sync.close()


def test_head_in_bf16_is_cast_into_the_fp32_head(server, tiny_model_dir):
    model = perturbed(tiny_model_dir, seed=4, head_only=True)
    head = {"score.weight": model.score.weight.detach().to(torch.bfloat16)}
    sync = sync_for(server)
    try:
        sync.push(head, version=1, training_mode=Mode.HEAD_ONLY)
        model.score.weight.data = head["score.weight"].float()
        assert close(served(server)[0], logits(model, tiny_model_dir, TEXTS), tol=1e-3)
    finally:
        sync.close()


def test_lora_merged_push_then_fresh_adapters(server, tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    from rewardplane.sdk.lora import merge_sync_reinit

    base = load_model(tiny_model_dir)
    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            modules_to_save=["score"],
            task_type="SEQ_CLS",
        ),
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # stand-in for training: non-zero adapters and a changed head
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    expected = logits(peft_model, tiny_model_dir, TEXTS)
    sync = sync_for(server)
    try:
        with pytest.raises(WeightValidationError, match="unmerged LoRA"):
            sync.push(peft_model.state_dict(), version=1, training_mode=Mode.LORA)
        fresh = merge_sync_reinit(peft_model, lambda sd: sync.push(sd, version=1, training_mode=Mode.LORA))
        assert close(served(server)[0], expected)
        # fresh adapters start at B = 0: the reinitialised model computes what the server serves
        assert close(logits(fresh, tiny_model_dir, TEXTS), expected)
        assert any("lora_A" in n for n, p in fresh.named_parameters() if p.requires_grad)
    finally:
        sync.close()


@pytest.mark.parametrize("per_server_groups", [False, True])
def test_two_replicas_one_push(server_factory, tiny_model_dir, per_server_groups):
    a, b = server_factory.several(tiny_model_dir, {"token": TOKEN}, {"token": TOKEN})
    model = perturbed(tiny_model_dir, seed=6)
    # group_port + i is the default; here each port is picked free so a busy neighbour port cannot flake
    sync = sync_for(a, b, per_server_groups=per_server_groups, group_ports=[free_port(), free_port()])
    try:
        pub = sync.open()
        if not per_server_groups:  # one group: servers at ranks 0 and 1, trainer last
            assert pub.comm.world_size == 3 and pub.src_rank == 2
            assert sync.control.rank_offsets() == [0, 1]
        sync.push(model.state_dict(), version=3)
        expected = logits(model, tiny_model_dir, TEXTS)
        for h in (a, b):
            got, version = served(h)
            assert version == 3 and close(got, expected)
    finally:
        sync.close()


def test_scores_during_push_carry_the_version_that_made_them(server, tiny_model_dir):
    text = [TEXTS[2]]
    versions = {0: logits(load_model(tiny_model_dir), tiny_model_dir, text)[0]}
    models = {v: perturbed(tiny_model_dir, seed=10 + v) for v in (1, 2, 3)}
    versions.update({v: logits(m, tiny_model_dir, text)[0] for v, m in models.items()})
    seen: list[tuple[int, list[float]]] = []
    stop = threading.Event()

    def spam() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                body = c.post(f"{server.url}/score", json={"input": text * 4, "normalize": False}).json()
                for d in body["data"]:
                    seen.append((body["version"], [d["score"]]))

    threads = [threading.Thread(target=spam) for _ in range(3)]
    for t in threads:
        t.start()
    sync = sync_for(server, bucket_bytes=1 << 14)
    try:
        for v, m in models.items():
            sync.push(m.state_dict(), version=v)
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        sync.close()
    assert {v for v, _ in seen} >= {0, 3}
    for v, score in seen:
        assert close([score], [versions[v]]), f"a response stamped version {v} was scored by other weights"


def test_bad_metadata_rejected_before_any_receive(server, tiny_model_dir):
    model = perturbed(tiny_model_dir, seed=7)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # the server checks every announced entry against its model and answers 400 before receiving
    bad = [
        {"name": "score.weight", "dtype": "float32", "shape": [2, 64]},
        {"name": "model.layers.99.mlp.up_proj.weight", "dtype": "float32", "shape": [3, 3]},
        {"name": "model.norm.weight", "dtype": "int64", "shape": [64]},
    ]
    r = httpx.post(f"{server.url}/update_param_batch", json={"metadata": bad, "version": 1}, headers=auth)
    assert r.status_code == 400, r.text
    for needle in ("score.weight", "model.layers.99.mlp.up_proj.weight", "int64"):
        assert needle in r.json()["error"]
    sync = sync_for(server)
    try:
        # the trainer checks against the served manifest too, before announcing or broadcasting
        bad_shape = dict(model.state_dict())
        bad_shape["score.weight"] = torch.zeros(2, bad_shape["score.weight"].shape[1])
        with pytest.raises(WeightValidationError, match="score.weight"):
            sync.push(bad_shape, version=1)
        unknown = {
            "score.weight": model.score.weight,
            "model.layers.99.mlp.up_proj.weight": torch.zeros(3, 3),
        }
        with pytest.raises(WeightValidationError, match=r"model\.layers\.99"):
            sync.push(unknown, version=1, training_mode=Mode.FULL)
        assert served(server)[1] == 0  # still the old version, still serving
        sync.push(model.state_dict(), version=1)  # the same communicator still works
        assert close(served(server)[0], logits(model, tiny_model_dir, TEXTS))
        with pytest.raises(RewardServerError) as err:
            sync.push(model.state_dict(), version=1)
        assert err.value.status_code == 409 and "newer" in err.value.message
        sync.push(model.state_dict(), version=2)  # and after a refused announce too
    finally:
        sync.close()


def test_layout_announced_once_then_named_by_id(server, tiny_model_dir):
    """The first push of a layout carries its metadata; later pushes of it only its id (no
    re-sending and re-validating every entry); an id the server does not know is refused before
    anything starts, and the SDK then announces the metadata again."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(
        f"{server.url}/update_param_batch", json={"layout_id": "0123456789abcdef", "version": 1}, headers=auth
    )
    assert r.status_code == 409 and "announce the metadata again" in r.json()["error"], r.text
    meta = [{"name": "score.weight", "dtype": "float32", "shape": [1, 64]}]
    r = httpx.post(
        f"{server.url}/update_param_batch",
        json={"metadata": meta, "layout_id": "0123456789abcdef"},
        headers=auth,
    )
    assert r.status_code == 422 and "layout_id does not match" in r.text
    assert (
        httpx.get(f"{server.url}/get_num_background_tasks", headers=auth).json()["num_background_tasks"] == 0
    )

    sync = sync_for(server, bucket_bytes=1 << 16, data_plane=False)  # every push announced over HTTP
    announces: list[dict] = []

    def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/update_param_batch"):
            announces.append(json.loads(request.content))

    sync.control._http.event_hooks["request"].append(record)  # what goes over the wire
    try:
        models = [perturbed(tiny_model_dir, seed=s) for s in (31, 32, 33)]
        sync.push(models[0].state_dict(), version=1)
        sync.push(select_head(models[1].state_dict()), version=2, training_mode=Mode.HEAD_ONLY)
        sync.push(models[2].state_dict(), version=3)  # the full layout again: named by id
        assert [bool(a.get("metadata")) for a in announces] == [True, True, False]
        assert announces[2]["layout_id"] == announces[0]["layout_id"] != announces[1]["layout_id"]
        assert close(served(server)[0], logits(models[2], tiny_model_dir, TEXTS))
        with pytest.raises(RewardServerError) as err:  # refused (stale version): the id is not trusted after
            sync.push(models[2].state_dict(), version=3)
        assert err.value.status_code == 409
        sync.push(models[1].state_dict(), version=4)
        assert announces[-1].get("metadata") and served(server)[1] == 4
        assert close(served(server)[0], logits(models[1], tiny_model_dir, TEXTS))
    finally:
        sync.close()


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic c2VjcmV0"])
def test_control_plane_needs_the_right_token(server, header):
    headers = {"Authorization": header} if header else {}
    for path, body in [
        ("/init_communicator", {"host": "127.0.0.1", "port": 1, "world_size": 2}),
        (
            "/update_param_batch",
            {"metadata": [{"name": "score.weight", "dtype": "float32", "shape": [1, 64]}]},
        ),
        ("/close_communicator", {}),
    ]:
        r = httpx.post(f"{server.url}{path}", json=body, headers=headers)
        assert r.status_code == 401, (path, r.text)
        assert "token" in r.json()["error"]
    assert httpx.get(f"{server.url}/get_num_background_tasks", headers=headers).status_code == 401
    assert httpx.post(f"{server.url}/score", json={"input": ["a"]}).status_code == 200  # scoring is open


@pytest.mark.parametrize("atomic", [False, True])
def test_trainer_killed_mid_broadcast(server, tiny_model_dir, atomic):
    before, _ = served(server)
    proc = run_dying_trainer(server.url, free_port(), tiny_model_dir, version=1, atomic=atomic)
    assert proc.returncode == 17, proc.stdout + proc.stderr
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the server gives up within its group timeout (3 s here)
        state = httpx.get(f"{server.url}/runtime_version").json()
        if (
            state["state"] != "updating"
            and httpx.get(
                f"{server.url}/get_num_background_tasks", headers={"Authorization": f"Bearer {TOKEN}"}
            ).json()["num_background_tasks"]
            == 0
        ):
            break
        time.sleep(0.2)
    state = httpx.get(f"{server.url}/runtime_version").json()
    assert state["version"] == 0
    r = httpx.post(f"{server.url}/score", json={"input": TEXTS, "normalize": False})
    if atomic:  # staged: the old weights were never touched
        assert state["state"] == "serving" and r.status_code == 200 and close(served(server)[0], before)
    else:  # streamed: part of the weights was overwritten → refuse to score
        assert state["state"] == "broken", state
        assert r.status_code == 503 and "failed update" in r.json()["error"]
        assert httpx.get(f"{server.url}/health").status_code == 503
    assert_a_push_is_served(server, tiny_model_dir, 2)


def test_dead_server_makes_the_push_raise_in_time(server_factory, tiny_model_dir):
    a = server_factory(tiny_model_dir, token=TOKEN)
    sync = sync_for(a, timeout_s=10, connect_timeout_s=5, bucket_bytes=1 << 14)
    try:
        sync.open()
        a.kill()
        start = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - connection refused or communicator failure
            sync.push(perturbed(tiny_model_dir, seed=9).state_dict(), version=1)
        assert time.monotonic() - start < 60
    finally:
        sync.reset()


def test_rank0_only_publisher_for_multi_process_learners(server, tiny_model_dir, tmp_path):
    before, _ = served(server)
    results = run_rank0_learners(server.url, free_port(), tiny_model_dir, version=1, out=tmp_path / "learner")
    # only rank 0 built a publisher and joined the communicator (server + rank 0 = world size 2)
    assert results[0] == {"rank": 0, "ok": True, "made": [0, 2]}
    assert results[1] == {"rank": 1, "ok": True, "made": []}
    after, version = served(server)
    assert version == 1 and close(after, [[-x for x in row] for row in before])
    # a failed push fails every rank (version 1 again is refused by the server)
    results = run_rank0_learners(server.url, free_port(), tiny_model_dir, version=1, out=tmp_path / "again")
    assert all("version 1" in r.get("error", "") for r in results), results
    assert results[1]["made"] == []
