"""spec.transport: what a push between hosts needs of the reward servers' Pods, rendered and
refused as a user of a cross-host cluster expects; and the address status gives for NCCL."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rewardplane.api.spec import PLACEMENT_REFUSED, InvalidSpecError
from rewardplane.operator.planning import ClusterView, NodeInfo, plan_reward_model, validate_spec
from rewardplane.operator.render import render_pod
from rewardplane.operator.status import NETWORK_STATUS_ANNOTATION, nccl_address
from tests.unit.test_planning import NODES, rm


def pod_of(body: dict[str, Any], replica: int = 0) -> dict[str, Any]:
    plan = plan_reward_model(body, ClusterView(nodes=NODES))
    return render_pod(body, plan, plan.replicas[replica])


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def test_without_transport_the_pod_stays_on_the_pod_network_unprivileged() -> None:
    pod = pod_of(rm())
    ctx = pod["spec"]["containers"][0]["securityContext"]
    assert "hostNetwork" not in pod["spec"]
    assert ctx["runAsNonRoot"] is True and ctx["capabilities"] == {"drop": ["ALL"]}
    assert not [k for k in env_of(pod) if k.startswith("NCCL_")]


def test_nccl_environment_and_interface_reach_the_server() -> None:
    body = rm(
        transport={"env": {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_IB_GID_INDEX": "3"}, "interface": "net1"}
    )
    env = env_of(pod_of(body))
    assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert env["NCCL_IB_GID_INDEX"] == "3"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "net1"  # GPU and CPU groups
    assert "POD_IP" in env  # the operator's own variables are still there


def test_host_network_keeps_the_cluster_dns() -> None:
    pod = pod_of(rm(transport={"hostNetwork": True}))
    assert pod["spec"]["hostNetwork"] is True
    assert pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_ipc_lock_runs_as_root_with_that_capability_only() -> None:
    ctx = pod_of(rm(transport={"ipcLock": True}))["spec"]["containers"][0]["securityContext"]
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert ctx["runAsUser"] == 0 and "runAsNonRoot" not in ctx
    assert ctx["allowPrivilegeEscalation"] is False


def test_ipc_lock_with_a_persist_dir_adds_both_capabilities() -> None:
    body = rm(transport={"ipcLock": True}, weightSync={"persistDir": "/var/lib/rp"})
    ctx = pod_of(body)["spec"]["containers"][0]["securityContext"]
    assert ctx["capabilities"]["add"] == ["DAC_OVERRIDE", "IPC_LOCK"]


def test_a_transport_setting_changes_the_pods_spec_hash() -> None:
    # a changed transport must roll the replicas: the hash decides whether a Pod is replaced
    before = pod_of(rm())["metadata"]["annotations"]
    after = pod_of(rm(transport={"env": {"NCCL_DEBUG": "INFO"}}))["metadata"]["annotations"]
    assert before != after


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "PATH", "REWARDPLANE_TOKEN", "nccl_debug"])
def test_environment_other_than_the_transfers_is_refused_by_name(name: str) -> None:
    errors = validate_spec(rm(transport={"env": {name: "x"}})["spec"])
    assert len(errors) == 1 and name in errors[0] and "NCCL_" in errors[0]


@pytest.mark.parametrize("variable", ["NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"])
def test_an_interface_set_twice_differently_is_refused(variable: str) -> None:
    errors = validate_spec(rm(transport={"interface": "eth0", "env": {variable: "ib0"}})["spec"])
    assert len(errors) == 1 and "spec.transport.interface" in errors[0] and variable in errors[0]
    assert not validate_spec(rm(transport={"interface": "eth0", "env": {variable: "eth0"}})["spec"])


@pytest.mark.parametrize("name", ["eth0; rm -rf /", "^docker", "eth0,eth1", "a-very-long-interface-name"])
def test_an_interface_is_one_name_the_kernel_allows(name: str) -> None:
    # NCCL's prefix forms would break gloo (GLOO_SOCKET_IFNAME takes names): they go in env
    errors = validate_spec(rm(transport={"interface": name})["spec"])
    assert errors and "spec.transport.interface" in errors[0]


def test_host_network_replicas_each_need_a_node() -> None:
    one_node = ClusterView(nodes=(NodeInfo("cpu-a"),))
    body = rm(replicas=2, engine={"kind": "hf"}, gpu={"mode": "none"}, transport={"hostNetwork": True})
    with pytest.raises(InvalidSpecError) as info:
        plan_reward_model(body, one_node)
    assert info.value.reason == PLACEMENT_REFUSED
    assert "replicas 0 and 1" in info.value.errors[0] and "cpu-a" in info.value.errors[0]
    two_nodes = ClusterView(nodes=(NodeInfo("cpu-a"), NodeInfo("cpu-b")))
    plan = plan_reward_model(body, two_nodes)
    assert {r.node for r in plan.replicas} == {"cpu-a", "cpu-b"}


def test_nccl_address_is_the_interfaces_on_a_secondary_network() -> None:
    status = [
        {"name": "default", "interface": "eth0", "ips": ["10.244.0.7"], "default": True},
        {"name": "rdma-net", "interface": "net1", "ips": ["192.168.50.7"]},
    ]
    pod = {
        "metadata": {"annotations": {NETWORK_STATUS_ANNOTATION: json.dumps(status)}},
        "status": {"podIP": "10.244.0.7"},
    }
    assert nccl_address(pod, "net1") == "192.168.50.7"
    assert nccl_address(pod, None) == "10.244.0.7"
    assert nccl_address(pod, "net9") == "10.244.0.7"  # not listed: the Pod's IP


def test_nccl_address_survives_a_malformed_network_status() -> None:
    pod = {
        "metadata": {"annotations": {NETWORK_STATUS_ANNOTATION: "{not json"}},
        "status": {"podIP": "10.0.0.3"},
    }
    assert nccl_address(pod, "net1") == "10.0.0.3"


def test_host_ipc_puts_the_servers_in_the_nodes_ipc_namespace() -> None:
    """A trainer in its own Pod on the reward model's node and GPUs pushes over CUDA IPC (shared
    memory on CPU) only across one IPC namespace: spec.transport.hostIPC renders it."""
    body = rm(transport={"hostIPC": True})
    pod = pod_of(body)
    assert pod["spec"]["hostIPC"] is True
    assert "hostNetwork" not in pod["spec"]  # the IPC namespace only: the Pod network stays
    assert pod["spec"]["containers"][0]["securityContext"]["runAsNonRoot"] is True
    assert "hostIPC" not in pod_of(rm())["spec"]
    assert validate_spec(body["spec"]) == []


def test_host_ipc_changes_the_pods_spec_hash() -> None:
    """Turning hostIPC on replaces the running Pods (their namespaces are fixed at creation)."""
    from rewardplane.operator.render import ANNOTATION_SPEC_HASH

    before = pod_of(rm())["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    after = pod_of(rm(transport={"hostIPC": True}))["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    assert before != after
