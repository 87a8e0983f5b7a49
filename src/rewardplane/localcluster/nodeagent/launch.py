"""What a pod's process is started with, and how long it gets to stop: pure functions of the pod,
the plan and the agent's settings.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime, timezone

from rewardplane.localcluster.nodeagent.config import MARKER_ENV
from rewardplane.localcluster.podspec import Pod


def process_env(
    base: Mapping[str, str],
    *,
    pod_name: str,
    agent_id: str,
    gpu_ids: tuple[int, ...],
    pinned: tuple[int, ...],
    pod_env: Mapping[str, str],
) -> dict[str, str]:
    """The agent's environment without its kubeconfig, the pod's basics, its GPUs, then the
    container's own variables (which win)."""
    env = dict(base)
    env.pop("KUBECONFIG", None)  # the pod gets no admin credentials by accident
    env.update({"HOSTNAME": pod_name, "PYTHONUNBUFFERED": "1", MARKER_ENV: agent_id})
    if gpu_ids or pinned:
        # device ids are nvidia-smi's (PCI order), not CUDA's default fastest-first order
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if gpu_ids:
        ids = ",".join(str(i) for i in gpu_ids)
        env.update({"CUDA_VISIBLE_DEVICES": ids, "NVIDIA_VISIBLE_DEVICES": ids})
    env.update(pod_env)
    return env


def grace_period(pod: Pod, max_grace_s: float) -> float:
    """The pod's termination grace period: the deletion's, else the spec's (30 s), capped."""
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    grace = meta.get("deletionGracePeriodSeconds")
    if grace is None:
        grace = spec.get("terminationGracePeriodSeconds", 30)
    return float(min(max(int(grace), 0), max_grace_s))


def parse_time(ts: str) -> float:
    """An RFC 3339 timestamp of the API (``...Z``) as a Unix time; now for anything else."""
    try:
        return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return time.time()
