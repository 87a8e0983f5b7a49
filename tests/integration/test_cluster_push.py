"""Cluster-mode weight pushes: the SDK's RewardModelHandle → WeightSync → the operator → every replica,
against a real kube-apiserver, the node agent running real servers, and real gloo groups."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rewardplane.api.kube import Kube, core_path, custom_path
from rewardplane.api.names import TOKEN_KEY, token_secret_name
from rewardplane.cli import main as rewardplane_cli
from rewardplane.protocol.naming import select_head
from rewardplane.sdk import RewardModelHandle, WeightSyncFailed
from tests.fixtures.models import TEXTS
from tests.fixtures.operator import (
    SERVER_READY_S,
    get_rm,
    kubectl_get,
    pods_of,
    reward_model,
    wait_for,
)
from tests.fixtures.trainer import logits, perturbed, run_fsdp_example

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4
WS_PLURAL = "weightsyncs"


def scores(url: str, texts: list[str] = TEXTS) -> tuple[list[list[float]], int]:
    body = httpx.post(f"{url}/score", json={"input": texts, "normalize": False}, timeout=30).json()
    return [d["score"] if isinstance(d["score"], list) else [d["score"]] for d in body["data"]], body[
        "version"
    ]


def close(a: list[list[float]], b: list[list[float]], tol: float = TOL) -> bool:
    return all(
        math.isclose(x, y, abs_tol=tol, rel_tol=tol)
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


def make_model(kube: Kube, ns: str, node: str, model_dir: Path, replicas: int, **extra: Any) -> str:
    name = f"rm-{uuid.uuid4().hex[:4]}"
    body = reward_model(name, ns, replicas=replicas, gpu={"mode": "none", "node": node}, **extra)
    body["spec"]["model"] = {"source": str(model_dir), "dtype": "float32"}
    kube.create(custom_path(ns), body)
    return name


@contextlib.contextmanager
def ready_rm(
    kube: Kube,
    ns: str,
    operator: Any,
    node_agent: Any,
    control_plane: Any,
    model_dir: Path,
    replicas: int,
    **extra: Any,
) -> Iterator[tuple[str, RewardModelHandle, Callable[[], str]]]:
    """A RewardModel of ``replicas`` replicas on the node agent (``make_model``), once Ready: its
    name, a handle (closed after) and the operator's and node agent's logs, for failure messages."""
    name = make_model(kube, ns, node_agent.name, model_dir, replicas, **extra)
    handle = RewardModelHandle(name, ns, kubeconfig=str(control_plane.kubeconfig))
    try:
        handle.wait_ready(SERVER_READY_S)
        yield name, handle, lambda: operator.logs() + "\n" + node_agent.log_tail()
    finally:
        handle.close()


def ws_status(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    return (kube.get(custom_path(ns, name, WS_PLURAL)) or {}).get("status") or {}


def every_replica_scores_like(handle: RewardModelHandle, model: Any, model_dir: Path, version: int) -> None:
    want = logits(model, model_dir, TEXTS)
    urls = [e.url for e in handle.get_all_endpoints()]
    assert urls
    for url in urls:
        got, served_version = scores(url)
        assert served_version == version, url
        assert close(got, want), url


DYING_TRAINER = r"""
import os, sys
from rewardplane.transport import comm as C
from rewardplane.sdk.cluster import RewardModelHandle
from tests.fixtures.trainer import perturbed
name, ns, kubeconfig, model_dir, version = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
real = C.Communicator.broadcast
sent = [0]
def dying(self, tensor, src):
    real(self, tensor, src)
    sent[0] += 1
    if sent[0] == 3:  # a few buckets in: the trainer process dies
        print("dying", flush=True)
        os._exit(17)
C.Communicator.broadcast = dying
h = RewardModelHandle(name, ns, kubeconfig=kubeconfig)
h.push_weights(perturbed(model_dir, seed=99).state_dict(), version, "full", bucket_bytes=1 << 14, timeout_s=30,
               trainer_host="127.0.0.1")
"""


def test_cluster_push_end_to_end(
    kube: Kube,
    operator: Any,
    node_agent: Any,
    ns: str,
    tiny_model_dir: Path,
    control_plane: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with ready_rm(kube, ns, operator, node_agent, control_plane, tiny_model_dir, 2) as (name, handle, logs):
        assert len(handle.get_endpoints()) == 2

        # head_only: one broadcast into both replicas.
        head_model = perturbed(tiny_model_dir, seed=3, head_only=True)
        result = handle.push_weights(
            select_head(head_model.state_dict()), 1, "head_only", timeout_s=60, trainer_host="127.0.0.1"
        )
        assert result.world_size == 3 and result.replicas == 2 and result.transport == "gloo"
        status = ws_status(kube, ns, name)
        assert status["phase"] == "Completed" and status["version"] == 1 and status["worldSize"] == 3
        assert [(r["replica"], r["rankOffset"], r["phase"]) for r in status["replicas"]] == [
            (0, 0, "Completed"),
            (1, 1, "Completed"),
        ]
        assert all(r["bytes"] > 0 for r in status["replicas"]) and status["bytes"] > 0
        assert get_rm(kube, ns, name)["status"]["weightsVersion"] == 1
        every_replica_scores_like(handle, head_model, tiny_model_dir, 1)

        # full, several buckets, over shared memory: the replicas' node agent runs on this host, and
        # the trainer's request holds for the replicas the operator asked to join.
        full_model = perturbed(tiny_model_dir, seed=4)
        result = handle.push_weights(
            full_model.state_dict(),
            2,
            "full",
            bucket_bytes=1 << 16,
            timeout_s=60,
            trainer_host="127.0.0.1",
            backend="ipc",
        )
        assert result.transport == "ipc"
        assert ws_status(kube, ns, name)["phase"] == "Completed"
        assert get_rm(kube, ns, name)["status"]["weightsVersion"] == 2
        every_replica_scores_like(handle, full_model, tiny_model_dir, 2)
        client = handle.client()
        assert sorted(client.endpoints) == sorted(e.url for e in handle.get_endpoints())
        assert handle.client() is client  # same replicas: the same client
        via_client = client.score_batch(TEXTS, normalize=False)
        assert close(
            [s if isinstance(s, list) else [s] for s in via_client], logits(full_model, tiny_model_dir, TEXTS)
        )
        # kubectl shows the push.
        table = kubectl_get(control_plane, "ws", ns)
        if table:
            header, row = table
            assert header.split()[:6] == ["NAME", "MODEL", "VERSION", "HANDLED", "MODE", "PHASE"]
            cells = row.split()
            # HANDLED: the generation the phase describes (this object's own, as the push completed)
            assert (
                cells[:3] == [name, name, "2"] and cells[3].isdigit() and cells[4:6] == ["full", "Completed"]
            )

        # A lower version is refused with the operator's reason; nothing changes.
        with pytest.raises(WeightSyncFailed) as info:
            handle.push_weights(head_model.state_dict(), 1, "full", timeout_s=30, trainer_host="127.0.0.1")
        assert info.value.reason == "StaleVersion" and "not newer" in str(info.value)
        assert ws_status(kube, ns, name)["reason"] == "StaleVersion"
        assert get_rm(kube, ns, name)["status"]["weightsVersion"] == 2
        every_replica_scores_like(handle, full_model, tiny_model_dir, 2)

        # A trainer that dies mid-broadcast: Failed with a reason, within the timeout.
        started = time.monotonic()
        dying = subprocess.run(
            [
                sys.executable,
                "-c",
                DYING_TRAINER,
                name,
                ns,
                str(control_plane.kubeconfig),
                str(tiny_model_dir),
                "3",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert dying.returncode == 17, dying.stdout + dying.stderr
        failed = wait_for(
            "the push Failed",
            lambda: (s := ws_status(kube, ns, name)).get("phase") == "Failed" and s.get("version") == 3 and s,
            45,
            logs,
        )
        assert time.monotonic() - started < 45
        assert failed["reason"] in ("ReplicaFailed", "Timeout") and failed["message"]
        assert any(h["version"] == 3 and h["phase"] == "Failed" for h in failed["history"])

        # The next push succeeds, onto every replica (a partly written one included).
        again = perturbed(tiny_model_dir, seed=5)
        handle.push_weights(
            again.state_dict(), 3, "full", bucket_bytes=1 << 16, timeout_s=60, trainer_host="127.0.0.1"
        )
        wait_for(
            "both replicas ready on version 3",
            lambda: len(handle.get_endpoints()) == 2 and handle.get_weights_version() == 3,
            30,
            logs,
        )
        every_replica_scores_like(handle, again, tiny_model_dir, 3)
        history = ws_status(kube, ns, name)["history"]
        assert [(h["version"], h["phase"]) for h in history] == [
            (1, "Completed"),
            (2, "Completed"),
            (1, "Failed"),
            (3, "Failed"),
            (3, "Completed"),
        ]

        # The CLI (through the `rewardplane` entry point): push a saved checkpoint, status, score.
        checkpoint = tmp_path / "checkpoint"
        saved = perturbed(tiny_model_dir, seed=6)
        saved.save_pretrained(checkpoint)
        base = ["-n", ns, "--kubeconfig", str(control_plane.kubeconfig)]
        assert (
            rewardplane_cli(
                [
                    "push",
                    name,
                    *base,
                    "--from",
                    str(checkpoint),
                    "--version",
                    "4",
                    "--mode",
                    "full",
                    "--trainer-host",
                    "127.0.0.1",
                    "--timeout",
                    "60",
                ]
            )
            == 0
        )
        assert "pushed version 4 (full" in capsys.readouterr().out
        every_replica_scores_like(handle, saved, tiny_model_dir, 4)
        assert rewardplane_cli(["status", name, *base]) == 0
        out = capsys.readouterr().out
        assert f"RewardModel {ns}/{name}: Ready" in out and "weights version 4" in out
        assert "last push: version 4 full Completed" in out and out.count("serving") == 2
        assert rewardplane_cli(["score", name, *base, "--raw", *TEXTS[:3]]) == 0
        captured = capsys.readouterr()
        want = logits(saved, tiny_model_dir, TEXTS[:3])
        got = [[float(line.split("\t")[0])] for line in captured.out.strip().splitlines()]
        assert close(got, want) and "weights version 4" in captured.err
        # Without a flag, `rewardplane score` scores as the RewardModel says (spec.model.normalize).
        kube.merge_patch(custom_path(ns, name), {"spec": {"model": {"normalize": True}}})
        assert rewardplane_cli(["score", name, *base, *TEXTS[:3]]) == 0
        got = [[float(line.split("\t")[0])] for line in capsys.readouterr().out.strip().splitlines()]
        assert close(got, [[1 / (1 + math.exp(-w[0]))] for w in want])
        assert rewardplane_cli(["push", name, *base, "--from", str(checkpoint), "--version", "2"]) == 1
        assert "StaleVersion" in capsys.readouterr().err

        # Delta pushes: the first sends everything, the next only the tensor that changed; one
        # built on a version the replicas no longer hold as pushed is refused, and all is sent.
        import torch

        delta_model = perturbed(tiny_model_dir, seed=7)
        opts: dict[str, Any] = {"bucket_bytes": 1 << 16, "timeout_s": 60, "trainer_host": "127.0.0.1"}
        full_bytes = handle.push_weights(delta_model.state_dict(), 5, "full", delta=True, **opts).bytes
        with torch.no_grad():
            delta_model.score.weight.add_(0.5)
        small = handle.push_weights(delta_model.state_dict(), 6, "full", delta=True, **opts)
        assert 0 < small.bytes < full_bytes / 10, (small.bytes, full_bytes)
        assert small.weightsync["spec"]["baseVersion"] == 5
        every_replica_scores_like(handle, delta_model, tiny_model_dir, 6)
        assert handle._acked is not None  # a trainer whose last acknowledged push is not what is served:
        handle._acked = dataclasses.replace(handle._acked, version=5)  # the replicas serve 6
        with torch.no_grad():
            delta_model.score.weight.add_(0.5)
        with caplog.at_level(logging.WARNING, logger="rewardplane.sdk.cluster"):
            whole = handle.push_weights(delta_model.state_dict(), 7, "full", delta=True, **opts)
        assert whole.bytes == full_bytes and "refused" in caplog.text, caplog.text
        assert "baseVersion" not in whole.weightsync["spec"]
        last = [(h["version"], h["phase"], h.get("reason")) for h in ws_status(kube, ns, name)["history"]][
            -2:
        ]
        assert last[0] == (7, "Failed", "DeltaRefused") and last[1][:2] == (7, "Completed"), last
        every_replica_scores_like(handle, delta_model, tiny_model_dir, 7)

        # A push refused at its announce while the trainer has not joined yet (deterministic here:
        # this trainer hosts the group's store and never joins) must not leave the replicas
        # waiting in that group's join: the next push, at once, lands within its own timeout.
        from rewardplane.protocol import RewardModelTrainingMode
        from rewardplane.sdk.push.wire.operator import OperatorPush
        from rewardplane.transport.comm import create_store

        pusher = OperatorPush(handle)
        metadata, _ = handle.prepare(delta_model.state_dict(), RewardModelTrainingMode.FULL)
        store = create_store("127.0.0.1", 0, is_master=True, world_size=None, timeout_s=120)
        try:
            spec = pusher.objects.push_spec(
                8,
                RewardModelTrainingMode.FULL,
                host="127.0.0.1",
                port=int(store.port),
                manifest=pusher.objects.store_manifest(metadata),
                bucket_bytes=1 << 16,
                timeout_s=120,  # the replicas' joins would wait this long
                adapter=None,
                base_version=5,
            )
            generation = pusher.objects.request_push(spec)
            refused = wait_for(
                "the delta push refused",
                lambda: (
                    (s := ws_status(kube, ns, name)).get("observedGeneration") == generation
                    and s.get("phase") == "Failed"
                    and s
                ),
                30,
                logs,
            )
            assert refused["reason"] == "DeltaRefused", refused
            handle.push_weights(delta_model.state_dict(), 8, "full", **{**opts, "timeout_s": 30})
        finally:
            del store
        every_replica_scores_like(handle, delta_model, tiny_model_dir, 8)


def _watch_statuses(
    kube_api: Any, ns: str, name: str, out: list[dict[str, Any]], stop: threading.Event
) -> None:
    from kubernetes import client, watch

    api = client.CustomObjectsApi(kube_api)
    w = watch.Watch()
    for event in w.stream(
        api.list_namespaced_custom_object,
        "rewardplane.io",
        "v1alpha1",
        ns,
        "rewardmodels",
        field_selector=f"metadata.name={name}",
        timeout_seconds=180,
    ):
        out.append(event["object"].get("status") or {})
        if stop.is_set():
            w.stop()


def test_restarted_replica_is_marked_stale_restored_and_readmitted(
    kube: Kube,
    operator: Any,
    node_agent: Any,
    ns: str,
    tiny_model_dir: Path,
    control_plane: Any,
    kube_api: Any,
    tmp_path: Path,
) -> None:
    persist = tmp_path / "persist"
    name = make_model(
        kube, ns, node_agent.name, tiny_model_dir, replicas=2, weightSync={"persistDir": str(persist)}
    )
    logs = lambda: operator.logs() + "\n" + node_agent.log_tail()  # noqa: E731
    handle = RewardModelHandle(name, ns, kubeconfig=str(control_plane.kubeconfig))
    statuses: list[dict[str, Any]] = []
    stop = threading.Event()
    try:
        handle.wait_ready(SERVER_READY_S)
        model = perturbed(tiny_model_dir, seed=21)
        handle.push_weights(
            model.state_dict(), 4, "full", bucket_bytes=1 << 16, timeout_s=60, trainer_host="127.0.0.1"
        )
        wait_for(
            "version 4 persisted by both replicas",
            lambda: all(
                any('"version": 4' in p.read_text() for p in persist.glob(f"*/*/{name}-{i}/version.json"))
                for i in range(2)
            ),
            20,
            logs,
        )

        watcher = threading.Thread(
            target=_watch_statuses, args=(kube_api, ns, name, statuses, stop), daemon=True
        )
        watcher.start()
        victim = pods_of(kube, ns, name)[f"{name}-1"]
        (container,) = victim["status"]["containerStatuses"]
        pid = int(container["containerID"].rsplit("/", 1)[1])
        os.kill(pid, 9)  # the node agent restarts the process: it comes back on base weights

        def stale_seen() -> bool:
            return any(
                e.get("pod") == f"{name}-1" and e.get("state") == "stale"
                for s in statuses
                for e in s.get("endpoints") or []
            )

        wait_for("the restarted replica marked stale", stale_seen, SERVER_READY_S, logs)
        marked = next(
            s
            for s in statuses
            if any(
                e.get("pod") == f"{name}-1" and e.get("state") == "stale" for e in s.get("endpoints") or []
            )
        )
        stale_ep = next(e for e in marked["endpoints"] if e["pod"] == f"{name}-1")
        assert not stale_ep["ready"] and stale_ep["weightsVersion"] == 0 and stale_ep["restarts"] >= 1
        assert [e["pod"] for e in marked["endpoints"] if e["ready"]] == [f"{name}-0"]  # out of the endpoints
        assert marked["weightsVersion"] == 4

        def readmitted() -> bool:
            eps = handle.get_all_endpoints()
            return len(eps) == 2 and all(e.ready and e.weights_version == 4 for e in eps)

        wait_for("the replica restored to 4 and back in the endpoints", readmitted, 60, logs)
        assert [e.pod for e in handle.get_endpoints()] == [f"{name}-0", f"{name}-1"]
        urls = {e.pod: e.url for e in handle.get_endpoints()}
        restored, version = scores(urls[f"{name}-1"])
        assert version == 4 and close(restored, scores(urls[f"{name}-0"])[0])
        assert close(restored, logits(model, tiny_model_dir, TEXTS))
        reasons = {
            e["reason"] for e in kube.list(core_path("events", ns)) if e["involvedObject"].get("name") == name
        }
        assert {"ReplicaStale", "ReplicaRestored"} <= reasons
    finally:
        stop.set()
        handle.close()


def test_cluster_adapter_push_through_the_operator(
    kube: Kube, operator: Any, node_agent: Any, ns: str, tiny_model_dir: Path, control_plane: Any
) -> None:
    """A RewardModel with spec.lora.enabled: its servers start with LoRA, a WeightSync of
    trainingMode adapter carries the LoRA A/B tensors, and the replica scores like the PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model

    from rewardplane.protocol import WeightSyncMode
    from rewardplane.sdk import LoraSync
    from tests.fixtures.trainer import load_model

    name = make_model(
        kube, ns, node_agent.name, tiny_model_dir, replicas=1, lora={"enabled": True, "maxRank": 8}
    )
    handle = RewardModelHandle(name, ns, kubeconfig=str(control_plane.kubeconfig))
    try:
        handle.wait_ready(SERVER_READY_S)
        model = get_peft_model(
            load_model(tiny_model_dir),
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["score"]),
        )
        with torch.no_grad():  # as if trained
            g = torch.Generator().manual_seed(11)
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
        sync = LoraSync(
            handle,
            mode="auto",
            fallback_to_full=False,
            push_options={"timeout_s": 60, "trainer_host": "127.0.0.1"},
        )
        assert sync.mode is WeightSyncMode.ADAPTER  # the RewardModel enables LoRA
        sync.sync(model, version=1)
        status = ws_status(kube, ns, name)
        assert (status["phase"], status["trainingMode"], status["version"]) == ("Completed", "adapter", 1)
        every_replica_scores_like(handle, model.eval(), tiny_model_dir, 1)
        # A successful push logs no C++ stack trace (c10d warns, with one, when the trainer closes
        # its rendezvous store under the server's wait for the next signal).
        for log in node_agent.state_dir.glob("pods/*/reward-server.log"):
            text = log.read_text(errors="replace")
            assert "frame #" not in text and "Exception raised from" not in text, text[-3000:]
    except Exception:
        print(operator.logs() + "\n" + node_agent.log_tail())
        raise
    finally:
        handle.close()


def last_wires(kube: Kube, ns: str, name: str, handle: RewardModelHandle) -> list[str]:
    """Each replica's wire of its last update (``last_update.wire``: sliced or broadcast)."""
    secret = kube.get(core_path("secrets", ns, token_secret_name(name))) or {}
    token = base64.b64decode(secret["data"][TOKEN_KEY]).decode()
    return [
        httpx.get(
            f"{e.url}/get_num_background_tasks", headers={"Authorization": f"Bearer {token}"}, timeout=10
        ).json()["last_update"]["wire"]
        for e in handle.get_all_endpoints()
    ]


def test_two_trainer_ranks_push_through_the_operator(
    kube: Kube,
    operator: Any,
    node_agent: Any,
    ns: str,
    tiny_model_dir: Path,
    control_plane: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an FSDP2 trainer of two processes: RewardModelHandle.push_weights(trainer_group=...) on each
    from tests.fixtures.trainer import run_sharded_trainers, sharded_model

    # The CPU engine keeps whole tensors, so ``auto`` broadcasts; forced, the replicas' workers and
    # the trainer's ranks agree on a sliced push once the workers know their places: they learn
    # them in the first push and publish them into the next push's new group as they join it.
    # With the Pod's own copy (podCopy, the default): each worker saves what it received.
    monkeypatch.setenv("REWARDPLANE_PUSH_SLICING", "always")
    with ready_rm(kube, ns, operator, node_agent, control_plane, tiny_model_dir, 2) as (name, handle, logs):
        results = run_sharded_trainers(
            tmp_path / "out",
            via="operator",
            name=name,
            namespace=ns,
            kubeconfig=str(control_plane.kubeconfig),
            model_dir=str(tiny_model_dir),
            layout="fsdp",
            versions=[1, 2],
        )
        for r in results:
            assert r is not None and r.get("error") is None and r["pushed"] == [1, 2], (r, logs()[-4000:])
        # both ranks return the same result: two replicas of one worker, then the trainer's two ranks
        assert results[0]["stats"] == results[1]["stats"]
        assert results[0]["stats"][-1]["world_size"] == 4 and results[0]["stats"][-1]["replicas"] == 2
        ws = kube.get(custom_path(ns, name, WS_PLURAL)) or {}
        assert ws["spec"]["trainer"] == {"ranks": 2, "interface": "lo", "agreeSlicing": True}
        status = ws["status"]
        assert (status["phase"], status["worldSize"], status["senders"]) == ("Completed", 4, 2)
        assert [(r["rankOffset"], r["phase"]) for r in status["replicas"]] == [
            (0, "Completed"),
            (1, "Completed"),
        ]
        assert get_rm(kube, ns, name)["status"]["weightsVersion"] == 2
        assert status["agreeSlicing"] is True and last_wires(kube, ns, name, handle) == ["sliced", "sliced"]
        every_replica_scores_like(handle, sharded_model(tiny_model_dir, 2), tiny_model_dir, 2)
        # a one-process push on the same WeightSync afterwards: the two ranks are not waited for
        model = perturbed(tiny_model_dir, seed=5)
        result = handle.push_weights(model.state_dict(), 3, "full", timeout_s=60, trainer_host="127.0.0.1")
        ws = kube.get(custom_path(ns, name, WS_PLURAL)) or {}
        assert ws["spec"]["trainer"] == {"ranks": 1, "agreeSlicing": True}  # the two ranks' spec cleared
        assert result.world_size == 3 and ws["status"]["senders"] == 1
        # one sender's layout (no pieces) is new to the workers: learned in this push, sliced next
        assert last_wires(kube, ns, name, handle) == ["broadcast", "broadcast"]
        every_replica_scores_like(handle, model, tiny_model_dir, 3)
        model = perturbed(tiny_model_dir, seed=6)
        handle.push_weights(model.state_dict(), 4, "full", timeout_s=60, trainer_host="127.0.0.1")
        assert last_wires(kube, ns, name, handle) == ["sliced", "sliced"]
        every_replica_scores_like(handle, model, tiny_model_dir, 4)
        # a trainer that never slices does not ask for the agreement: a broadcast, bit for bit alike
        monkeypatch.setenv("REWARDPLANE_PUSH_SLICING", "never")
        model = perturbed(tiny_model_dir, seed=7)
        handle.push_weights(model.state_dict(), 5, "full", timeout_s=60, trainer_host="127.0.0.1")
        ws = kube.get(custom_path(ns, name, WS_PLURAL)) or {}
        assert ws["spec"]["trainer"]["agreeSlicing"] is False and ws["status"]["agreeSlicing"] is False
        assert last_wires(kube, ns, name, handle) == ["broadcast", "broadcast"]
        every_replica_scores_like(handle, model, tiny_model_dir, 5)
        # examples/fsdp_push.py through the operator: two FSDP2 ranks under torchrun push version 6
        # and check the served scores against their own forward pass
        env = {k: v for k, v in os.environ.items() if k != "REWARDPLANE_PUSH_SLICING"}
        example = run_fsdp_example(
            *("--model", str(tiny_model_dir), "--reward-model", name, "--namespace", ns),
            *("--interface", "lo", "--trainer-host", "127.0.0.1", "--timeout-s", "60"),
            env={**env, "KUBECONFIG": str(control_plane.kubeconfig)},
        )
        assert example.returncode == 0, example.stdout[-3000:] + example.stderr[-3000:] + logs()[-3000:]
        assert "pushed version 6 from 2 ranks" in example.stdout, example.stdout
        assert get_rm(kube, ns, name)["status"]["weightsVersion"] == 6
