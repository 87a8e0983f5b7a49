"""The real-node end-to-end suite: what a user of ``helm install`` + ``kubectl apply`` depends on,
on a real kubelet + containerd running the images built from this repository.

The tests run in file order and share one cluster and one RewardModel (the steps of a user's
session); the last test brings the node down and checks that nothing is left on the machine.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from rewardplane.localcluster import realnode
from rewardplane.localcluster.binaries import find_binary
from rewardplane.localcluster.dev import helm_install_operator, local_image_tag
from rewardplane.localcluster.diagnose import describe_namespace
from rewardplane.protocol.steps import probability
from rewardplane.sdk import RewardClient
from rewardplane.tinymodel import PRM_STEP_TAG, build_tiny_process_reward_model, build_tiny_reward_model
from tests.e2e.chaos import Freezer, SdkScoring, TrainerHold
from tests.e2e.conftest import OPERATOR_NAMESPACE, OPERATOR_RELEASE, RealCluster, wait_for
from tests.e2e.model_stores import (
    BUCKET,
    HTTP_AUTHORIZATION,
    HUB_REPO,
    HUB_TOKEN,
    Stores,
    fetch_progress,
    secret_body,
    start_stores,
)
from tests.e2e.service_watch import ServiceWatch
from tests.fixtures.models import (
    PRM_QUESTION,
    PRM_SOLUTION,
    TEXTS,
    load_process_reward_model,
    step_log_odds,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NS = "default"
RM = "e2e-rm"
GROUP, VERSION = "rewardplane.io", "v1alpha1"
MODEL_CLAIM = "models"
TRAINER_SA = "rewardplane-trainer"  # examples/trainer-rbac.yaml's ServiceAccount
RUN_AS = 65532
SCORE_TOL = 2e-3
READY_TIMEOUT_S = 240
RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


# ------------------------------------------------------------------------------------ helpers
def server_image() -> str:
    return f"localhost/rewardplane/reward-server:{local_image_tag()}"


def rm_body(
    replicas: int,
    source: str,
    persist_dir: str | None,
    name: str = RM,
    interface: str | None = None,
    host_ipc: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {
            "source": source,
            "servedName": name,
            "dtype": "float32",
            "numLabels": 1,
            "pooling": "last",
        },
        "engine": {"kind": "hf", "image": server_image(), "imagePullPolicy": "Never"},
        "replicas": replicas,
        "gpu": {"mode": "none"},
        "resources": RESOURCES,
    }
    if persist_dir:
        spec["weightSync"] = {"persistDir": persist_dir}
    if interface or host_ipc:
        spec["transport"] = {
            **({"interface": interface} if interface else {}),
            **({"hostIPC": True} if host_ipc else {}),
        }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RewardModel",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


def get_rm(c: RealCluster, name: str = RM) -> dict[str, Any]:
    return c.custom.get_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", name)


def model_pods(c: RealCluster, name: str = RM) -> list[Any]:
    return c.core.list_namespaced_pod(NS, label_selector=f"rewardplane.io/model={name}").items


class NotReady(str):
    """Falsy: what the status said instead, so a timed-out wait says why (``wait_for``'s last)."""

    def __bool__(self) -> bool:
        return False


def ready_at(
    c: RealCluster, replicas: int, version: int | None = None, name: str = RM
) -> dict[str, Any] | NotReady:
    """The RewardModel once ``replicas`` replicas serve (at ``version``) and no other pod exists."""
    rm = get_rm(c, name)
    st = rm.get("status") or {}
    eps = [e for e in st.get("endpoints") or [] if e.get("ready")]
    pods = model_pods(c, name)
    wrong_count = st.get("readyReplicas") != replicas or len(eps) != replicas or len(pods) != replicas
    if wrong_count or (
        version is not None
        and (st.get("weightsVersion") != version or any(e.get("weightsVersion") != version for e in eps))
    ):
        endpoints = [
            {k: e.get(k) for k in ("pod", "ready", "state", "weightsVersion")}
            for e in st.get("endpoints") or []
        ]
        return NotReady(
            f"phase {st.get('phase')} ({st.get('reason')}), readyReplicas {st.get('readyReplicas')}, "
            f"weightsVersion {st.get('weightsVersion')}, endpoints {endpoints}, "
            f"pods {sorted(p.metadata.name for p in pods)}"
        )
    return rm


def service_watch(c: RealCluster, allowed: set[int], name: str = RM) -> ServiceWatch:
    return ServiceWatch(c.core, name, NS, set(allowed))


def handle(c: RealCluster) -> Any:
    from rewardplane.sdk.cluster import RewardModelHandle

    return RewardModelHandle(RM, NS, kubeconfig=c.kubeconfig)


def load_model(path: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    return (
        AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(path),
    )


def scores_of(model: Any, tok: Any, texts: list[str]) -> list[float]:
    import torch

    with torch.inference_mode():
        return [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def assert_scores(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst < SCORE_TOL, f"served scores differ from the trainer's model by {worst:.2e}: {got} vs {want}"


def run_tool(c: RealCluster, tool: str, *args: str, timeout: float, stdin: str | None = None) -> str:
    """``tool`` (kubectl, helm) on the cluster's kubeconfig; its stdout, or the test fails with
    its stderr."""
    done = subprocess.run(
        [str(find_binary(tool)), "--kubeconfig", str(c.kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{tool} {' '.join(args)}: {done.stderr}"
    return done.stdout


def kubectl(c: RealCluster, *args: str, timeout: float = 120) -> str:
    return run_tool(c, "kubectl", *args, timeout=timeout)


def kubectl_apply(c: RealCluster, obj: dict[str, Any]) -> str:
    """``kubectl apply -f -`` of one object, as a user would."""
    return run_tool(c, "kubectl", "apply", "-f", "-", timeout=60, stdin=json.dumps(obj))


def helm(c: RealCluster, *args: str, timeout: float = 360) -> str:
    return run_tool(c, "helm", *args, timeout=timeout)


def table_column(table: str, row: str, column: str) -> str:
    """The value in ``column`` of the row named ``row`` of a ``kubectl get`` table (read at the
    header's offset: kubectl aligns the columns, and an empty one, as REASON is when Ready, leaves
    no word to count)."""
    header, *rows = table.splitlines()
    at = header.index(column)
    [line] = [r for r in rows if r.split()[0] == row]
    return line[at:].split()[0]


# ------------------------------------------------------------------------------------ state
class Session:
    """What the steps hand on to each other (one user session)."""

    model_dir: Path
    expected: list[float]
    version: int = 0


S = Session()


# ------------------------------------------------------------------------------------ steps
def test_operator_runs_in_cluster_from_the_chart(real_cluster: RealCluster) -> None:
    c = real_cluster
    dep = c.apps.read_namespaced_deployment(OPERATOR_RELEASE, OPERATOR_NAMESPACE)
    assert dep.status.available_replicas == 1
    [pod] = c.core.list_namespaced_pod(
        OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/component=operator"
    ).items
    # exactly the chart's ServiceAccount (whose ClusterRole is all it gets), and the local image
    assert pod.spec.service_account_name == OPERATOR_RELEASE
    assert pod.spec.containers[0].image == f"localhost/rewardplane/operator:{local_image_tag()}"
    status = pod.status.container_statuses[0]
    assert status.ready and status.container_id.startswith("containerd://")
    assert pod.spec.security_context.run_as_user == RUN_AS

    # what a failed `helm install` reports beside helm's "not ready": the pods, events and logs
    # (a just-started operator may not have logged yet: polled until it has)
    def report_with_logs() -> tuple[str, str] | None:
        pods, _, logs = describe_namespace(c.kubeconfig, OPERATOR_NAMESPACE).partition("--- logs in")
        # the operator's first line, prefixed with its pod and container
        first = f"[pod/{pod.metadata.name}/operator]"
        starting = "rewardplane operator starting: watching all namespaces"
        return (pods, logs) if any(first in ln and starting in ln for ln in logs.splitlines()) else None

    pods, _ = wait_for("the operator's log in the namespace report", report_with_logs, 60, 2)
    assert pod.metadata.name in pods and "Running" in pods, pods


def test_rewardmodel_from_a_volume_becomes_ready(real_cluster: RealCluster) -> None:
    c = real_cluster
    models = c.volumes / "models"
    S.model_dir = build_tiny_reward_model(models / "tiny-rm", num_labels=1, seed=0)
    weights = c.volumes / "weights"  # pushed weights persist here (a hostPath), for restores
    # The model reaches the pods the way clusters deliver models: a PersistentVolumeClaim
    # (bound by the controller-manager to a hostPath PersistentVolume made for the test).
    c.core.create_persistent_volume(
        {
            "metadata": {"name": "e2e-models"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "e2e",
                "hostPath": {"path": str(models), "type": "Directory"},
                "claimRef": {"namespace": NS, "name": MODEL_CLAIM},
            },
        }
    )
    c.core.create_namespaced_persistent_volume_claim(
        NS,
        {
            "metadata": {"name": MODEL_CLAIM},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "e2e",
                "volumeName": "e2e-models",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    c.custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        "rewardmodels",
        # the pushes below (gloo) run over the interface the spec names: the Pod network's eth0;
        # hostIPC lets a trainer Pod on this node push through shared memory instead
        rm_body(2, f"pvc://{MODEL_CLAIM}/tiny-rm", str(weights), interface="eth0", host_ipc=True),
    )
    rm = wait_for("2 ready replicas", lambda: ready_at(c, 2), READY_TIMEOUT_S, 2)
    assert {c["type"]: c["status"] for c in rm["status"]["conditions"]}["Available"] == "True"

    for pod in model_pods(c):
        ctr = pod.spec.containers[0]
        assert pod.status.container_statuses[0].container_id.startswith("containerd://")
        assert ctr.image == server_image()
        assert ctr.resources.requests == RESOURCES["requests"] and ctr.resources.limits == RESOURCES["limits"]
        # ready (in the Service) only once the operator admitted it at the model's weights version
        assert ctr.readiness_probe.http_get.path == "/ready" and ctr.liveness_probe.http_get.path == "/health"
        # least privilege (with persistDir the server runs as root: the hostPath is root's)
        assert ctr.security_context.read_only_root_filesystem and ctr.security_context.capabilities.drop == [
            "ALL"
        ]
        secret_volumes = [v for v in pod.spec.volumes if v.secret is not None]
        assert [v.secret.secret_name for v in secret_volumes] == [f"{RM}-control-token"]
        assert "--token-file" in ctr.args and pod.status.pod_ip.startswith("10.244.0.")
        env = {e.name: e.value for e in ctr.env}
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"
    # the address each replica's NCCL (here gloo) uses: the Pod's, on the Pod network
    ips = {p.metadata.name: p.status.pod_ip for p in model_pods(c)}
    assert {e["pod"]: e["ncclAddress"] for e in rm["status"]["endpoints"]} == ips


def test_score_from_the_host(real_cluster: RealCluster) -> None:
    model, tok = load_model(S.model_dir)
    S.expected = scores_of(model, tok, TEXTS)
    with handle(real_cluster) as rm:
        assert len(rm.get_urls()) == 2  # pod IPs, reached from the host over the node's bridge
        assert_scores(rm.client().score_batch(TEXTS, normalize=False), S.expected)


def test_pushes_from_a_trainer_on_the_host(real_cluster: RealCluster) -> None:
    import torch

    from rewardplane.sdk import RewardModelTrainingMode, select_head

    model, tok = load_model(S.model_dir)
    # Scored through the Service throughout: while a push is in flight the old or the new version,
    # never anything else.
    with handle(real_cluster) as rm, service_watch(real_cluster, {0, 1}) as watch:
        with torch.no_grad():
            model.score.weight.mul_(-1.0)
        result = rm.push_weights(
            select_head(model.state_dict()), 1, RewardModelTrainingMode.HEAD_ONLY, timeout_s=120
        )
        assert result.replicas == 2
        assert_scores(rm.client().score_batch(TEXTS, normalize=False), scores_of(model, tok, TEXTS))
        watch.allowed = {1, 2}
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        rm.push_weights(model.state_dict(), 2, RewardModelTrainingMode.FULL, timeout_s=120)
        S.expected = scores_of(model, tok, TEXTS)
        assert_scores(rm.client().score_batch(TEXTS, normalize=False), S.expected)
    watch.check(min_answers=10)
    S.version = 2


TRAINER_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForSequenceClassification
from rewardplane.sdk import RewardModelTrainingMode, select_head
from rewardplane.sdk.cluster import RewardModelHandle

name, texts = sys.argv[1], json.loads(sys.argv[2])
rm = RewardModelHandle(name, "default")  # in-cluster credentials: the pod's ServiceAccount
rm.wait_ready(timeout_s=120)
model = AutoModelForSequenceClassification.from_pretrained("/mnt/models/tiny-rm", dtype=torch.float32)
v = rm.get_weights_version()
with torch.no_grad():
    model.score.weight.mul_(2.0)
rm.push_weights(select_head(model.state_dict()), v + 1, RewardModelTrainingMode.HEAD_ONLY, timeout_s=120)
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.01)
rm.push_weights(model.state_dict(), v + 2, RewardModelTrainingMode.FULL, timeout_s=120)
print("RESULT " + json.dumps({"version": rm.get_weights_version(),
                              "scores": rm.client().score_batch(texts, normalize=False)}), flush=True)
"""


def trainer_pod(name: str, script_config_map: str, args: list[str]) -> dict[str, Any]:
    """A Pod of the trainer image running ``/scripts/trainer.py`` from ``script_config_map``, with the
    model volume and the trainer's ServiceAccount (made by the one-Pod trainer step)."""
    return {
        "metadata": {"name": name},
        "spec": {
            "serviceAccountName": TRAINER_SA,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "trainer",
                    "image": f"localhost/rewardplane/trainer:{local_image_tag()}",
                    "imagePullPolicy": "Never",
                    "args": ["/scripts/trainer.py", *args],
                    "volumeMounts": [
                        {"name": "scripts", "mountPath": "/scripts"},
                        {"name": "models", "mountPath": "/mnt/models", "readOnly": True},
                    ],
                }
            ],
            "volumes": [
                {"name": "scripts", "configMap": {"name": script_config_map}},
                {"name": "models", "persistentVolumeClaim": {"claimName": MODEL_CLAIM, "readOnly": True}},
            ],
        },
    }


def apply_trainer_rbac(c: RealCluster, model: str) -> None:
    """examples/trainer-rbac.yaml in NS, its token Secret's name made ``model``'s (what its header
    tells users to do; the RoleBinding's subject left without a namespace, as in the file)."""
    import yaml
    from kubernetes import client

    from rewardplane.api.names import token_secret_name

    rbac = client.RbacAuthorizationV1Api(c.api)
    example = Path(__file__).resolve().parents[2] / "examples" / "trainer-rbac.yaml"
    for doc in yaml.safe_load_all(example.read_text()):
        if doc["kind"] == "ServiceAccount":
            assert doc["metadata"]["name"] == TRAINER_SA
            c.core.create_namespaced_service_account(NS, doc)
        elif doc["kind"] == "Role":
            for rule in doc["rules"]:
                if "resourceNames" in rule:
                    rule["resourceNames"] = [token_secret_name(model)]
            rbac.create_namespaced_role(NS, doc)
        else:
            rbac.create_namespaced_role_binding(NS, doc)


def test_pushes_from_a_trainer_pod_over_the_pod_network(real_cluster: RealCluster) -> None:
    c = real_cluster
    # What a trainer needs, and nothing more (read the model, drive its WeightSync, store the
    # parameter manifest, read the control token): examples/trainer-rbac.yaml, as users apply it
    apply_trainer_rbac(c, RM)
    c.core.create_namespaced_config_map(
        NS, {"metadata": {"name": "e2e-trainer"}, "data": {"trainer.py": TRAINER_SCRIPT}}
    )
    c.core.create_namespaced_pod(NS, trainer_pod("e2e-trainer", "e2e-trainer", [RM, json.dumps(TEXTS)]))

    def finished() -> str | None:
        phase = c.core.read_namespaced_pod("e2e-trainer", NS).status.phase
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_for("the trainer pod to finish", finished, 300, 2)
    logs = c.core.read_namespaced_pod_log("e2e-trainer", NS)  # through the kubelet
    assert phase == "Succeeded", logs[-3000:]
    result = json.loads(next(line for line in logs.splitlines() if line.startswith("RESULT "))[7:])
    model, tok = trainer_pod_model()
    S.expected = scores_of(model, tok, TEXTS)
    S.version += 2
    assert result["version"] == S.version
    assert_scores(result["scores"], S.expected)
    # the replicas reached the trainer at its pod IP: the rendezvous the operator handed out
    ws = c.custom.get_namespaced_custom_object(GROUP, VERSION, NS, "weightsyncs", RM)
    trainer_ip = c.core.read_namespaced_pod("e2e-trainer", NS).status.pod_ip
    assert ws["spec"]["rendezvous"]["address"] == trainer_ip and ws["status"]["phase"] == "Completed"
    c.core.delete_namespaced_pod("e2e-trainer", NS, grace_period_seconds=0)


SHARDED_TRAINER_SCRIPT = """
import json, sys, torch
import torch.distributed as dist
from transformers import AutoModelForSequenceClassification
from rewardplane.sdk import RewardModelTrainingMode, TensorPiece
from rewardplane.sdk.cluster import RewardModelHandle

name, rank, master = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://{master}:29500", rank=rank, world_size=2)
rm = RewardModelHandle(name, "default")
rm.wait_ready(timeout_s=120)
model = AutoModelForSequenceClassification.from_pretrained("/mnt/models/tiny-rm", dtype=torch.float32)
with torch.no_grad():
    model.score.weight.mul_(2.0)
    for p in model.parameters():
        p.add_(0.02)
version = rm.get_weights_version() + 1
# each rank holds half of every tensor whose rows split evenly (FSDP's layout), the rest whole
state = {
    k: TensorPiece.even(t.chunk(2)[rank].clone(), 0, rank, 2) if t.dim() and t.shape[0] % 2 == 0 else t
    for k, t in model.state_dict().items()
}
r = rm.push_weights(state, version, RewardModelTrainingMode.FULL, timeout_s=120,
                    trainer_group=dist.group.WORLD, interface="eth0")
print("RESULT " + json.dumps({"rank": rank, "version": r.version, "world_size": r.world_size}), flush=True)
"""


def test_two_trainer_pods_push_their_halves(real_cluster: RealCluster) -> None:
    # A trainer of two Pods (a gloo group over the Pod network): each sends its own half of every
    # split tensor into the replicas, through the operator (spec.trainer.ranks 2). Uses the
    # ServiceAccount the one-Pod trainer step made.
    c = real_cluster
    c.core.create_namespaced_config_map(
        NS, {"metadata": {"name": "e2e-sharded"}, "data": {"trainer.py": SHARDED_TRAINER_SCRIPT}}
    )

    # rank 0 hosts the trainer group's rendezvous; rank 1 is told its Pod IP
    c.core.create_namespaced_pod(NS, trainer_pod("e2e-sharded-0", "e2e-sharded", [RM, "0", "0.0.0.0"]))
    master = wait_for(
        "trainer rank 0's Pod IP",
        lambda: c.core.read_namespaced_pod("e2e-sharded-0", NS).status.pod_ip,
        120,
        0.5,
    )
    c.core.create_namespaced_pod(NS, trainer_pod("e2e-sharded-1", "e2e-sharded", [RM, "1", master]))

    def finished() -> list[str] | None:
        phases = [c.core.read_namespaced_pod(f"e2e-sharded-{r}", NS).status.phase for r in (0, 1)]
        done = all(p in ("Succeeded", "Failed") for p in phases)
        return phases if done else None

    phases = wait_for("both trainer pods to finish", finished, 300, 2)
    logs = [c.core.read_namespaced_pod_log(f"e2e-sharded-{r}", NS) for r in (0, 1)]
    assert phases == ["Succeeded", "Succeeded"], "\n---\n".join(log[-3000:] for log in logs)
    results = [
        json.loads(next(ln for ln in log.splitlines() if ln.startswith("RESULT "))[7:]) for log in logs
    ]
    S.version += 1
    assert [r["version"] for r in results] == [S.version, S.version]
    ws = c.custom.get_namespaced_custom_object(GROUP, VERSION, NS, "weightsyncs", RM)
    status = ws["status"]
    replicas = len(status["replicas"])
    assert ws["spec"]["trainer"] == {"ranks": 2, "interface": "eth0", "agreeSlicing": True}
    assert (status["phase"], status["senders"], status["worldSize"]) == ("Completed", 2, replicas + 2)
    assert results[0]["world_size"] == results[1]["world_size"] == replicas + 2
    import torch

    model, tok = trainer_pod_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # the two-Pod trainer's weights: the one-Pod trainer's, plus 0.01
    S.expected = scores_of(model, tok, TEXTS)
    rm = handle(c)
    try:
        assert rm.get_weights_version() == S.version
        assert_scores(rm.client().score_batch(TEXTS, normalize=False), S.expected)
    finally:
        rm.close()
    for r in (0, 1):
        c.core.delete_namespaced_pod(f"e2e-sharded-{r}", NS, grace_period_seconds=0)


COLOCATED_TRAINER_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForSequenceClassification
from rewardplane.sdk import RewardModelTrainingMode
from rewardplane.sdk.cluster import RewardModelHandle

name, texts = sys.argv[1], json.loads(sys.argv[2])
rm = RewardModelHandle(name, "default")
rm.wait_ready(timeout_s=120)
model = AutoModelForSequenceClassification.from_pretrained("/mnt/models/tiny-rm", dtype=torch.float32)
with torch.no_grad():
    model.score.weight.mul_(-1.5)
    for p in model.parameters():
        p.add_(0.005)
r = rm.push_weights(model.state_dict(), rm.get_weights_version() + 1, RewardModelTrainingMode.FULL,
                    timeout_s=120, backend="ipc")
print("RESULT " + json.dumps({"version": r.version, "transport": r.transport,
                              "scores": rm.client().score_batch(texts, normalize=False)}), flush=True)
"""


def colocated_model() -> tuple[Any, Any]:
    """The model the colocated trainer Pod pushes."""
    import torch

    model, tok = load_model(S.model_dir)
    with torch.no_grad():
        model.score.weight.mul_(-1.5)
        for p in model.parameters():
            p.add_(0.005)
    return model, tok


def test_a_trainer_pod_on_the_replicas_node_pushes_through_shared_memory(real_cluster: RealCluster) -> None:
    # spec.transport.hostIPC puts the replicas in the node's IPC namespace; a trainer Pod with
    # hostIPC asks for backend ipc: the bytes go through the node's /dev/shm, not the Pod network.
    # The trainer runs as the image's user, the replicas as root without capabilities (persistDir).
    c = real_cluster
    assert all(p.spec.host_ipc for p in model_pods(c))
    c.core.create_namespaced_config_map(
        NS, {"metadata": {"name": "e2e-colocated"}, "data": {"trainer.py": COLOCATED_TRAINER_SCRIPT}}
    )
    pod = trainer_pod("e2e-colocated", "e2e-colocated", [RM, json.dumps(TEXTS)])
    pod["spec"]["hostIPC"] = True
    c.core.create_namespaced_pod(NS, pod)

    def finished() -> str | None:
        phase = c.core.read_namespaced_pod("e2e-colocated", NS).status.phase
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_for("the colocated trainer pod to finish", finished, 300, 2)
    logs = c.core.read_namespaced_pod_log("e2e-colocated", NS)
    assert phase == "Succeeded", logs[-3000:]
    result = json.loads(next(line for line in logs.splitlines() if line.startswith("RESULT "))[7:])
    S.version += 1
    S.expected = scores_of(*colocated_model(), TEXTS)
    assert (result["version"], result["transport"]) == (S.version, "ipc"), result
    assert_scores(result["scores"], S.expected)
    ws = c.custom.get_namespaced_custom_object(GROUP, VERSION, NS, "weightsyncs", RM)
    assert ws["status"]["phase"] == "Completed"
    # every staging file of the push's group is gone from the node's /dev/shm
    assert not glob.glob(f"/dev/shm/rewardplane-{ws['status']['groupId']}-*")
    c.core.delete_namespaced_pod("e2e-colocated", NS, grace_period_seconds=0)


def _container_port(pod: Any, name: str) -> int:
    return next(p.container_port for p in pod.spec.containers[0].ports if p.name == name)


def test_prometheus_sees_a_push_and_every_dashboard_panel_has_data(
    real_cluster: RealCluster, tmp_path: Path
) -> None:
    # Debian's prometheus on the host scrapes both replicas and the operator (tests/e2e/prometheus.py).
    # After a push, PromQL shows every replica moving to the pushed version, and every query of
    # the chart's Grafana dashboard returns data. `rewardplane push --timeline`'s picture is
    # drawn from the same push.
    import torch
    from PIL import Image

    from rewardplane.sdk import RewardModelTrainingMode
    from rewardplane.sdk.cli import write_timeline
    from tests.e2e.prometheus import Prometheus, Target
    from tests.fixtures.dashboard import as_prometheus_runs_it, panel_queries

    c = real_cluster
    wait_for("2 ready replicas", lambda: ready_at(c, 2), READY_TIMEOUT_S, 2)
    pods = sorted(model_pods(c), key=lambda p: p.metadata.name)
    servers = [
        Target(
            f"{p.status.pod_ip}:{_container_port(p, 'http')}",
            # as the chart's PodMonitor labels them (the dashboard's queries group by these)
            {
                "rewardmodel": RM,
                "replica": p.metadata.labels["rewardplane.io/replica"],
                "pod": p.metadata.name,
            },
        )
        for p in pods
    ]
    op = operator_pod(c)
    assert op is not None
    jobs = {
        "reward-servers": servers,
        "operator": [Target(f"{op.status.pod_ip}:{_container_port(op, 'metrics')}", {})],
    }
    with Prometheus(tmp_path / "prometheus", jobs) as prom:
        wait_for(
            "every target scraped",
            lambda: (up := prom.targets_up()) and len(up) == 3 and all(up.values()),
            60,
        )
        model, tok = load_model(S.model_dir)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(5)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        version = S.version + 1
        with handle(c) as rm:
            rm.client().score_batch(TEXTS, normalize=False)
            result = rm.push_weights(model.state_dict(), version, RewardModelTrainingMode.FULL, timeout_s=120)
            S.version, S.expected = version, scores_of(model, tok, TEXTS)
            assert_scores(rm.client().score_batch(TEXTS, normalize=False), S.expected)
            write_timeline(rm, result, tmp_path / "push.png")

        selector = f'{{rewardmodel="{RM}"}}'

        def pushed() -> list[dict[str, Any]] | None:
            moved = prom.query(f"changes(rewardplane:weights_version{selector}[10m]) > 0")
            now = prom.query(f"rewardplane:weights_version{selector} == {version}")
            return now if len(moved) == 2 and len(now) == 2 else None

        now = wait_for(f"PromQL to show both replicas moving to version {version}", pushed, 60, 1)
        assert {r["metric"]["pod"] for r in now} == {p.metadata.name for p in pods}
        phases = prom.query(f"sum by (phase) (rewardplane:weight_push_phase_seconds_count{selector})")
        assert {r["metric"]["phase"] for r in phases} == {"queue", "wait_lock", "receive", "commit"}

        missing = panel_queries()
        deadline = time.monotonic() + 90  # rates need two scrapes of a series inside their window
        while missing and time.monotonic() < deadline:
            missing = [(title, q) for title, q in missing if not prom.query(as_prometheus_runs_it(q))]
            if missing:
                time.sleep(2)
        assert not missing, f"dashboard queries that return no data: {missing}\n{prom.log()[-2000:]}"

    with Image.open(tmp_path / "push.png") as img:
        assert img.format == "PNG"
        assert img.info["Description"] == "replicas: " + ", ".join(p.metadata.name for p in pods)


def test_killed_container_is_restarted_and_restored(real_cluster: RealCluster) -> None:
    c = real_cluster
    pod = sorted(model_pods(c), key=lambda p: p.metadata.name)[0]
    restarts = pod.status.container_statuses[0].restart_count
    cid = pod.status.container_statuses[0].container_id.removeprefix("containerd://")
    # kill the container's process through the node's containerd, as an OOM kill would
    c.node.ctr(["tasks", "kill", "-s", "SIGKILL", cid], timeout=30)

    def restarted() -> bool:
        st = c.core.read_namespaced_pod(pod.metadata.name, NS).status.container_statuses[0]
        return st.restart_count > restarts

    # The restarted server comes back on its base weights (version 0): it must stay out of the
    # Service until restored from its saved weights.
    with service_watch(c, {S.version}) as watch:
        wait_for("the kubelet to restart the container", restarted, 120)
        wait_for(
            f"both replicas back on version {S.version}",
            lambda: ready_at(c, 2, S.version),
            READY_TIMEOUT_S,
            2,
        )
    watch.check(min_answers=10)
    with handle(c) as rm:
        assert_scores(rm.client().score_batch(TEXTS, normalize=False), S.expected)


def operator_pod(c: RealCluster) -> Any | None:
    pods = c.core.list_namespaced_pod(
        OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/component=operator"
    ).items
    return next((p for p in pods if not p.metadata.deletion_timestamp), None)


def lease_holder(c: RealCluster) -> str | None:
    from kubernetes import client

    try:
        lease = client.CoordinationV1Api(c.api).read_namespaced_lease(
            "rewardplane-operator", OPERATOR_NAMESPACE
        )
    except client.exceptions.ApiException:
        return None
    return lease.spec.holder_identity if lease.spec else None


def weightsync_status(c: RealCluster, version: int) -> dict[str, Any] | None:
    """The WeightSync's status once it is about ``version`` (the object is reused from push to
    push: until the operator takes a push up, its status shows the last one)."""
    try:
        ws = c.custom.get_namespaced_custom_object(GROUP, VERSION, NS, "weightsyncs", RM)
    except Exception:
        return None
    st, spec = ws.get("status") or {}, ws.get("spec") or {}
    if spec.get("version") != version or st.get("version") != version:
        return None
    return dict(st)


def hand_over(c: RealCluster, old_name: str, old_pid: int, timeout_s: float = 120) -> float:
    """Seconds until an operator other than ``old_name`` holds the Lease; fails the test when it
    did while the old operator's process still ran (polled every 50 ms)."""
    started = time.monotonic()
    overlaps: list[str] = []
    while time.monotonic() < started + timeout_s:
        holder = lease_holder(c)
        alive = process_alive(old_pid)
        if holder and not holder.startswith(old_name):
            if not alive:
                assert not overlaps, f"a new operator held the Lease while the old one (pid {old_pid}) ran"
                return time.monotonic() - started
            overlaps.append(holder)
        time.sleep(0.05)
    pytest.fail(f"no new operator took the Lease within {timeout_s:.0f} s (holder {lease_holder(c)})")


# How the operator Pod is deleted in each phase of a push, and what the push does then:
#   Pending: deleted as usual (SIGTERM): the old operator finishes the push it runs, then stops.
#   Rendezvous: deleted with a 1 s grace period (killed): the replicas were asked to join but never
#     announced the update; the new operator fails the push (OperatorRestarted), the trainer pushes again.
#   Transferring: deleted with a 1 s grace period (killed): the trainer broadcasts to the replicas
#     directly; the new operator follows the transfer to Completed.
DELETED_MID_PUSH = {
    "Pending": (None, "completed"),
    "Rendezvous": (1, "OperatorRestarted"),
    "Transferring": (1, "completed"),
}
HOLD_AT: dict[str, Literal["request", "join", "send"]] = {
    "Pending": "request",
    "Rendezvous": "join",
    "Transferring": "send",
}


@pytest.mark.parametrize("phase", list(DELETED_MID_PUSH))
def test_an_operator_deleted_mid_push_hands_over_cleanly(
    real_cluster: RealCluster, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator Pod deleted while a push's WeightSync is in ``phase``. The replacement starts
    at once (the Deployment does not wait) but acts only once it holds the leadership Lease, which
    the old one gives up when it has stopped (or which lapses when it was killed): no two operators
    act at once. The push completes, or fails with the truthful reason and the trainer's second push
    completes; clients of the Service get the old or the new version, never another, and every
    replica ends on the pushed weights.

    To land in the phase, the trainer (this process) is held: before it creates the WeightSync a
    replica's server is frozen (SIGSTOP), so the operator's check of the replicas waits in Pending;
    before it joins the group (Rendezvous); before it sends (Transferring)."""
    import torch

    from rewardplane.sdk import RewardModelTrainingMode
    from rewardplane.sdk._exceptions import WeightSyncFailed

    c = real_cluster
    grace, expected = DELETED_MID_PUSH[phase]
    old = operator_pod(c)
    assert old is not None
    holder = wait_for("the operator to hold the Lease", lambda: lease_holder(c), 60, 0.5)
    assert holder.startswith(old.metadata.name), holder
    old_pid = process_in_pod(old.metadata.uid, b"rewardplane.operator")
    assert old_pid is not None

    model, tok = trainer_pod_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.005 * (1 + list(DELETED_MID_PUSH).index(phase)))
    before, version = S.version, S.version + 1
    frozen_pod = sorted(model_pods(c), key=lambda p: p.metadata.name)[-1]
    frozen_pid = server_pid_in_pod(frozen_pod.metadata.uid)
    assert frozen_pid is not None
    step = HOLD_AT[phase]
    outcome: dict[str, Any] = {}

    with (
        Freezer(frozen_pid) as freezer,
        service_watch(c, {before, version}) as watch,
    ):
        hold = TrainerHold(monkeypatch, step, at_request=freezer.freeze)

        def push() -> None:
            with handle(c) as rm:
                try:
                    rm.push_weights(model.state_dict(), version, RewardModelTrainingMode.FULL, timeout_s=120)
                    outcome["pushes"] = 1
                except WeightSyncFailed as exc:  # the operator that drove it is gone: push again
                    outcome["first"] = (exc.reason, str(exc))
                    outcome["status"] = weightsync_status(c, version)
                    outcome["served"] = rm.get_weights_version()
                    rm.push_weights(model.state_dict(), version, RewardModelTrainingMode.FULL, timeout_s=120)
                    outcome["pushes"] = 2
                except Exception as exc:
                    outcome["error"] = repr(exc)

        pusher = threading.Thread(target=push, daemon=True)
        pusher.start()
        wait_for(f"the trainer to reach its {step} step", hold.reached.is_set, 120, 0.05)
        st = wait_for(
            f"the push in phase {phase}",
            lambda: (s := weightsync_status(c, version)) and s.get("phase") == phase and s,
            60,
            0.02,
        )
        assert st["phase"] == phase
        deleted = time.monotonic()
        c.core.delete_namespaced_pod(old.metadata.name, OPERATOR_NAMESPACE, grace_period_seconds=grace)
        if grace is None:
            freezer.thaw()  # the old operator, asked to stop, goes on with the push it runs
        else:
            wait_for("the old operator killed", lambda: not process_alive(old_pid), 60, 0.05)
            freezer.thaw()
            hold.release()
        handed_s = hand_over(c, old.metadata.name, old_pid)
        hold.release()
        pusher.join(240)
        assert not pusher.is_alive() and "error" not in outcome, outcome
        if expected == "completed":
            assert outcome["pushes"] == 1, outcome
        else:
            assert outcome["pushes"] == 2 and outcome["first"][0] == expected, outcome
            # truthful: the status said why, and the model stayed on the weights it served
            assert outcome["status"]["phase"] == "Failed" and outcome["status"]["reason"] == expected
            assert "push again" in outcome["status"]["message"], outcome["status"]
            assert outcome["served"] == before, outcome
        wait_for(f"both replicas on version {version}", lambda: ready_at(c, 2, version), READY_TIMEOUT_S, 0.5)
    watch.check(min_answers=5)
    final = weightsync_status(c, version)
    assert final is not None and final["phase"] == "Completed", final
    new = operator_pod(c)
    assert new is not None and new.metadata.name != old.metadata.name
    S.expected, S.version = scores_of(model, tok, TEXTS), version
    with handle(c) as rm:
        assert_scores(rm.client().score_batch(TEXTS, normalize=False), S.expected)
    print(
        f"\noperator deleted in {phase} (grace {grace}): new leader after {handed_s:.1f} s, "
        f"push done {time.monotonic() - deleted:.1f} s after the deletion; {outcome.get('pushes')} push(es)"
        f"{'; first: ' + outcome['first'][0] if 'first' in outcome else ''}; "
        f"{len(watch.answers)} answers through the Service, {watch.versions()}"
    )


def operator_log(c: RealCluster, pod: str) -> str:
    return kubectl(c, "logs", "-n", OPERATOR_NAMESPACE, pod, "--tail=200")


def operator_may(c: RealCluster, verb: str, resource: str) -> bool:
    """What the API server's authorizer answers for the operator's ServiceAccount now."""
    from kubernetes import client

    review = client.AuthorizationV1Api(c.api).create_subject_access_review(
        {
            "spec": {
                "user": f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_RELEASE}",
                "resourceAttributes": {"verb": verb, "resource": resource, "namespace": NS},
            }
        }
    )
    return bool(review.status and review.status.allowed)


def service_spec(c: RealCluster) -> tuple[list[tuple[Any, ...]], dict[str, str]]:
    """The model Service's ports and selector (what the operator owns of it)."""
    spec = c.core.read_namespaced_service(RM, NS).spec
    ports = sorted((p.name, p.port, str(p.target_port), p.protocol) for p in spec.ports or [])
    return ports, dict(spec.selector or {})


def edit_service_by_hand(c: RealCluster) -> None:
    """A selector key added and the http port moved, as a hand edit (kubectl edit) would."""
    svc = c.core.read_namespaced_service(RM, NS)
    ports = [
        {"name": p.name, "port": p.port + 1000 if p.name == "http" else p.port, "protocol": p.protocol}
        for p in svc.spec.ports
    ]
    patch = json.dumps({"spec": {"selector": {"edited": "by-hand"}, "ports": ports}})
    kubectl(c, "patch", "service", RM, "-n", NS, "--type=merge", "-p", patch)


def test_hand_edits_are_repaired_and_revoked_rbac_changes_nothing(real_cluster: RealCluster) -> None:
    """A reward Pod's label and the model's Service edited by hand (either takes replicas out of the
    Service): the operator puts both back at their events (the Pod is replaced at a rollout's pace,
    its weights restored). Then the operator's ClusterRoleBinding deleted and the Service edited
    again: the operator can write nothing, says so in its log (naming the RBAC) and touches no Pod;
    restored, it repairs the Service at its next resync, without a restart. A trainer scoring
    through the SDK the whole time sees no error and the exact scores."""
    from kubernetes import client

    from rewardplane.api.names import LABEL_COMPONENT

    c = real_cluster
    rbac = client.RbacAuthorizationV1Api(c.api)
    op = operator_pod(c)
    assert op is not None
    op_restarts = op.status.container_statuses[0].restart_count
    owned = service_spec(c)
    edited_pod, other = sorted(model_pods(c), key=lambda p: p.metadata.name)
    with handle(c) as rm, SdkScoring(rm, TEXTS, S.expected) as sdk, service_watch(c, {S.version}) as watch:
        sdk.wait_requests(3)
        # 1. drift: a Pod's component label removed, the Service's selector and port changed
        t0 = time.monotonic()
        c.core.patch_namespaced_pod(
            edited_pod.metadata.name, NS, {"metadata": {"labels": {LABEL_COMPONENT: None}}}
        )
        edit_service_by_hand(c)
        wait_for("the Service put back", lambda: service_spec(c) == owned, 60, 0.2)
        service_s = time.monotonic() - t0
        wait_for(
            "the edited Pod replaced and both replicas serving the model's version",
            lambda: (
                pod_uid(c, edited_pod.metadata.name) not in (None, edited_pod.metadata.uid)
                and ready_at(c, 2, S.version)
            ),
            READY_TIMEOUT_S,
            0.5,
        )
        pod_s = time.monotonic() - t0
        assert pod_uid(c, other.metadata.name) == other.metadata.uid  # one Pod edited, one replaced
        wait_for("both replicas in the Service's Endpoints", lambda: len(watch.addresses()) == 2, 60, 0.2)

        # 2. RBAC revoked: the operator can write nothing and says why; nothing is touched
        binding = rbac.read_cluster_role_binding(OPERATOR_RELEASE)
        pods_before = {p.metadata.name: p.metadata.uid for p in model_pods(c)}
        rbac.delete_cluster_role_binding(OPERATOR_RELEASE)
        try:
            wait_for(
                "the operator to lose its permissions",
                lambda: not operator_may(c, "patch", "services"),
                30,
                0.5,
            )
            edit_service_by_hand(c)
            said = wait_for(
                "the operator's log to say it is forbidden",
                lambda: next(
                    (
                        ln
                        for ln in operator_log(c, op.metadata.name).splitlines()
                        if "forbidden" in ln.lower()
                    ),
                    None,
                ),
                60,
                1,
            )
            assert "HTTP 403" in said, said
            assert service_spec(c) != owned  # it could not put it back
            assert {p.metadata.name: p.metadata.uid for p in model_pods(c)} == pods_before
            assert ready_at(c, 2, S.version), "the status changed while the operator could not write it"
        finally:
            rbac.create_cluster_role_binding(
                {
                    "metadata": {"name": OPERATOR_RELEASE, "labels": binding.metadata.labels},
                    "roleRef": binding.role_ref.to_dict(),
                    "subjects": [s.to_dict() for s in binding.subjects or []],
                }
            )
        t1 = time.monotonic()
        # the binding back: the next resync (30 s) puts the Service back, no restart needed
        wait_for("the Service put back after the RBAC came back", lambda: service_spec(c) == owned, 60, 0.5)
        recovered_s = time.monotonic() - t1
        wait_for("both replicas in the Service's Endpoints", lambda: len(watch.addresses()) == 2, 60, 0.2)
        sdk.wait_requests(3)
    sdk.check(min_requests=20)
    watch.check(min_answers=5)
    now = operator_pod(c)
    assert now is not None and now.metadata.uid == op.metadata.uid
    assert now.status.container_statuses[0].restart_count == op_restarts
    assert {p.metadata.name: p.metadata.uid for p in model_pods(c)} == pods_before
    print(
        f"\ndrift: Service put back after {service_s:.1f} s, edited Pod replaced and serving after "
        f"{pod_s:.1f} s; RBAC restored: Service put back after {recovered_s:.1f} s; SDK: {sdk.requests} "
        f"requests, {len(sdk.errors)} errors; Service: {len(watch.answers)} answers"
    )


def pods_running(c: RealCluster) -> dict[str, tuple[str, int]]:
    """Each model Pod's container id and restart count (unchanged: nothing restarted)."""
    return {
        p.metadata.name: (
            p.status.container_statuses[0].container_id,
            p.status.container_statuses[0].restart_count,
        )
        for p in model_pods(c)
    }


def readiness_rechecked_since(c: RealCluster, since: float) -> bool:
    """Every model Pod Ready, its Ready condition last changed at or after ``since`` (wall clock;
    the API's timestamps are to the second): the kubelet reset it and its probe passed again."""
    pods = model_pods(c)
    for pod in pods:
        cond = next((x for x in pod.status.conditions or [] if x.type == "Ready"), None)
        if cond is None or cond.status != "True" or cond.last_transition_time.timestamp() < int(since):
            return False
    return bool(pods)


def test_containerd_and_kubelet_restarts_lose_no_request(real_cluster: RealCluster) -> None:
    """containerd, then the kubelet, stopped and started again on the node while a trainer scores
    through the SDK and a client through the Service. Containers keep running (their shims outlive
    containerd); the restarted kubelet resets every Pod's readiness until its probes pass again,
    and the SDK's client rides that out (``RewardModelHandle.client()`` keeps its client while no
    replica is ready). 0 client errors, exact scores, no wrong version; the status reports the
    model's weights version throughout and is Ready with both replicas afterwards."""
    c = real_cluster
    running = pods_running(c)
    with handle(c) as rm, SdkScoring(rm, TEXTS, S.expected) as sdk, service_watch(c, {S.version}) as watch:
        sdk.wait_requests(5)
        t0 = time.monotonic()
        containerd_s = c.node.restart("containerd")
        sdk.wait_requests(5)
        requests_before_kubelet = sdk.requests
        restarted_at = time.time()
        kubelet_s = c.node.restart("kubelet")
        wait_for(
            "the restarted kubelet to probe every Pod Ready again",
            lambda: readiness_rechecked_since(c, restarted_at) and ready_at(c, 2, S.version),
            120,
            0.2,
        )
        kubelet_window_s, kubelet_requests = (
            time.time() - restarted_at,
            sdk.requests - requests_before_kubelet,
        )
        sdk.wait_requests(5)
        window_s = time.monotonic() - t0
    sdk.check(min_requests=30)
    watch.check(min_answers=5)
    assert pods_running(c) == running, "a container was restarted"
    versions = {v for *_, v in sdk.statuses}
    assert versions == {S.version}, f"the status reported weights versions {versions}"
    final = get_rm(c)["status"]
    assert final["phase"] == "Ready" and final["readyReplicas"] == 2, final
    phases = [p for _, p, _, _ in sdk.statuses]
    seen = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    print(
        f"\ncontainerd back in {containerd_s:.1f} s, kubelet in {kubelet_s:.1f} s; over {window_s:.1f} s "
        f"the SDK made {sdk.requests} requests ({kubelet_requests} in the {kubelet_window_s:.1f} s from the "
        f"kubelet's stop until both Pods were Ready again), {len(sdk.errors)} errors; status phases {seen}, "
        "fewer than 2 ready for "
        f"{sdk.unready_s(2):.1f} s; Service: {len(watch.answers)} answers, {watch.refused} refused"
    )


def trainer_pod_model() -> tuple[Any, Any]:
    """The model the trainer Pod pushed last (what the replicas serve since)."""
    import torch

    model, tok = load_model(S.model_dir)
    with torch.no_grad():
        model.score.weight.mul_(2.0)
        for p in model.parameters():
            p.add_(0.01)
    return model, tok


def container_state(pod: Any) -> str:
    """The reward container's state in a line (for messages: was it starting, serving, restarting?)."""
    for st in pod.status.container_statuses or []:
        state = st.state
        now = "running" if state.running else "waiting" if state.waiting else "terminated"
        return f"{now}, ready={st.ready}, restarts={st.restart_count}"
    return f"phase {pod.status.phase}, no container status"


def seconds_to_stop(c: RealCluster, name: str, delete: Callable[[], None]) -> tuple[float, str]:
    """``delete`` the pod (or have the operator delete it), then the seconds from its deletion
    timestamp to its server process's exit, and what the container was doing: its state when the
    deletion was seen and its last log lines. The exit is what the server owns (its SIGTERM
    handling); the kubelet's removal of the Pod object afterwards is waited for but not timed (on
    this node it once came 48 s after the container had gone). (By uid: the operator may create a
    pod of the same name again at once.)"""
    uid = c.core.read_namespaced_pod(name, NS).metadata.uid
    pid = server_pid_in_pod(uid)
    assert pid is not None, f"no server process found in {name} (uid {uid})"
    with tempfile.TemporaryFile("w+") as log_file:
        # followed from before the deletion: the log goes with the pod
        follow = subprocess.Popen(
            [str(find_binary("kubectl")), "--kubeconfig", str(c.kubeconfig), "logs", "-f", "-n", NS, name],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            delete()

            def this_pod() -> Any:
                return next((p for p in model_pods(c) if p.metadata.uid == uid), None)

            def terminating() -> tuple[float, str] | None:
                pod = this_pod()
                if pod is None:
                    return time.monotonic(), "gone before the first look"
                return (time.monotonic(), container_state(pod)) if pod.metadata.deletion_timestamp else None

            asked, state = wait_for(f"{name} to be deleted", terminating, 60, 0.2)
            still = wait_for_process_exit(pid, 60)
            took = time.monotonic() - asked
            if still:
                state += f"; its server still ran 60 s after the deletion (pid {still} in its container)"
            wait_for(f"{name} gone", lambda: this_pod() is None, 120, 0.5)
        finally:
            follow.terminate()
            follow.wait(10)
        log_file.seek(0)
        tail = "\n".join(log_file.read().splitlines()[-25:])
    return took, f"{state}; its last log lines:\n{tail}"


def pod_uid(c: RealCluster, name: str) -> str | None:
    pod = {p.metadata.name: p for p in model_pods(c)}.get(name)
    return pod.metadata.uid if pod is not None else None


def server_pid_in_pod(uid: str) -> int | None:
    """The host pid of the reward server in the pod ``uid``."""
    return process_in_pod(uid, b"rewardplane.server")


def process_alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def process_in_pod(uid: str, needle: bytes) -> int | None:
    """The host pid of the process whose command line holds ``needle`` in the pod ``uid`` (the node
    runs on this machine: its containers are processes here, in the pod's cgroup)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            # the process itself, not the init (tini) that started it with the same words
            if (
                needle in b" ".join(argv)
                and b"tini" not in argv[0]
                and f"pod{uid}" in (entry / "cgroup").read_text()
            ):
                return int(entry.name)
        except OSError:  # gone meanwhile
            continue
    return None


def wait_for_process_exit(pid: int, timeout_s: float) -> str:
    """'' once ``pid`` has exited (or is a zombie), else its pid inside its container (NSpid)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return ""
        if "\nState:\tZ" in status:
            return ""
        if time.monotonic() > deadline:
            return next((ln.split()[-1] for ln in status.splitlines() if ln.startswith("NSpid:")), "?")
        time.sleep(0.05)


def test_scale_1_3_1_and_sigterm_ends_replicas_fast(real_cluster: RealCluster) -> None:
    """Replicas stop well inside their 30 s grace period, serving or still starting: the server
    handles SIGTERM itself (stops accepting, drains, exits), and it is never the container's PID 1
    (which ignores a signal it has no handler for yet), so no stop waits for the kubelet's SIGKILL."""
    c = real_cluster

    selector = f"rewardplane.io/model={RM},app.kubernetes.io/component=reward-server"

    def scale(n: int) -> None:
        # through the scale subresource, as kubectl scale, an HPA or KEDA do
        out = kubectl(c, "scale", f"rewardmodel/{RM}", "-n", NS, f"--replicas={n}")
        assert f"rewardmodel.rewardplane.io/{RM} scaled" in out, out
        assert get_rm(c)["spec"]["replicas"] == n

    def scaled_to(n: int) -> bool:
        """kubectl get rm's READY column, the status and the scale subresource all say n of n, and
        the selector an HPA gets selects exactly the model's n Pods."""
        st = get_rm(c).get("status") or {}
        row = kubectl(c, "get", "rm", RM, "-n", NS, "--no-headers").split()
        raw = kubectl(c, "get", "--raw", f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/rewardmodels/{RM}/scale")
        scale_ = json.loads(raw)
        pods = kubectl(c, "get", "pods", "-n", NS, "-l", selector, "--no-headers").splitlines()
        return (
            row[1] == f"{n}/{n}"
            and (st.get("replicas"), st.get("readyReplicas"), st.get("selector")) == (n, n, selector)
            and (scale_["spec"]["replicas"], scale_["status"]["replicas"]) == (n, n)
            and scale_["status"]["selector"] == selector
            and len(pods) == n
        )

    took, state = seconds_to_stop(c, f"{RM}-1", lambda: scale(1))
    assert took < 20, f"the serving replica took {took:.0f} s to stop (its container when deleted: {state})"
    wait_for("1 replica", lambda: ready_at(c, 1, S.version), READY_TIMEOUT_S, 1)
    wait_for("kubectl get rm and /scale at 1/1", lambda: scaled_to(1), 30, 1)
    scale(3)

    # SIGTERM at the first instant of a server process (as the kubelet's stop of a replica that a
    # rollout or scale-down catches while it starts): it must end it, not be dropped because the
    # process is its container's PID 1 and Python has not installed a handler yet.
    uid = wait_for(f"{RM}-2 created", lambda: pod_uid(c, f"{RM}-2"), 60, 0.2)
    pid = wait_for(
        f"{RM}-2's server process to start", lambda: server_pid_in_pod(uid), READY_TIMEOUT_S, 0.005
    )
    os.kill(pid, signal.SIGTERM)
    still = wait_for_process_exit(pid, 10)
    assert not still, f"the starting server ignored SIGTERM (pid {pid}, pid in its container: {still})"
    # The kubelet starts it again. e2e-rm-1 was a replica before: its saved weights restore it;
    # e2e-rm-2 never served, so a healthy peer sends it the current weights. Until then each stays
    # out of the endpoints.
    wait_for("3 replicas on the current version", lambda: ready_at(c, 3, S.version), READY_TIMEOUT_S, 2)
    wait_for("kubectl get rm and /scale at 3/3", lambda: scaled_to(3), 30, 1)
    with handle(c) as rm:
        assert_scores(rm.client().score_batch(TEXTS, normalize=False), S.expected)
    scale(1)
    wait_for("1 replica again", lambda: ready_at(c, 1, S.version), READY_TIMEOUT_S, 1)
    wait_for("kubectl get rm and /scale at 1/1 again", lambda: scaled_to(1), 30, 1)

    # An HorizontalPodAutoscaler drives the RewardModel through the same subresource (the
    # controller-manager's HPA controller; below minReplicas it scales up without any metric).
    hpa = {
        "apiVersion": "autoscaling/v1",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"{RM}-hpa", "namespace": NS},
        "spec": {
            "scaleTargetRef": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RewardModel", "name": RM},
            "minReplicas": 2,
            "maxReplicas": 2,
            "targetCPUUtilizationPercentage": 80,
        },
    }
    kubectl_apply(c, hpa)
    try:
        wait_for("the HPA to scale the model to 2", lambda: ready_at(c, 2, S.version), READY_TIMEOUT_S, 1)
        wait_for("kubectl get rm and /scale at 2/2", lambda: scaled_to(2), 30, 1)
    finally:
        kubectl(c, "delete", "hpa", f"{RM}-hpa", "-n", NS)
    scale(1)
    wait_for("1 replica after the HPA", lambda: ready_at(c, 1, S.version), READY_TIMEOUT_S, 1)


def ready_since_start_s(pod: Any) -> float | None:
    """Seconds from the server container's start to the Pod's Ready (the API's timestamps, to the
    second), once it is Ready."""
    ready = next(
        (cd for cd in pod.status.conditions or [] if cd.type == "Ready" and cd.status == "True"), None
    )
    statuses = pod.status.container_statuses or []
    if ready is None or not statuses or statuses[0].state.running is None:
        return None
    return (ready.last_transition_time - statuses[0].state.running.started_at).total_seconds()


def test_replicas_copied_from_a_peer_join_the_service_at_once(real_cluster: RealCluster) -> None:
    """Without persistDir a new replica gets the model's weights from a healthy peer. Scored
    through the Service the whole time, scale 1 → 3 and a deleted replica never show the base
    weights to a client; each restored replica is admitted the moment its copy lands (the operator
    follows the copy instead of waiting for its next resync). Prints the figures docs/reliability.md
    carries."""
    import torch

    from rewardplane.sdk import RewardModelTrainingMode, select_head
    from rewardplane.sdk.cluster import RewardModelHandle

    c, name = real_cluster, "e2e-peer"

    def ready(n: int) -> bool:
        st = get_rm(c, name).get("status") or {}
        eps = [e for e in st.get("endpoints") or [] if e.get("ready") and e.get("weightsVersion") == 1]
        return st.get("readyReplicas") == n and len(eps) == n and len(model_pods(c, name)) == n

    def scale(n: int) -> None:
        c.custom.patch_namespaced_custom_object(
            GROUP, VERSION, NS, "rewardmodels", name, {"spec": {"replicas": n}}
        )

    body = rm_body(1, f"pvc://{MODEL_CLAIM}/tiny-rm", None, name)
    # No spec.engine.image: the Pods run the operator's default, the chart's serverImage, which
    # helm_install_operator sets to the reward-server image build-images.sh built and `up` imported.
    del body["spec"]["engine"]["image"]
    c.custom.create_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", body)
    model, _ = load_model(S.model_dir)
    with torch.no_grad():
        model.score.weight.mul_(3.0)
    with RewardModelHandle(name, NS, kubeconfig=c.kubeconfig) as rm:
        rm.wait_ready(timeout_s=READY_TIMEOUT_S)
        rm.push_weights(select_head(model.state_dict()), 1, RewardModelTrainingMode.HEAD_ONLY, timeout_s=120)
    assert "image" not in get_rm(c, name)["spec"]["engine"]  # the CRD defaults none
    assert {p.spec.containers[0].image for p in model_pods(c, name)} == {server_image()}
    with service_watch(c, {1}, name) as watch:
        asked = time.monotonic()
        scale(3)
        wait_for("3 replicas on version 1", lambda: ready(3), READY_TIMEOUT_S, 0.2)
        scale_up_s = time.monotonic() - asked
        victim = f"{name}-1"
        old_uid = pod_uid(c, victim)
        c.core.delete_namespaced_pod(victim, NS)

        def back() -> float | None:
            pod = {p.metadata.name: p for p in model_pods(c, name)}.get(victim)
            if pod is None or pod.metadata.uid == old_uid or not ready(3):
                return None
            return ready_since_start_s(pod)

        back_s = wait_for(f"{victim} back on version 1", back, READY_TIMEOUT_S, 0.1)
    watch.check(min_answers=20)
    assert watch.versions().keys() == {1}, watch.versions()
    print(
        f"\nreadmission: scale 1->3 to 3/3 Ready {scale_up_s:.1f} s; a deleted replica of three: "
        f"container start -> Ready {back_s:.0f} s; {len(watch.answers)} answers through the Service, "
        f"versions {dict(watch.versions())}, {watch.refused} refused"
    )
    c.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", name)
    wait_for(f"{name}'s pods gone", lambda: not model_pods(c, name), 120, 1)


def test_a_lone_replica_keeps_its_pushed_weights_across_a_restart(real_cluster: RealCluster) -> None:
    """One replica, no persistDir: a container killed in its Pod comes back on the pushed weights
    from the Pod's own copy (spec.weightSync.podCopy, on by default), never serving its base
    weights through the Service; when nothing can restore it (the Pod replaced, no copy, no peer)
    the status says the weights are lost and wait_ready() raises at once instead of waiting."""
    import torch

    from rewardplane.sdk import RewardModelTrainingMode, select_head
    from rewardplane.sdk.cluster import ClusterError, RewardModelHandle

    c, name = real_cluster, "e2e-lone"
    c.custom.create_namespaced_custom_object(
        GROUP, VERSION, NS, "rewardmodels", rm_body(1, f"pvc://{MODEL_CLAIM}/tiny-rm", None, name)
    )
    model, _ = load_model(S.model_dir)
    with torch.no_grad():
        model.score.weight.mul_(-2.0)
    try:
        with RewardModelHandle(name, NS, kubeconfig=c.kubeconfig) as rm:
            rm.wait_ready(timeout_s=READY_TIMEOUT_S)
            rm.push_weights(
                select_head(model.state_dict()), 1, RewardModelTrainingMode.HEAD_ONLY, timeout_s=120
            )
            [pod] = model_pods(c, name)
            restarts = pod.status.container_statuses[0].restart_count
            cid = pod.status.container_statuses[0].container_id.removeprefix("containerd://")
            with service_watch(c, {1}, name) as watch:
                wait_for("answers through the Service", lambda: len(watch.answers) >= 3, 30, 0.1)
                c.node.ctr(["tasks", "kill", "-s", "SIGKILL", cid], timeout=30)

                def back() -> bool:
                    [p] = model_pods(c, name)
                    st = get_rm(c, name).get("status") or {}
                    return (
                        p.status.container_statuses[0].restart_count > restarts and st.get("phase") == "Ready"
                    )

                wait_for(f"{name} restarted and Ready again", back, READY_TIMEOUT_S, 0.5)
                seen = len(watch.answers)
                wait_for("answers after the restore", lambda: len(watch.answers) >= seen + 3, 60, 0.1)
            watch.check(min_answers=6)
            assert get_rm(c, name)["status"]["weightsVersion"] == 1
            events = c.core.list_namespaced_event(NS, field_selector=f"involvedObject.name={name}").items
            assert any(e.reason == "ReplicaRestored" for e in events), [(e.reason, e.message) for e in events]

            # No copy: the Pod is replaced (its spec changed) and nothing else serves version 1.
            c.custom.patch_namespaced_custom_object(
                GROUP, VERSION, NS, "rewardmodels", name, {"spec": {"weightSync": {"podCopy": False}}}
            )
            lost = wait_for(
                f"{name} to say its weights are lost",
                lambda: (st := get_rm(c, name).get("status") or {}).get("reason") == "WeightsLost" and st,
                READY_TIMEOUT_S,
                1,
            )
            assert lost["phase"] == "Degraded" and "push version 1 again" in lost["message"], lost
            with pytest.raises(ClusterError, match="lost weights version 1"):
                rm.wait_ready(timeout_s=60)
    finally:
        c.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", name)
        wait_for(f"{name}'s pods gone", lambda: not model_pods(c, name), 120, 1)


@pytest.fixture(scope="module")
def stores(real_cluster: RealCluster) -> Iterator[Stores]:
    c = real_cluster
    started = start_stores(S.model_dir, c.volumes / "stores")
    secrets = {
        "e2e-s3": started.s3.env(),
        "e2e-files": {"AUTHORIZATION": HTTP_AUTHORIZATION},
        "e2e-hub": {"HF_TOKEN": HUB_TOKEN},
        "e2e-hub-wrong": {"HF_TOKEN": "hf_not_the_token"},
    }
    for name, data in secrets.items():
        c.core.create_namespaced_secret(NS, secret_body(name, data))
    try:
        yield started
    finally:
        started.close()
        if c.node.running():  # the suite's last test brings the node down before this runs
            for name in secrets:
                c.core.delete_namespaced_secret(name, NS)


def downloaded_rm(name: str, replicas: int, model: dict[str, str]) -> dict[str, Any]:
    body = rm_body(replicas, model["source"], None, name)
    body["spec"]["model"] |= model
    return body


def ready_replicas(c: RealCluster, name: str, n: int) -> bool:
    st = get_rm(c, name).get("status") or {}
    return st.get("readyReplicas") == n and len(model_pods(c, name)) == n


def seconds_to_scale(c: RealCluster, name: str, n: int) -> float:
    """Scale a model to ``n`` replicas; the seconds until all ``n`` are ready."""
    t0 = time.monotonic()
    c.custom.patch_namespaced_custom_object(
        GROUP, VERSION, NS, "rewardmodels", name, {"spec": {"replicas": n}}
    )
    wait_for(f"{name} at {n} replicas", lambda: ready_replicas(c, name, n), READY_TIMEOUT_S, 0.5)
    return time.monotonic() - t0


def test_models_download_from_s3_https_and_the_hub_once_per_node(
    real_cluster: RealCluster, stores: Stores
) -> None:
    """Each downloaded source serves the model's exact scores; the status shows the download's
    bytes and percent; a second replica on the node uses the node's copy without asking the store,
    and a replica whose cache entry was removed downloads it again."""
    c = real_cluster
    models = {
        "e2e-s3": {
            "source": f"s3://{BUCKET}/tiny-rm",
            "sourceSecret": "e2e-s3",
            "sourceEndpoint": stores.s3.url,
        },
        "e2e-https": {"source": f"{stores.files.url}/tiny-rm.tar.gz", "sourceSecret": "e2e-files"},
        "e2e-hf": {
            "source": f"hf://{HUB_REPO}@main",
            "sourceSecret": "e2e-hub",
            "sourceEndpoint": stores.hub.url,
        },
    }
    from rewardplane.sdk.cluster import RewardModelHandle

    base = scores_of(*load_model(S.model_dir), TEXTS)
    seen_progress: list[str] = []

    def all_ready() -> bool:
        # the slow https download: its progress, in bytes and percent, is in the status meanwhile
        message = next(
            (
                d.get("message", "")
                for d in (get_rm(c, "e2e-https").get("status") or {}).get("conditions") or []
                if d["type"] == "Progressing"
            ),
            "",
        )
        if "downloading the model:" in message:
            seen_progress.append(message)
        return all(ready_replicas(c, name, 1) for name in models)

    started = time.monotonic()
    for name, model in models.items():
        c.custom.create_namespaced_custom_object(
            GROUP, VERSION, NS, "rewardmodels", downloaded_rm(name, 1, model)
        )
    try:
        wait_for("the downloaded models ready", all_ready, READY_TIMEOUT_S, 0.5)
        first_s = time.monotonic() - started
        assert any("%" in m and "MB" in m for m in seen_progress), seen_progress
        for name in models:
            with RewardModelHandle(name, NS, kubeconfig=c.kubeconfig) as rm:
                assert_scores(rm.client().score_batch(TEXTS, normalize=False), base)
            progress = fetch_progress(c.core, NS, f"{name}-0")
            assert progress is not None and progress.phase == "done", (name, progress)
        entries = sorted(p.name for p in c.model_cache.iterdir() if (p / "manifest.json").is_file())
        assert len(entries) == 3, entries

        # A second replica on the node: the node's copy, verified, and not one request to the store.
        asked = stores.s3.counts.total("GET")
        cached_s = seconds_to_scale(c, "e2e-s3", 2)
        progress = fetch_progress(c.core, NS, "e2e-s3-1")
        assert progress is not None and progress.phase == "cached", progress
        assert stores.s3.counts.total("GET") == asked, stores.s3.counts.by_path()

        # Without the node's copy (its entry removed, as an eviction does) the next replica
        # downloads the model again.
        [entry] = [
            p
            for p in c.model_cache.iterdir()
            if (p / "manifest.json").is_file()
            and json.loads((p / "manifest.json").read_text()).get("source", "").startswith("s3://")
        ]
        shutil.rmtree(entry)
        uncached_s = seconds_to_scale(c, "e2e-s3", 3)
        progress = fetch_progress(c.core, NS, "e2e-s3-2")
        assert progress is not None and progress.phase == "done", progress
        assert stores.s3.counts.total("GET") > asked
        print(
            f"\nmodel sources: three downloaded models ready in {first_s:.1f} s; a second replica "
            f"from the node cache in {cached_s:.1f} s, one without it in {uncached_s:.1f} s"
        )
    finally:
        for name in models:
            c.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", name)
        wait_for(
            "the downloaded models' pods gone", lambda: not any(model_pods(c, n) for n in models), 180, 2
        )


def test_model_download_failures_are_named_at_once(real_cluster: RealCluster, stores: Stores) -> None:
    """A missing prefix, a refused token, a missing file and an unreachable hub each stop the
    download at once, and the status (REASON column, Degraded condition) says which and what to do."""
    c = real_cluster
    cases = {
        "e2e-dl-prefix": (
            {
                "source": f"s3://{BUCKET}/no-such-model",
                "sourceSecret": "e2e-s3",
                "sourceEndpoint": stores.s3.url,
            },
            "no-such-model",
        ),
        "e2e-dl-token": (
            {"source": f"hf://{HUB_REPO}", "sourceSecret": "e2e-hub-wrong", "sourceEndpoint": stores.hub.url},
            "HF_TOKEN",
        ),
        "e2e-dl-missing": (
            {"source": f"{stores.files.url}/no-such-model.tar.gz", "sourceSecret": "e2e-files"},
            "404",
        ),
        # this machine has no route to the hub
        "e2e-dl-offline": ({"source": "hf://rewardplane/not-reachable-here"}, "huggingface.co"),
    }
    for name, (model, _) in cases.items():
        c.custom.create_namespaced_custom_object(
            GROUP, VERSION, NS, "rewardmodels", downloaded_rm(name, 1, model)
        )

    def named(name: str, needle: str) -> dict[str, Any] | None:
        st = get_rm(c, name).get("status") or {}
        degraded = next((d for d in st.get("conditions") or [] if d["type"] == "Degraded"), {})
        ok = st.get("reason") == degraded.get("reason") == "ModelDownloadFailed"
        return st if ok and needle in degraded.get("message", "") else None

    try:
        for name, (_, needle) in cases.items():
            st = wait_for(f"{name}'s download failure named", lambda n=name, x=needle: named(n, x), 120, 1)
            assert st["phase"] == "Degraded" and st.get("readyReplicas", 0) == 0, st
    finally:
        for name in cases:
            c.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", name)
        wait_for("the failing models' pods gone", lambda: not any(model_pods(c, n) for n in cases), 180, 2)


def test_every_cause_a_replica_does_not_start_is_named(real_cluster: RealCluster) -> None:
    """One RewardModel per fault, all at once: the phase is Degraded and the REASON column, the
    Degraded condition and a Warning Event name the cause and what to do, instead of Pending with
    "no replica is broken". (CreateContainerConfigError cannot be caused through a RewardModel's
    spec; its rule is covered in tests/unit/test_status_truth.py.)"""
    c = real_cluster
    unreadable = c.volumes / "unreadable-rm"
    build_tiny_reward_model(unreadable, num_labels=1, seed=0)
    for f in unreadable.iterdir():
        f.chmod(0o600)  # as save_pretrained writes them as root under umask 077
    cases: dict[str, tuple[dict[str, Any], str, str]] = {
        # name: (spec changes, REASON, what the message must name)
        "e2e-image": (
            {
                "engine": {
                    "kind": "hf",
                    "image": "localhost/rewardplane/no-such-image:0",
                    "imagePullPolicy": "Never",
                }
            },
            "ImagePullBackOff",
            "localhost/rewardplane/no-such-image:0",
        ),
        "e2e-mount": (
            {"model": {"source": "file:///no/such/model/dir"}},
            "FailedMount",
            "/no/such/model/dir",
        ),
        "e2e-oom": (
            {"resources": {"requests": {"cpu": "100m", "memory": "32Mi"}, "limits": {"memory": "48Mi"}}},
            "OOMKilled",
            "48Mi",
        ),
        "e2e-crash": ({"engine": {"extraArgs": ["--no-such-flag"]}}, "CrashLoopBackOff", "--no-such-flag"),
        "e2e-unreadable": (
            {"model": {"source": f"file://{unreadable}"}},
            "ModelUnreadable",
            "config.json (mode -rw-------",
        ),
        "e2e-nocpu": (
            {"resources": {"requests": {"cpu": "500", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}},
            "Unschedulable",
            "OutOfcpu",
        ),
    }
    for name, (changes, _, _) in cases.items():
        body = rm_body(1, f"pvc://{MODEL_CLAIM}/tiny-rm", None, name)
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(body["spec"].get(key), dict):
                merged = {**body["spec"][key], **value}
                if key == "model":
                    merged["servedName"] = name
                body["spec"][key] = merged
            else:
                body["spec"][key] = value
        c.custom.create_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", body)

    def named(name: str, reason: str, needle: str) -> dict[str, Any] | None:
        st = get_rm(c, name).get("status") or {}
        degraded = next((d for d in st.get("conditions") or [] if d["type"] == "Degraded"), {})
        ok = (
            st.get("reason") == reason
            and degraded.get("reason") == reason
            and needle in degraded.get("message", "")
        )
        return st if ok else None

    try:
        for name, (_, reason, needle) in cases.items():
            st = wait_for(
                f"{name} to say {reason}", lambda n=name, r=reason, x=needle: named(n, r, x), 240, 2
            )
            assert st["phase"] == "Degraded", st

            def warned(n: str = name, r: str = reason) -> bool:  # posted right after the status write
                events = c.core.list_namespaced_event(
                    NS, field_selector=f"involvedObject.name={n},type=Warning"
                )
                return any(e.reason == r for e in events.items)

            wait_for(f"a Warning Event {reason} on {name}", warned, 30, 0.5)

        def table_names_every_cause() -> str | None:
            # e2e-nocpu's refused Pod is replaced every ENDED_POD_GRACE_S, and its row says
            # RollingOut until the kubelet refuses the replacement too: read the table again
            table = kubectl(c, "get", "rm", *cases, "-n", NS)
            rows = {line.split()[0]: line.split() for line in table.splitlines()[1:] if line.strip()}
            return table if all(reason in rows.get(n, []) for n, (_, reason, _) in cases.items()) else None

        table = wait_for("kubectl get rm to name every cause", table_names_every_cause, 60, 1)
        assert "REASON" in table.splitlines()[0], table
        unread = named("e2e-unreadable", "ModelUnreadable", "uid 65532") or {}
        assert "chmod -R a+rX" in unread.get("message", ""), unread
        # the Pod the kubelet refused never runs again: the operator replaces it (as a ReplicaSet
        # would) after ENDED_POD_GRACE_S, and the new one is named the same way
        [refused] = [p.metadata.uid for p in model_pods(c, "e2e-nocpu")]

        def replaced() -> bool:
            return any(p.metadata.uid != refused for p in model_pods(c, "e2e-nocpu"))

        wait_for("the refused Pod to be replaced", replaced, 60, 1)
        wait_for(
            "the replacement's cause named", lambda: named("e2e-nocpu", "Unschedulable", "OutOfcpu"), 60, 1
        )
    finally:
        for name in cases:
            c.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", name)
        wait_for("the faulty models' pods gone", lambda: not any(model_pods(c, n) for n in cases), 180, 2)


# ------------------------------------------------------------------------------------ faults IV
# A second push, a trainer that never joins, a WeightSync deleted mid-push, a model deleted and
# created again at once, no operator running: each on the shared model, each in seconds.
NOBODY = ("10.250.0.1", 9)  # the node's address, a port nothing listens on: a trainer that never comes


def foreign_weightsync(name: str, version: int, timeout_s: int) -> dict[str, Any]:
    """A WeightSync applied by hand (no owner reference), whose rendezvous nobody serves."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "WeightSync",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "rewardModelRef": RM,
            "version": version,
            "trainingMode": "head_only",
            "rendezvous": {"address": NOBODY[0], "port": NOBODY[1]},
            "manifestRef": {"configMapName": f"{RM}-weightsync-manifest"},
            "timeoutSeconds": timeout_s,
        },
    }


def ws_status(c: RealCluster, name: str) -> dict[str, Any]:
    try:
        return (
            c.custom.get_namespaced_custom_object(GROUP, VERSION, NS, "weightsyncs", name).get("status") or {}
        )
    except Exception:
        return {}


def delete_ws(c: RealCluster, name: str) -> None:
    kubectl(c, "delete", "weightsync", name, "-n", NS, "--ignore-not-found", "--wait=true")


def head_push(version: int, scale: float, timeout_s: float = 60) -> Callable[[Any], Any]:
    import torch

    from rewardplane.sdk import RewardModelTrainingMode, select_head

    model, _ = load_model(S.model_dir)
    with torch.no_grad():
        model.score.weight.mul_(scale)
    head = select_head(model.state_dict())
    return lambda rm: rm.push_weights(head, version, RewardModelTrainingMode.HEAD_ONLY, timeout_s=timeout_s)


def test_a_second_push_is_refused_at_once_and_a_trainer_that_never_joins_is_named(
    real_cluster: RealCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    c, version = real_cluster, S.version + 1
    hold = TrainerHold(monkeypatch, "join")
    outcome: dict[str, Any] = {}
    push = head_push(version, 1.5)

    def trainer() -> None:
        started = time.monotonic()
        with handle(c) as rm:
            try:
                push(rm)
            except Exception as exc:
                outcome["error"] = repr(exc)
        outcome["seconds"] = time.monotonic() - started

    pusher = threading.Thread(target=trainer, daemon=True)
    pusher.start()
    try:
        wait_for("the trainer's push in Rendezvous", hold.reached.is_set, 60, 0.05)
        wait_for("phase Rendezvous", lambda: ws_status(c, RM).get("phase") == "Rendezvous", 30, 0.05)
        applied = time.monotonic()
        kubectl_apply(c, foreign_weightsync("e2e-ux-b", version, 60))
        refused = wait_for(
            "the second WeightSync refused",
            lambda: (s := ws_status(c, "e2e-ux-b")).get("phase") == "Failed" and s,
            10,
            0.1,
        )
        refused_s = time.monotonic() - applied
    finally:
        hold.release()
    assert (
        refused["reason"] == "PushInProgress"
        and f"WeightSync {RM} is pushing version {version}" in (refused["message"])
    ), refused
    # the event follows the status (the operator writes the status first)
    wait_for(
        "the PushInProgress event on e2e-ux-b",
        lambda: any(
            e.reason == "PushInProgress" and RM in e.message
            for e in c.core.list_namespaced_event(NS, field_selector="involvedObject.name=e2e-ux-b").items
        ),
        10,
        0.2,
    )
    pusher.join(90)
    assert "error" not in outcome and outcome["seconds"] < 30, outcome
    S.version = version
    delete_ws(c, "e2e-ux-b")

    # alone, with nobody at its rendezvous: it fails naming the trainer, and the model takes the next push
    kubectl_apply(c, foreign_weightsync("e2e-ux-c", version + 1, 6))
    failed = wait_for(
        "the push without a trainer to fail",
        lambda: (s := ws_status(c, "e2e-ux-c")).get("phase") == "Failed" and s,
        30,
        0.2,
    )
    assert failed["reason"] == "TrainerNotJoined" and "no trainer joined" in failed["message"], failed
    assert f"{NOBODY[0]}:{NOBODY[1]}" in failed["message"], failed
    delete_ws(c, "e2e-ux-c")
    with handle(c) as rm:
        head_push(version + 1, 1.25)(rm)
        assert rm.get_weights_version() == version + 1
    S.version = version + 1
    print(f"\nsecond WeightSync refused in {refused_s:.2f} s; the held push took {outcome['seconds']:.1f} s")


def test_a_deleted_weightsync_is_reported_at_once_and_a_committed_push_is_not_failed(
    real_cluster: RealCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rewardplane.sdk._exceptions import WeightSyncFailed

    c, version = real_cluster, S.version + 1

    def run(step: Literal["join", "send"], push: Callable[[Any], Any], phase: str) -> dict[str, Any]:
        hold = TrainerHold(monkeypatch, step)
        outcome: dict[str, Any] = {}

        def trainer() -> None:
            with handle(c) as rm:
                try:
                    outcome["result"] = push(rm)
                except WeightSyncFailed as exc:
                    outcome["failed"] = (exc.reason, str(exc))
                except Exception as exc:
                    outcome["error"] = repr(exc)
            outcome["done"] = time.monotonic()

        pusher = threading.Thread(target=trainer, daemon=True)
        pusher.start()
        wait_for(f"the trainer held at {step}", hold.reached.is_set, 60, 0.05)
        wait_for(f"phase {phase}", lambda: ws_status(c, RM).get("phase") == phase, 30, 0.05)
        delete_ws(c, RM)
        deleted = time.monotonic()
        hold.release()
        pusher.join(60)
        assert not pusher.is_alive() and "error" not in outcome, outcome
        outcome["seconds"] = outcome["done"] - deleted
        return outcome

    # deleted before any weight moved: said at once, with the version the replicas serve
    lost = run("join", head_push(version, 0.8), "Rendezvous")
    assert lost.get("failed", ("",))[0] == "WeightSyncGone", lost
    assert "was deleted" in lost["failed"][1] and f"serves version {S.version}" in lost["failed"][1], lost
    assert lost["seconds"] < 10, lost
    # deleted while the trainer sends: the replicas commit, and the push is not reported failed
    done = run("send", head_push(version, 0.8), "Transferring")
    assert "failed" not in done and done["result"].version == version, done
    replicas = int(get_rm(c)["spec"]["replicas"])  # as the scaling test left it
    wait_for(
        f"every replica on version {version}", lambda: ready_at(c, replicas, version), READY_TIMEOUT_S, 0.5
    )
    assert done["result"].replicas == replicas, done
    S.version = version
    print(
        f"\ndeleted in Rendezvous: reported in {lost['seconds']:.2f} s; in Transferring: done in {done['seconds']:.2f} s"
    )


def test_a_model_deleted_and_created_again_starts_at_version_0(real_cluster: RealCluster) -> None:
    c = real_cluster
    old = get_rm(c)
    assert old["status"]["weightsVersion"] == S.version > 0
    weights = c.volumes / "weights"
    old_dir = weights / old["metadata"]["uid"]
    assert old_dir.is_dir(), sorted(p.name for p in weights.iterdir())
    body = rm_body(2, f"pvc://{MODEL_CLAIM}/tiny-rm", str(weights), interface="eth0")
    started = time.monotonic()
    kubectl(c, "delete", "rm", RM, "-n", NS)  # returns once the operator retired the object
    deleted_s = time.monotonic() - started
    kubectl_apply(c, body)
    new_uid = get_rm(c)["metadata"]["uid"]
    assert new_uid != old["metadata"]["uid"]
    assert not old_dir.exists(), "the deleted object's persisted weights are still on the node"
    seen: set[int] = set()

    def ready_at_0() -> dict[str, Any] | NotReady:
        rm = get_rm(c)
        seen.add(int((rm.get("status") or {}).get("weightsVersion") or 0))
        return ready_at(c, 2, 0)

    rm = wait_for("the new object Ready at version 0", ready_at_0, READY_TIMEOUT_S, 0.5)
    assert seen == {0} and rm["status"]["phase"] == "Ready", (seen, rm["status"])
    assert all(any(r.uid == new_uid for r in p.metadata.owner_references or []) for p in model_pods(c)), (
        "a Pod of the old object is counted"
    )
    with handle(c) as h:
        head_push(1, -1.0)(h)
        assert h.get_weights_version() == 1
    S.version = 1
    print(
        f"\nkubectl delete took {deleted_s:.1f} s (Pods drained, weights wiped); re-created model Ready at 0"
    )


def test_the_status_says_when_no_operator_confirms_it(real_cluster: RealCluster) -> None:
    c = real_cluster
    image = f"localhost/rewardplane/operator:{local_image_tag()}"
    chart = str(Path(__file__).resolve().parents[2] / "charts" / "rewardplane")
    # a plain upgrade (no --reuse-values) keeps the operator image the install used
    helm(
        c,
        "upgrade",
        OPERATOR_RELEASE,
        chart,
        "--namespace",
        OPERATOR_NAMESPACE,
        "--set",
        "operator.resyncInterval=2",
        "--wait",
        "--timeout",
        "120s",
    )
    dep = c.apps.read_namespaced_deployment(OPERATOR_RELEASE, OPERATOR_NAMESPACE)
    assert dep.spec.template.spec.containers[0].image == image
    wait_for(
        "the heartbeat at the new interval",
        lambda: (get_rm(c).get("status") or {}).get("confirmIntervalSeconds") == 2,
        60,
        0.5,
    )

    def cli_status() -> str:
        done = subprocess.run(
            [
                str(Path(sys.executable).parent / "rewardplane"),
                "status",
                RM,
                "-n",
                NS,
                "--kubeconfig",
                str(c.kubeconfig),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "UNCONFIRMED" not in cli_status()
    c.apps.patch_namespaced_deployment_scale(OPERATOR_RELEASE, OPERATOR_NAMESPACE, {"spec": {"replicas": 0}})
    try:
        wait_for("no operator pod", lambda: operator_pod(c) is None, 60, 0.5)
        out = wait_for(
            "the status shown unconfirmed", lambda: o if "UNCONFIRMED" in (o := cli_status()) else None, 40, 1
        )
        assert "is the rewardplane operator running?" in out, out
        table = kubectl(c, "get", "rm", RM, "-n", NS)
        assert "CONFIRMED" in table.splitlines()[0], table
    finally:
        c.apps.patch_namespaced_deployment_scale(
            OPERATOR_RELEASE, OPERATOR_NAMESPACE, {"spec": {"replicas": 1}}
        )
    wait_for("the status confirmed again", lambda: "UNCONFIRMED" not in cli_status(), 90, 1)


def test_deleting_the_model_garbage_collects_its_children(real_cluster: RealCluster) -> None:
    c = real_cluster
    uid = get_rm(c)["metadata"]["uid"]
    c.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", RM)

    def gone() -> bool:
        owned = [
            o
            for lst in (
                c.core.list_namespaced_pod(NS).items,
                c.core.list_namespaced_service(NS).items,
                c.core.list_namespaced_secret(NS).items,
                c.core.list_namespaced_config_map(NS).items,
            )
            for o in lst
            if any(r.uid == uid for r in o.metadata.owner_references or [])
        ]
        ws = c.custom.list_namespaced_custom_object(GROUP, VERSION, NS, "weightsyncs")["items"]
        return not owned and not ws

    wait_for("garbage collection of the model's pods, Service, Secret and push objects", gone, 120)


# ------------------------------------------------------------------------------------ PRM
PRM = "e2e-prm"


def test_a_process_reward_model_scores_each_step_through_its_service(real_cluster: RealCluster) -> None:
    """A PRM (kind process, the tiny Qwen2.5-Math-PRM-shaped model built here) runs on the node:
    ``kubectl get rm`` shows its kind, and a solution sent from the host as a list of steps to the
    address its Service routes to gets a score per step and their aggregate, as transformers
    computes them on the host."""
    c = real_cluster
    model_dir = build_tiny_process_reward_model(c.volumes / "tiny-prm", seed=2)
    body = rm_body(1, f"file://{model_dir}", None, PRM)
    model = body["spec"]["model"]
    del model["numLabels"], model["pooling"]  # a PRM's head reads its step tags: neither applies
    model |= {"kind": "process", "process": {"stepTag": PRM_STEP_TAG, "aggregation": "min"}}
    started = time.monotonic()
    kubectl_apply(c, body)
    try:
        wait_for("the PRM's replica ready", lambda: ready_at(c, 1, name=PRM), READY_TIMEOUT_S, 1)
        ready_s = time.monotonic() - started
        table = kubectl(c, "get", "rm", PRM, "-n", NS)
        assert table_column(table, PRM, "KIND") == "process", table
        assert table_column(table, PRM, "PHASE") == "Ready", table
        # the address a client resolving the Service reaches (its Endpoints: ready Pods only)
        [(ip, port)] = wait_for(
            "the Service to route to the PRM", service_watch(c, set(), PRM).addresses, 30, 0.5
        ).items()
        with RewardClient(f"http://{ip}:{port}") as client:
            [got] = client.score_steps([PRM_SOLUTION], prompts=[PRM_QUESTION])
        reference = load_process_reward_model(model_dir)
        want = [probability(x) for x in step_log_odds(reference, model_dir, PRM_QUESTION, PRM_SOLUTION)]
        assert got.steps is not None and isinstance(got.score, float), got
        assert_scores([s.score for s in got.steps], want)
        assert_scores([got.score], [min(want)])  # the spec's aggregation, applied by the server
    finally:
        kubectl(c, "delete", "rm", PRM, "-n", NS)  # returns once the operator retired the object
    wait_for("the PRM's pod gone", lambda: not model_pods(c, PRM), 120, 1)
    print(f"\nthe PRM was Ready {ready_s:.1f} s after kubectl apply")


def test_helm_upgrade_then_uninstall_leaves_nothing(real_cluster: RealCluster) -> None:
    c = real_cluster
    helm_install_operator(c.kubeconfig, values={"operator.logLevel": "DEBUG", "operator.resyncInterval": "7"})
    dep = c.apps.read_namespaced_deployment(OPERATOR_RELEASE, OPERATOR_NAMESPACE)
    args = dep.spec.template.spec.containers[0].args
    assert "--log-level=DEBUG" in args and "--resync-interval=7" in args
    [pod] = [
        p for p in c.core.list_namespaced_pod(OPERATOR_NAMESPACE).items if not p.metadata.deletion_timestamp
    ]
    assert "--log-level=DEBUG" in pod.spec.containers[0].args and pod.status.phase == "Running"

    def lease_owners() -> list[str]:
        from kubernetes import client

        try:
            lease = client.CoordinationV1Api(c.api).read_namespaced_lease(
                "rewardplane-operator", OPERATOR_NAMESPACE
            )
        except client.exceptions.ApiException:
            return []
        return [f"{o.kind}/{o.name}" for o in lease.metadata.owner_references or []]

    # the operator makes its Lease at run time and has its Deployment own it
    wait_for(
        "the Deployment to own the Lease", lambda: lease_owners() == [f"Deployment/{dep.metadata.name}"], 60
    )
    helm(c, "uninstall", OPERATOR_RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait")

    def release_objects() -> str:
        # the Deployment goes at once; garbage collection then takes its ReplicaSets and the pod
        # (which gets SIGTERM: tini hands it to the operator, which exits)
        left = kubectl(
            c,
            "get",
            "all,serviceaccounts,roles,rolebindings,configmaps,secrets",
            "-n",
            OPERATOR_NAMESPACE,
            "-l",
            f"app.kubernetes.io/instance={OPERATOR_RELEASE}",
            "-o",
            "name",
        )
        cluster_wide = kubectl(
            c,
            "get",
            "clusterroles,clusterrolebindings",
            "-l",
            f"app.kubernetes.io/instance={OPERATOR_RELEASE}",
            "-o",
            "name",
        )
        pods = [p.metadata.name for p in c.core.list_namespaced_pod(OPERATOR_NAMESPACE).items]
        return (left + cluster_wide + " ".join(pods)).strip()

    # (the CRDs stay, by Helm's design: it never deletes what a chart's crds/ installed)
    wait_for("nothing of the release left", lambda: not release_objects(), 60)
    wait_for(
        "the Lease to go with the Deployment", lambda: lease_holder(c) is None and not lease_owners(), 60
    )


def test_an_image_lost_from_containerd_is_imported_again(real_cluster: RealCluster) -> None:
    # The import record (size and mtime of each tarball) can outlive containerd's content store;
    # trusting it alone once left a node without its pause image, whose pods never started.
    node = real_cluster.node
    operator_tar = realnode.images_dir() / "operator.tar"
    [name] = realnode.archive_image_names(operator_tar)
    assert name in node.image_names()
    node.ctr(["images", "rm", name])
    assert name not in node.image_names()
    assert node.import_images() == ["operator.tar"]  # the others are still there: skipped
    assert name in node.image_names()


def test_down_leaves_nothing_behind(real_cluster: RealCluster) -> None:
    state = real_cluster.node.layout.root
    assert realnode.leftovers(state) != []  # sanity: a running node is visible to the check
    left = real_cluster.node.down()
    assert left == [], left
    assert realnode.leftovers(state) == []
    assert not Path(f"/sys/class/net/{realnode.BRIDGE}").exists()
