"""The node agent's settings (:class:`AgentConfig`, one per agent and Node) and its fixed timings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from rewardplane.protocol import settings

TICK_S = 0.25  # how often a pod worker looks at its process and probes
API_TIMEOUT_S = 10  # every API call is bounded
CONFIG_RETRY_S = 2.0  # retry a pod whose Secret/ConfigMap is missing
START_MARKER = "rewardplane node agent: start #"  # the agent's line before each run in a pod's log
MARKER_ENV = settings.NODE_AGENT_ID.name  # finds our processes left over after an agent crash
POD_NETWORK_ENV = settings.POD_NETWORK.name  # --pod-network's default


@dataclass
class AgentConfig:
    node_name: str = "local-node"
    gpus: int = 0
    cpu: str = field(default_factory=lambda: str(os.cpu_count() or 1))
    memory: str = field(default_factory=lambda: detect_memory())
    max_pods: int = 110
    labels: dict[str, str] = field(default_factory=dict)
    state_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "rewardplane" / "node")
    heartbeat_s: float = 10.0
    max_grace_s: float = 30.0  # upper bound on any pod's termination grace period
    watch_timeout_s: int = 30  # the watch is re-opened (with a full re-list) this often
    pod_network: int = 0  # pods get 127.<pod_network>.x.y; agents sharing a host need different ones

    @property
    def agent_id(self) -> str:
        return f"{self.node_name}@{self.state_dir.resolve()}"


def detect_memory() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1])}Ki"
    except (OSError, ValueError, IndexError):
        pass
    return "8Gi"
