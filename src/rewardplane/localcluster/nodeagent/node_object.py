"""The Node object the agent registers and the status it heartbeats (pure functions of the config)."""

from __future__ import annotations

import platform
import uuid
from typing import Any

from rewardplane.localcluster.nodeagent.config import AgentConfig
from rewardplane.localcluster.podspec import rfc3339


def node_object(cfg: AgentConfig) -> dict[str, Any]:
    labels = {
        "kubernetes.io/hostname": cfg.node_name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": {"x86_64": "amd64", "aarch64": "arm64"}.get(
            platform.machine(), platform.machine()
        ),
        "rewardplane.io/node-agent": "true",
        **cfg.labels,
    }
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": cfg.node_name, "labels": labels}}


def node_status(
    cfg: AgentConfig,
    now: float,
    *,
    ready: bool = True,
    reason: str = "KubeletReady",
    message: str = "rewardplane node agent is posting ready status",
) -> dict[str, Any]:
    resources = {
        "cpu": cfg.cpu,
        "memory": cfg.memory,
        "pods": str(cfg.max_pods),
        "nvidia.com/gpu": str(cfg.gpus),
        "ephemeral-storage": "100Gi",
    }
    ts = rfc3339(now)

    def cond(ctype: str, status: str, why: str, msg: str) -> dict[str, Any]:
        return {
            "type": ctype,
            "status": status,
            "reason": why,
            "message": msg,
            "lastHeartbeatTime": ts,
            "lastTransitionTime": ts,
        }

    return {
        "capacity": resources,
        "allocatable": resources,
        "conditions": [
            cond("Ready", "True" if ready else "False", reason, message),
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "no memory pressure"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID", "enough PIDs"),
        ],
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": cfg.node_name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        "nodeInfo": {
            "machineID": uuid.UUID(int=uuid.getnode()).hex,
            "systemUUID": "",
            "bootID": "",
            "kernelVersion": platform.release(),
            "osImage": platform.platform(),
            "containerRuntimeVersion": "rewardplane-node://local-process",
            "kubeletVersion": "v1.20.2-rewardplane",
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": node_object(cfg)["metadata"]["labels"]["kubernetes.io/arch"],
        },
    }
