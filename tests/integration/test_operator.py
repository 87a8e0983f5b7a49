"""The operator against a real kube-apiserver, with the node agent playing the kubelet."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from rewardplane.api.kube import Kube, KubeError, core_path, custom_path
from rewardplane.protocol import Endpoints
from tests.fixtures.operator import (
    DEFAULT_SERVER_IMAGE,
    SERVER_READY_S,
    WAIT_S,
    OperatorProcess,
    condition,
    get_rm,
    kubectl_get,
    kubectl_path,
    pods_of,
    reward_model,
    start_operator,
    stop_operator,
    wait_for,
)

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ schema


def test_invalid_fraction_is_refused_by_the_schema(kube: Kube, k8s_namespace: str) -> None:
    body = reward_model(
        "too-much",
        k8s_namespace,
        gpu={"mode": "shared", "node": "n", "deviceIds": [0], "memoryFraction": 1.5},
    )
    with pytest.raises(KubeError) as info:
        kube.create(custom_path(k8s_namespace), body)
    assert info.value.status == 422 and "memoryFraction" in str(info.value)


def test_schema_defaults_are_applied(kube: Kube, k8s_namespace: str) -> None:
    body = reward_model("defaults", k8s_namespace)
    del body["spec"]["gpu"]
    created = kube.create(custom_path(k8s_namespace), body)
    assert created is not None
    spec = created["spec"]
    assert spec["replicas"] == 1 and spec["gpu"]["memoryFraction"] == 0.9 and spec["ports"]["offset"] == 1
    kube.delete(custom_path(k8s_namespace, "defaults"))


# ------------------------------------------------------------------ reconcile


def test_pods_are_rendered_scaled_and_cleaned_up(
    kube: Kube, operator: OperatorProcess, node_agent: Any, ns: str
) -> None:
    body = reward_model("scorer", ns, replicas=1, gpu={"mode": "none", "node": node_agent.name})
    created = kube.create(custom_path(ns), body)
    assert created is not None
    wait_for("one pod", lambda: list(pods_of(kube, ns, "scorer")) == ["scorer-0"], logs=operator.logs)
    # Scale 1 → 3: replica i gets group port base + i and rank offset Σ tp of earlier replicas.
    kube.merge_patch(custom_path(ns, "scorer"), {"spec": {"replicas": 3}})
    pods = wait_for(
        "three pods", lambda: (p := pods_of(kube, ns, "scorer")) and len(p) == 3 and p, logs=operator.logs
    )
    assert [
        pods[f"scorer-{i}"]["metadata"]["annotations"]["rewardplane.io/group-port"] for i in range(3)
    ] == ["51217", "51218", "51219"]
    pod = pods["scorer-1"]
    assert pod["metadata"]["labels"]["rewardplane.io/replica"] == "1"
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "RewardModel",
        "scorer",
        created["metadata"]["uid"],
    )
    assert pod["spec"]["nodeName"] == node_agent.name
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--host") + 1] == "$(POD_IP)" and args[args.index("--engine") + 1] == "hf"
    assert kube.get(core_path("secrets", ns, "scorer-control-token")) is not None
    assert kube.get(core_path("services", ns, "scorer"))["spec"]["clusterIP"] == "None"
    rm = wait_for(
        "status endpoints",
        lambda: (
            len((get_rm(kube, ns, "scorer").get("status") or {}).get("endpoints") or []) == 3
            and get_rm(kube, ns, "scorer")
        ),
        logs=operator.logs,
    )
    assert (
        rm["status"]["ready"] == "0/3" and rm["status"]["observedGeneration"] == rm["metadata"]["generation"]
    )
    assert [e["rankOffset"] for e in sorted(rm["status"]["endpoints"], key=lambda e: e["pod"])] == [0, 1, 2]

    # Deleted pod → recreated.
    kube.delete(core_path("pods", ns, "scorer-0"))
    wait_for(
        "scorer-0 recreated",
        lambda: (
            "scorer-0" in pods_of(kube, ns, "scorer")
            and pods_of(kube, ns, "scorer")["scorer-0"]["metadata"]["uid"]
            != pods["scorer-0"]["metadata"]["uid"]
        ),
        logs=operator.logs,
    )

    # Scale 3 → 1, then change the spec → pods replaced.
    kube.merge_patch(custom_path(ns, "scorer"), {"spec": {"replicas": 1}})
    wait_for("scale down to 1", lambda: list(pods_of(kube, ns, "scorer")) == ["scorer-0"], logs=operator.logs)
    before = pods_of(kube, ns, "scorer")["scorer-0"]["metadata"]["annotations"]["rewardplane.io/spec-hash"]
    kube.merge_patch(custom_path(ns, "scorer"), {"spec": {"model": {"numLabels": 2}}})

    def replaced() -> bool:
        pod = pods_of(kube, ns, "scorer").get("scorer-0")
        return bool(pod) and pod["metadata"]["annotations"]["rewardplane.io/spec-hash"] != before

    wait_for("scorer-0 replaced after a spec change", replaced, logs=operator.logs)

    # Delete → every child gone (no garbage collector here: the operator deletes them).
    kube.delete(custom_path(ns, "scorer"))
    wait_for("the RewardModel gone", lambda: kube.get(custom_path(ns, "scorer")) is None, logs=operator.logs)
    wait_for(
        "children gone",
        lambda: (
            not kube.list(core_path("pods", ns), label_selector="rewardplane.io/model=scorer")
            and kube.get(core_path("services", ns, "scorer")) is None
            and kube.get(core_path("secrets", ns, "scorer-control-token")) is None
        ),
        logs=operator.logs,
    )


def test_overcommitted_device_ends_degraded_with_an_event(
    kube: Kube,
    operator: OperatorProcess,
    node_agent: Any,
    ns: str,
) -> None:
    # Zero replicas still claims nothing; one replica on device 0 claims 0.6 of it.
    gpu = {"mode": "shared", "node": node_agent.name, "deviceIds": [0], "memoryFraction": 0.6}
    kube.create(custom_path(ns), reward_model("first", ns, gpu=gpu))
    wait_for("first placed", lambda: pods_of(kube, ns, "first"), logs=operator.logs)
    kube.create(custom_path(ns), reward_model("second", ns, gpu=gpu))
    rm = wait_for(
        "second refused",
        lambda: (r := get_rm(kube, ns, "second")).get("status", {}).get("phase") == "Failed" and r,
        logs=operator.logs,
    )
    degraded = condition(rm, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "PlacementRefused"
    assert f"RewardModel {ns}/first 0.6" in degraded["message"] and "memoryFraction" in degraded["message"]
    assert not pods_of(kube, ns, "second")

    def warning_event() -> list[dict[str, Any]]:
        return [
            e
            for e in kube.list(core_path("events", ns))
            if e["involvedObject"].get("name") == "second"
            and e["type"] == "Warning"
            and e["reason"] == "PlacementRefused"
        ]

    events = wait_for("a Warning event on second", warning_event, logs=operator.logs)
    assert "over-committed" in events[0]["message"]
    time.sleep(3)  # several resync ticks: an unchanged refusal must not post more events
    assert len(warning_event()) == 1
    # Lowering the fraction fixes it.
    kube.merge_patch(custom_path(ns, "second"), {"spec": {"gpu": {"memoryFraction": 0.4}}})
    wait_for("second placed after the fix", lambda: pods_of(kube, ns, "second"), logs=operator.logs)


def test_kubectl_scale_moves_a_model_through_its_scale_subresource(
    kube: Kube, operator: OperatorProcess, node_agent: Any, ns: str, control_plane: Any
) -> None:
    """What kubectl scale, an HPA and KEDA use: /scale writes spec.replicas, and reads back the
    replicas the operator counts and the selector of the model's Pods. The model names no image:
    its Pods run the operator's default reward-server image."""
    scale = custom_path(ns, "scaled") + "/scale"
    kube.create(custom_path(ns), reward_model("scaled", ns, gpu={"mode": "none", "node": node_agent.name}))
    pods = wait_for("one pod", lambda: pods_of(kube, ns, "scaled"), logs=operator.logs)
    assert pods["scaled-0"]["spec"]["containers"][0]["image"] == DEFAULT_SERVER_IMAGE
    kubectl = kubectl_path()
    if kubectl:
        scaled = subprocess.run(
            [
                kubectl,
                "--kubeconfig",
                str(control_plane.kubeconfig),
                "scale",
                "rm/scaled",
                "-n",
                ns,
                "--replicas=3",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert scaled.returncode == 0 and "scaled" in scaled.stdout, scaled.stderr
    else:
        kube.merge_patch(scale, {"spec": {"replicas": 3}})
    assert get_rm(kube, ns, "scaled")["spec"]["replicas"] == 3
    wait_for("three pods", lambda: len(pods_of(kube, ns, "scaled")) == 3, logs=operator.logs)
    selector = "rewardplane.io/model=scaled,app.kubernetes.io/component=reward-server"
    got = wait_for(
        "the scale subresource's status",
        lambda: (s := kube.get(scale) or {}).get("status", {}).get("replicas") == 3 and s,
        logs=operator.logs,
    )
    assert got["kind"] == "Scale" and got["spec"]["replicas"] == 3 and got["status"]["selector"] == selector
    assert sorted(
        p["metadata"]["name"] for p in kube.list(core_path("pods", ns), label_selector=selector)
    ) == [
        "scaled-0",
        "scaled-1",
        "scaled-2",
    ]
    kube.merge_patch(scale, {"spec": {"replicas": 1}})  # as an HPA scaling down
    wait_for("scale down to 1", lambda: list(pods_of(kube, ns, "scaled")) == ["scaled-0"], logs=operator.logs)
    wait_for(
        "status.replicas back to 1",
        lambda: (kube.get(scale) or {}).get("status", {}).get("replicas") == 1,
        logs=operator.logs,
    )


def test_a_model_without_an_image_waits_degraded_when_the_operator_has_no_default(
    kube: Kube, control_plane: Any, node_agent: Any, k8s_namespace: str, tmp_path: Path
) -> None:
    ns = k8s_namespace
    handle = start_operator(control_plane.kubeconfig, tmp_path / "operator-no-image.log", default_image=None)
    try:
        kube.create(
            custom_path(ns), reward_model("imageless", ns, gpu={"mode": "none", "node": node_agent.name})
        )
        rm = wait_for(
            "imageless Degraded with reason NoImage",
            lambda: (r := get_rm(kube, ns, "imageless")).get("status", {}).get("reason") == "NoImage" and r,
            logs=handle.logs,
        )
        assert rm["status"]["phase"] == "Degraded" and "serverImage" in condition(rm, "Degraded")["message"]
        assert not pods_of(kube, ns, "imageless")  # no Pod that could never pull its image
        kube.merge_patch(custom_path(ns, "imageless"), {"spec": {"engine": {"image": "localhost/own:1"}}})
        pods = wait_for(
            "a pod once the spec names an image", lambda: pods_of(kube, ns, "imageless"), logs=handle.logs
        )
        assert pods["imageless-0"]["spec"]["containers"][0]["image"] == "localhost/own:1"
        kube.delete(custom_path(ns, "imageless"))
        wait_for("imageless deleted", lambda: kube.get(custom_path(ns, "imageless")) is None, 30, handle.logs)
    finally:
        stop_operator(handle)


def test_operator_metrics(operator: OperatorProcess) -> None:
    # asked as Prometheus asks (OpenMetrics first): the names keep their ':' all the same
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    r = httpx.get(f"http://127.0.0.1:{operator.metrics_port}/metrics", headers={"Accept": accept}, timeout=5)
    for name in ("rewardplane:operator_reconcile_duration_seconds_count", "rewardplane:operator_queue_depth"):
        assert f"\n{name} " in r.text, name


@pytest.mark.slow
def test_tiny_model_becomes_ready_with_endpoints(
    kube: Kube,
    operator: OperatorProcess,
    node_agent: Any,
    ns: str,
    tiny_model_dir: Path,
    control_plane: Any,
) -> None:
    name = f"tiny-{uuid.uuid4().hex[:4]}"
    body = reward_model(name, ns, gpu={"mode": "none", "node": node_agent.name})
    body["spec"]["model"] = {"source": str(tiny_model_dir), "dtype": "float32"}
    kube.create(custom_path(ns), body)
    rm = wait_for(
        f"{name} Ready",
        lambda: (r := get_rm(kube, ns, name)).get("status", {}).get("phase") == "Ready" and r,
        SERVER_READY_S,
        lambda: operator.logs() + "\n" + node_agent.log_tail(),
    )
    (endpoint,) = rm["status"]["endpoints"]
    assert endpoint["ready"] and endpoint["weightsVersion"] == 0 and rm["status"]["readyReplicas"] == 1
    health = httpx.get(endpoint["url"] + Endpoints.HEALTH, timeout=5).json()
    assert health["type"] == "reward_model"
    assert (
        condition(rm, "Available")["status"] == "True" and condition(rm, "WeightsInSync")["status"] == "True"
    )

    table = kubectl_get(control_plane, "rm", ns)
    if table:
        header, row = table
        assert header.split() == [
            "NAME",
            "READY",
            "PHASE",
            "REASON",
            "MODEL",
            "KIND",
            "VERSION",
            "GPU-FRAC",
            "CONFIRMED",
            "AGE",
        ]
        # REASON is empty when Ready, GPU-FRAC for a model on CPU (gpu.mode none): the row goes on
        # with CONFIRMED and AGE; KIND is the CRD's default.
        cells = row.split()
        assert cells[:6] == [name, "1/1", "Ready", str(tiny_model_dir), "sequence", "0"] and len(cells) == 8

    # A killed server process is restarted by the node agent; the status follows.
    pod_ip = pods_of(kube, ns, name)[f"{name}-0"]["status"]["podIP"]
    killed = subprocess.run(["pkill", "-9", "-f", f"rewardplane.server .*--host {pod_ip} "], timeout=10)
    assert killed.returncode == 0, f"no server process found for {pod_ip}"

    def restarted_and_ready() -> bool:
        pod = pods_of(kube, ns, name).get(f"{name}-0") or {}
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
        status = get_rm(kube, ns, name).get("status") or {}
        return (
            statuses[0].get("restartCount", 0) >= 1
            and status.get("phase") == "Ready"
            and bool(status.get("endpoints"))
            and status["endpoints"][0]["ready"]
        )

    wait_for(
        "the killed server restarted and Ready",
        restarted_and_ready,
        SERVER_READY_S,
        lambda: operator.logs() + node_agent.log_tail(),
    )

    # A deleted Pod comes back, and the status follows it down and up again.
    old_uid = pods_of(kube, ns, name)[f"{name}-0"]["metadata"]["uid"]
    kube.delete(core_path("pods", ns, f"{name}-0"))

    def ready_again() -> bool:
        pod = pods_of(kube, ns, name).get(f"{name}-0")
        status = get_rm(kube, ns, name).get("status") or {}
        return (
            bool(pod)
            and pod["metadata"]["uid"] != old_uid
            and status.get("phase") == "Ready"
            and (status["endpoints"][0]["pod"] == f"{name}-0" and status["endpoints"][0]["ready"])
        )

    wait_for(
        "the replaced pod Ready", ready_again, SERVER_READY_S, lambda: operator.logs() + node_agent.log_tail()
    )


def test_kubectl_explain_and_apply(
    kube: Kube, control_plane: Any, k8s_namespace: str, tmp_path: Path
) -> None:
    kubectl = kubectl_path()
    if kubectl is None:
        pytest.skip("kubectl not installed (scripts/install-k8s-tools.sh installs it)")
    base = [kubectl, "--kubeconfig", str(control_plane.kubeconfig)]

    def explain() -> str:
        # The API server publishes a new CRD's OpenAPI schema a few seconds after it is Established.
        out = subprocess.run(
            [*base, "explain", "rewardmodel.spec.gpu.memoryFraction"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout if out.returncode == 0 else ""

    assert "gpu-memory-utilization" in wait_for("kubectl explain", explain, WAIT_S)
    manifest = tmp_path / "bad.yaml"
    bad = reward_model("bad-fraction", k8s_namespace, gpu={"mode": "exclusive", "memoryFraction": 1.5})
    manifest.write_text(yaml.safe_dump(bad))
    applied = subprocess.run(
        [*base, "apply", "-f", str(manifest)], capture_output=True, text=True, timeout=30
    )
    assert applied.returncode != 0 and "memoryFraction" in applied.stderr


def test_operator_runs_with_the_charts_rbac(
    kube: Kube,
    control_plane: Any,
    node_agent: Any,
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    """Install the chart, then run the operator as its ServiceAccount: the ClusterRole must be enough."""
    helm = Path.home() / ".cache" / "rewardplane" / "bin" / "helm"
    helm_bin = str(helm) if helm.exists() else shutil.which("helm")
    if helm_bin is None:
        pytest.skip("helm not installed (scripts/install-k8s-tools.sh installs it)")
    ns, release = k8s_namespace, f"rp-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig)}
    installed = subprocess.run(
        [helm_bin, "install", release, str(ROOT / "charts" / "rewardplane"), "-n", ns, "--skip-crds"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert installed.returncode == 0, installed.stderr
    try:
        account = f"{release}-rewardplane"
        token = kube._call(
            "POST",
            core_path("serviceaccounts", ns, account) + "/token",
            json={"spec": {"expirationSeconds": 3600}},
        )["status"]["token"]
        config = yaml.safe_load(control_plane.kubeconfig.read_text())
        for user in config["users"]:
            user["user"] = {"token": token}
        kubeconfig = tmp_path / "operator-sa.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))
        handle = start_operator(kubeconfig, tmp_path / "operator-sa.log")
        try:
            kube.create(
                custom_path(ns), reward_model("rbac", ns, gpu={"mode": "none", "node": node_agent.name})
            )
            wait_for(
                "pod and status written as the ServiceAccount",
                lambda: (
                    pods_of(kube, ns, "rbac") and (get_rm(kube, ns, "rbac").get("status") or {}).get("phase")
                ),
                logs=handle.logs,
            )
            kube.delete(custom_path(ns, "rbac"))
            wait_for(
                "cleanup as the ServiceAccount",
                lambda: (
                    kube.get(custom_path(ns, "rbac")) is None
                    and kube.get(core_path("secrets", ns, "rbac-control-token")) is None
                ),
                logs=handle.logs,
            )
            assert 'User "system:serviceaccount' not in handle.log_path.read_text(), "RBAC denied a call"
        finally:
            stop_operator(handle)
    finally:
        subprocess.run([helm_bin, "uninstall", release, "-n", ns], capture_output=True, timeout=120, env=env)
