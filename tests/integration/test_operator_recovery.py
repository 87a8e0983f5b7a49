"""The operator brings replicas to the model's version by itself, and survives its own death
mid-push: a real kube-apiserver, the node agent running real servers, real gloo groups."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rewardplane.api.kube import Kube, core_path, custom_path
from rewardplane.transport import comm as transport_comm
from tests.fixtures.models import TEXTS
from tests.fixtures.operator import SERVER_READY_S, pods_of, start_operator, wait_for
from tests.fixtures.trainer import logits, perturbed
from tests.integration.test_cluster_push import WS_PLURAL, close, ready_rm, scores, ws_status

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _events(kube: Kube, ns: str, name: str) -> list[dict[str, Any]]:
    return [e for e in kube.list(core_path("events", ns)) if e["involvedObject"].get("name") == name]


def test_scaled_up_replica_gets_the_current_weights_from_a_peer_without_the_trainer(
    kube: Kube, operator: Any, node_agent: Any, ns: str, tiny_model_dir: Path, control_plane: Any
) -> None:
    """No persistDir: a replica added by scaling 1 → 2 starts on base weights; the operator has the
    healthy replica send it the current version over gloo, and the model becomes Ready."""
    with ready_rm(kube, ns, operator, node_agent, control_plane, tiny_model_dir, 1) as (name, handle, logs):
        model = perturbed(tiny_model_dir, seed=41)
        handle.push_weights(
            model.state_dict(), 2, "full", bucket_bytes=1 << 16, timeout_s=60, trainer_host="127.0.0.1"
        )
        scaled = time.monotonic()
        kube.merge_patch(custom_path(ns, name), {"spec": {"replicas": 2}})

        def both_on_2() -> bool:
            eps = handle.get_all_endpoints()
            return len(eps) == 2 and all(e.ready and e.weights_version == 2 for e in eps)

        wait_for("the new replica on version 2 and Ready", both_on_2, SERVER_READY_S, logs)
        print(f"scale 1 -> 2 to both replicas on the pushed version: {time.monotonic() - scaled:.1f}s")
        want = logits(model, tiny_model_dir, TEXTS)
        for ep in handle.get_all_endpoints():
            got, version = scores(ep.url)
            assert version == 2 and close(got, want), ep.pod
        reasons = [e["reason"] for e in _events(kube, ns, name)]
        assert "ReplicaRestoring" in reasons and "RestoreFailed" not in reasons
        rm = kube.get(custom_path(ns, name)) or {}
        assert rm["status"]["phase"] == "Ready" and rm["status"]["weightsVersion"] == 2


def test_operator_killed_mid_push_resumes_the_transfer_without_duplicates(
    kube: Kube,
    operator: Any,
    node_agent: Any,
    ns: str,
    tiny_model_dir: Path,
    control_plane: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with ready_rm(kube, ns, operator, node_agent, control_plane, tiny_model_dir, 2) as (name, handle, logs):
        before = {n: p["metadata"]["uid"] for n, p in pods_of(kube, ns, name).items()}
        assert len(before) == 2

        # A slow trainer (this process): every bucket takes 0.25 s, so the transfer lasts ~7 s.
        real = transport_comm.Communicator.broadcast

        def slow(self: Any, tensor: Any, src: int) -> None:
            time.sleep(0.25)
            real(self, tensor, src)

        monkeypatch.setattr(transport_comm.Communicator, "broadcast", slow)
        model = perturbed(tiny_model_dir, seed=51)
        result: dict[str, Any] = {}

        def push() -> None:
            try:
                result["ok"] = handle.push_weights(
                    model.state_dict(),
                    3,
                    "full",
                    bucket_bytes=1 << 14,
                    timeout_s=120,
                    trainer_host="127.0.0.1",
                )
            except Exception as exc:  # reported by the assertion below
                result["error"] = exc

        pusher = threading.Thread(target=push, daemon=True)
        pusher.start()
        wait_for(
            "the push Transferring",
            lambda: ws_status(kube, ns, name).get("phase") == "Transferring",
            60,
            logs,
        )
        operator.proc.send_signal(signal.SIGKILL)  # no clean shutdown: the process is gone
        operator.proc.wait(timeout=10)
        killed_at = time.monotonic()
        fresh = start_operator(control_plane.kubeconfig, tmp_path / "operator-2.log")
        # The fixture stops (and the namespace cleanup relies on) the operator now running.
        operator.proc, operator.log_path, operator.metrics_port = (
            fresh.proc,
            fresh.log_path,
            fresh.metrics_port,
        )

        pusher.join(timeout=150)
        assert not pusher.is_alive() and "error" not in result, (result, logs())
        status = ws_status(kube, ns, name)
        print(
            f"operator killed mid-transfer; push Completed {time.monotonic() - killed_at:.1f}s after the kill"
        )
        assert status["phase"] == "Completed" and status["version"] == 3
        assert [r["phase"] for r in status["replicas"]] == ["Completed", "Completed"]
        # No duplicate or replaced Pods: the same two, by UID.
        after = {n: p["metadata"]["uid"] for n, p in pods_of(kube, ns, name).items()}
        assert after == before
        assert len(kube.list(core_path("pods", ns), label_selector=f"rewardplane.io/model={name}")) == 2
        # The status was not lost: the new operator reports both replicas on version 3.
        wait_for(
            "the model Ready on version 3",
            lambda: (
                (kube.get(custom_path(ns, name)) or {}).get("status", {}).get("weightsVersion") == 3
                and (kube.get(custom_path(ns, name)) or {}).get("status", {}).get("phase") == "Ready"
            ),
            60,
            logs,
        )
        assert len(kube.list(custom_path(ns, plural=WS_PLURAL))) == 1
