"""The node agent runs Pods bound to its Node as real local processes and reports their status."""

from __future__ import annotations

import os
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

WAIT_S = 30.0


def _core(kube_api: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(kube_api)


def _pod(name: str, node: str, command: list[str], **container: Any) -> dict[str, Any]:
    restart = container.pop("restartPolicy", "Always")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,  # bind-to-node: there is no scheduler
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "main", "image": "local/python", "command": command, **container}],
        },
    }


def _wait_pod(
    core: Any,
    ns: str,
    name: str,
    cond: Callable[[Any], bool],
    what: str,
    agent: Any,
    timeout_s: float = WAIT_S,
) -> Any:
    deadline = time.monotonic() + timeout_s
    pod = None
    while time.monotonic() < deadline:
        pod = core.read_namespaced_pod(name, ns, _request_timeout=10)
        if cond(pod):
            return pod
        time.sleep(0.2)
    raise AssertionError(
        f"pod {ns}/{name} not {what} within {timeout_s}s; status: "
        f"{pod.status if pod else None}\nagent log:\n{agent.log_tail()}"
    )


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def _pid(pod: Any) -> int:
    cid = pod.status.container_statuses[0].container_id
    return int(cid.rsplit("/", 1)[1])


@pytest.mark.cluster
def test_http_server_pod_gets_its_own_ip_and_becomes_ready(
    kube_api: Any, node_agent: Any, k8s_namespace: str
) -> None:
    core = _core(kube_api)
    pod = _pod(
        "web",
        node_agent.name,
        ["python", "-m", "http.server", "--bind", "$(POD_IP)", "8080"],
        env=[{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        ports=[{"name": "http", "containerPort": 8080}],
        readinessProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    )
    core.create_namespaced_pod(k8s_namespace, pod, _request_timeout=10)
    got = _wait_pod(core, k8s_namespace, "web", _ready, "Ready", node_agent)

    assert got.status.phase == "Running"
    ip = got.status.pod_ip
    assert re.fullmatch(r"127\.\d+\.\d+\.\d+", ip) and not ip.startswith("127.0.")  # the fixture's own range
    assert [i.ip for i in got.status.pod_ips] == [ip]
    assert got.status.host_ip == "127.0.0.1"
    assert got.status.start_time is not None
    cs = got.status.container_statuses[0]
    assert cs.ready and cs.state.running is not None and cs.restart_count == 0
    types = {c.type: c.status for c in got.status.conditions}
    assert types == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as resp:
        assert resp.status == 200


@pytest.mark.cluster
def test_crashing_process_is_restarted(kube_api: Any, node_agent: Any, k8s_namespace: str) -> None:
    core = _core(kube_api)
    crash = "import sys; print('starting'); sys.exit('RuntimeError: the cause of the crash')"
    core.create_namespaced_pod(
        k8s_namespace,
        _pod(
            "crash",
            node_agent.name,
            ["python", "-c", crash],
            terminationMessagePolicy="FallbackToLogsOnError",
        ),
        _request_timeout=10,
    )
    # As the kubelet: restarted at once after the first exit, then CrashLoopBackOff for 10 s
    got = _wait_pod(
        core,
        k8s_namespace,
        "crash",
        lambda p: (
            bool(p.status.container_statuses)
            and p.status.container_statuses[0].state.waiting is not None
            and p.status.container_statuses[0].state.waiting.reason == "CrashLoopBackOff"
        ),
        "in CrashLoopBackOff",
        node_agent,
    )
    cs = got.status.container_statuses[0]
    assert cs.restart_count == 1 and got.status.phase == "Running"  # restartPolicy Always keeps it Running
    uid = got.metadata.uid
    assert (
        cs.state.waiting.message
        == f"back-off 10s restarting failed container=main pod=crash_{k8s_namespace}({uid})"
    )
    # the cause, as the kubelet keeps it with FallbackToLogsOnError: this run's log tail
    terminated = cs.last_state.terminated
    assert terminated is not None and terminated.exit_code == 1 and terminated.reason == "Error"
    assert terminated.message == "starting\nRuntimeError: the cause of the crash\n", terminated.message


@pytest.mark.cluster
def test_deleting_the_pod_stops_the_process(kube_api: Any, node_agent: Any, k8s_namespace: str) -> None:
    from kubernetes.client.exceptions import ApiException

    core = _core(kube_api)
    core.create_namespaced_pod(
        k8s_namespace,
        _pod("sleeper", node_agent.name, ["python", "-c", "import time; time.sleep(600)"]),
        _request_timeout=10,
    )
    got = _wait_pod(core, k8s_namespace, "sleeper", _ready, "Ready", node_agent)
    pid = _pid(got)
    os.kill(pid, 0)  # the process runs on this machine

    core.delete_namespaced_pod("sleeper", k8s_namespace, _request_timeout=10)  # default grace
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            core.read_namespaced_pod("sleeper", k8s_namespace, _request_timeout=10)
        except ApiException as exc:
            assert exc.status == 404
            break
        assert time.monotonic() < deadline, f"pod not deleted by the agent:\n{node_agent.log_tail()}"
        time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.cluster
def test_secret_env_and_mounted_secret_reach_the_process(
    kube_api: Any, node_agent: Any, k8s_namespace: str, tmp_path: Path
) -> None:
    core = _core(kube_api)
    core.create_namespaced_secret(
        k8s_namespace,
        {
            "metadata": {"name": "creds"},
            "stringData": {"token": "s3cret-token", "config.json": '{"answer": 42}'},
        },
        _request_timeout=10,
    )
    out = tmp_path / "seen.txt"
    script = (
        "import os, pathlib; "
        "pathlib.Path(os.environ['OUT']).write_text("
        "os.environ['TOKEN'] + '|' + open('/etc/creds/config.json').read() + '|' + os.environ['CFG'])"
    )
    pod = _pod(
        "reader",
        node_agent.name,
        ["python", "-c", script],
        restartPolicy="Never",
        env=[
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
            {"name": "OUT", "value": str(out)},
            {"name": "CFG", "value": "/etc/creds/config.json"},
        ],
        volumeMounts=[{"name": "creds", "mountPath": "/etc/creds", "readOnly": True}],
    )
    pod["spec"]["volumes"] = [{"name": "creds", "secret": {"secretName": "creds"}}]
    core.create_namespaced_pod(k8s_namespace, pod, _request_timeout=10)
    got = _wait_pod(
        core,
        k8s_namespace,
        "reader",
        lambda p: p.status.phase in ("Succeeded", "Failed"),
        "finished",
        node_agent,
    )
    assert got.status.phase == "Succeeded", node_agent.log_tail()
    token, config, cfg_path = out.read_text().split("|")
    assert token == "s3cret-token"
    assert config == '{"answer": 42}'
    # the env value naming the mount path was rewritten to the per-pod secret directory
    assert cfg_path != "/etc/creds/config.json" and Path(cfg_path).parent.name == "creds"
    assert got.status.container_statuses[0].state.terminated.exit_code == 0


@pytest.mark.cluster
def test_a_process_can_bind_unix_sockets_in_its_scratch_volume(
    kube_api: Any, node_agent: Any, k8s_namespace: str, tmp_path: Path
) -> None:
    """vLLM binds ``ipc://$TMPDIR/<uuid>`` sockets (107-byte limit); with long pod and volume names
    the agent's per-pod directory alone is longer than that, so it must reach volumes by a short path."""
    core = _core(kube_api)
    out = tmp_path / "socket.txt"
    script = (
        "import os, pathlib, socket, uuid; "
        "path = os.path.join(os.environ['TMPDIR'], str(uuid.uuid4())); "
        "s = socket.socket(socket.AF_UNIX); s.bind(path); s.close(); os.unlink(path); "
        "pathlib.Path(os.environ['OUT']).write_text(path)"
    )
    name = "a-reward-model-with-a-rather-long-name-0"
    volume = "engine-scratch"
    pod = _pod(
        name,
        node_agent.name,
        ["python", "-c", script],
        restartPolicy="Never",
        env=[{"name": "TMPDIR", "value": "/scratch"}, {"name": "OUT", "value": str(out)}],
        volumeMounts=[{"name": volume, "mountPath": "/scratch"}],
    )
    pod["spec"]["volumes"] = [{"name": volume, "emptyDir": {}}]
    core.create_namespaced_pod(k8s_namespace, pod, _request_timeout=10)
    got = _wait_pod(
        core, k8s_namespace, name, lambda p: p.status.phase in ("Succeeded", "Failed"), "finished", node_agent
    )
    assert got.status.phase == "Succeeded", f"{got.status}\n{node_agent.log_tail()}"
    bound = out.read_text()
    assert len(bound.encode()) < 107, bound
    assert Path(bound).parent.resolve().name == volume  # the short path is the pod's own volume


@pytest.mark.cluster
def test_node_advertises_capacity_and_labels(kube_api: Any, node_agent: Any) -> None:
    node = _core(kube_api).read_node(node_agent.name, _request_timeout=10)
    assert node.status.capacity["nvidia.com/gpu"] == "1"
    assert node.status.allocatable["pods"] == "110"
    assert node.metadata.labels["rewardplane.io/test"] == "true"
    assert node.metadata.labels["kubernetes.io/hostname"] == node_agent.name


# A server that takes a few seconds to start (as vLLM takes minutes): ready once it serves.
SLOW_SERVER = (
    "import http.server, sys, time; time.sleep(float(sys.argv[2])); "
    "http.server.HTTPServer((sys.argv[1], int(sys.argv[3])), http.server.SimpleHTTPRequestHandler).serve_forever()"
)


def _slow_pod(name: str, node: str, port: int, delay_s: float, **container: Any) -> dict[str, Any]:
    return _pod(
        name,
        node,
        ["python", "-c", SLOW_SERVER, "$(POD_IP)", str(delay_s), str(port)],
        ports=[{"name": "http", "containerPort": port}],
        readinessProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        **container,
    )


def _waiting_message(pod: Any) -> str:
    statuses = pod.status.container_statuses or []
    waiting = statuses[0].state.waiting if statuses else None
    return (waiting.message or "") if waiting else ""


@pytest.mark.cluster
def test_pods_sharing_a_gpu_start_one_at_a_time_and_exclusive_pods_avoid_it(
    kube_api: Any, node_agent: Any, k8s_namespace: str
) -> None:
    core = _core(kube_api)
    port = 20000 + os.getpid() % 20000  # pods of other agents on this host may hold 127.0.0.2:8080
    pin = {
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "CUDA_VISIBLE_DEVICES", "value": "0"},
        ]
    }
    core.create_namespaced_pod(
        k8s_namespace, _slow_pod("first", node_agent.name, port, 6, **pin), _request_timeout=10
    )
    running = lambda p: bool(p.status.container_statuses and p.status.container_statuses[0].state.running)  # noqa: E731
    first = _wait_pod(core, k8s_namespace, "first", running, "running", node_agent)
    core.create_namespaced_pod(
        k8s_namespace, _slow_pod("second", node_agent.name, port, 0, **pin), _request_timeout=10
    )
    # while the first is still starting (not Ready), the second waits for it, saying why
    second = _wait_pod(
        core,
        k8s_namespace,
        "second",
        lambda p: "waiting for pod" in _waiting_message(p),
        "waiting",
        node_agent,
    )
    assert f"{k8s_namespace}/first on GPU 0" in _waiting_message(second)
    assert not _ready(core.read_namespaced_pod("first", k8s_namespace, _request_timeout=10))
    _wait_pod(core, k8s_namespace, "first", _ready, "Ready", node_agent)
    second = _wait_pod(core, k8s_namespace, "second", _ready, "Ready", node_agent)
    env = Path(f"/proc/{_pid(second)}/environ").read_bytes().split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=0" in env and b"CUDA_DEVICE_ORDER=PCI_BUS_ID" in env
    assert _pid(first) != _pid(second)

    # the node's one GPU is pinned by shared pods: a whole-GPU request is refused, naming them
    whole = _pod("whole", node_agent.name, ["python", "-c", "import time; time.sleep(60)"])
    whole["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    core.create_namespaced_pod(k8s_namespace, whole, _request_timeout=10)
    got = _wait_pod(
        core, k8s_namespace, "whole", lambda p: "in use by" in _waiting_message(p), "refused", node_agent
    )
    assert f"{k8s_namespace}/first" in _waiting_message(
        got
    ) and f"{k8s_namespace}/second" in _waiting_message(got)


# -- the agent's pure logic (no cluster needed) ------------------------------------------------------


def test_var_expansion_follows_kubernetes_rules() -> None:
    from rewardplane.localcluster.podspec import expand_vars

    env = {"A": "1", "POD_IP": "127.0.0.2"}
    assert expand_vars("--bind=$(POD_IP):$(A)", env) == "--bind=127.0.0.2:1"
    assert expand_vars("$$(A)", env) == "$(A)"  # escaped
    assert expand_vars("$(MISSING)", env) == "$(MISSING)"  # unknown names stay
    assert expand_vars("x$(A", env) == "x$(A"  # unterminated
    assert expand_vars("a$b$", env) == "a$b$"


def test_env_resolution_and_mount_rewriting(tmp_path: Path) -> None:
    from rewardplane.localcluster.podspec import PodConfigError, plan_process, plan_volumes

    pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {
            "nodeName": "n1",
            "containers": [
                {
                    "name": "c",
                    "command": ["python3", "serve.py", "--token-file=/etc/rp/token", "--host", "$(POD_IP)"],
                    "env": [
                        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        {"name": "URL", "value": "http://$(POD_IP):8000"},
                        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
                        {"name": "CACHE", "value": "/cache/models"},
                    ],
                    "volumeMounts": [
                        {"name": "rp", "mountPath": "/etc/rp"},
                        {"name": "cache", "mountPath": "/cache"},
                    ],
                }
            ],
            "volumes": [{"name": "rp", "secret": {"secretName": "s"}}, {"name": "cache", "emptyDir": {}}],
        },
    }
    secrets = {("ns", "s"): {"token": b"abc"}}
    vols = plan_volumes(pod, pod_dir=tmp_path, shared_dir=tmp_path / "shared", secrets=secrets, configmaps={})
    assert vols["rp"].files == {"token": b"abc"}
    plan = plan_process(pod, pod_ip="127.0.0.5", secrets=secrets, configmaps={}, volumes=vols, python="/py")
    assert plan.argv == [
        "/py",
        "serve.py",
        f"--token-file={tmp_path}/volumes/rp/token",
        "--host",
        "127.0.0.5",
    ]
    assert plan.env["URL"] == "http://127.0.0.5:8000"
    assert plan.env["NODE"] == "n1" and plan.env["TOKEN"] == "abc"
    assert plan.env["CACHE"] == f"{tmp_path}/volumes/cache/models"
    with pytest.raises(PodConfigError, match='secret "s" not found'):
        plan_process(pod, pod_ip="127.0.0.5", secrets={}, configmaps={}, volumes=vols)


def test_ip_allocation_is_unique_and_reuses_released_addresses() -> None:
    from rewardplane.localcluster.podspec import IPAllocator

    ips = IPAllocator()
    assert [ips.allocate(u) for u in ("a", "b")] == ["127.0.0.2", "127.0.0.3"]
    assert ips.allocate("a") == "127.0.0.2"  # stable per owner
    assert ips.allocate("c", preferred="127.0.0.9") == "127.0.0.9"
    assert ips.allocate("d", preferred="127.0.0.2") == "127.0.0.4"  # taken: next free
    ips.release("a")
    assert ips.allocate("e") == "127.0.0.2"


def test_each_agent_can_have_a_pod_network_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from rewardplane.localcluster.nodeagent import POD_NETWORK_ENV, build_parser
    from rewardplane.localcluster.podspec import IPAllocator
    from tests.fixtures.cluster import free_pod_network

    ips = IPAllocator(network=7)
    assert [ips.allocate(u) for u in ("a", "b")] == ["127.7.0.2", "127.7.0.3"]
    # an address from another network (the pod's before the agent's network changed) is not kept
    assert ips.allocate("c", preferred="127.0.0.9") == "127.7.0.4"
    assert ips.allocate("d", preferred="127.7.0.9") == "127.7.0.9"
    with pytest.raises(ValueError, match="0-255"):
        IPAllocator(network=256)

    monkeypatch.delenv(POD_NETWORK_ENV, raising=False)
    assert build_parser().parse_args([]).pod_network == 0  # users' default: 127.0.0.2, ...
    assert build_parser().parse_args(["--pod-network", "3"]).pod_network == 3
    monkeypatch.setenv(POD_NETWORK_ENV, "9")
    assert build_parser().parse_args([]).pod_network == 9

    # the fixture's choice avoids a network in which a server on this host listens
    n = free_pod_network()
    assert 1 <= n <= 255
    with socket.socket() as taken:
        taken.bind((f"127.{n}.0.2", 0))
        taken.listen()
        assert free_pod_network() != n


def test_status_reports_crash_loop_and_readiness() -> None:
    from rewardplane.localcluster.podspec import ContainerRuntime, build_pod_status

    rt = ContainerRuntime(name="main", pod_ip="127.0.0.2", pod_start=100.0)
    assert build_pod_status(rt, 100.0)["phase"] == "Pending"
    rt.running_since, rt.waiting_reason, rt.pid = 101.0, None, 42
    st = build_pod_status(rt, 101.0)
    assert st["phase"] == "Running" and st["podIPs"] == [{"ip": "127.0.0.2"}]
    assert {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "False"
    rt.ready = True
    st = build_pod_status(rt, 102.0)
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["lastTransitionTime"].endswith(":42Z")
    rt.running_since, rt.ready, rt.pid = None, False, None
    rt.last_exit, rt.waiting_reason, rt.restart_count = (1, "Error", 101.0, 103.0), "CrashLoopBackOff", 1
    cs = build_pod_status(rt, 103.0)["containerStatuses"][0]
    assert cs["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert cs["lastState"]["terminated"]["exitCode"] == 1 and cs["restartCount"] == 1
