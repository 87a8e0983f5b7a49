"""What a namespace's pods are doing, as text for an error message: when a workload does not
become ready (helm --wait timing out), the reason is in the pods' states, events and logs, and a
CI log only keeps what the error says."""

from __future__ import annotations

import subprocess
from pathlib import Path

from rewardplane.localcluster.binaries import BinaryNotFoundError, find_binary

# each section is cut to its last lines: enough for a CrashLoopBackOff's traceback or a scheduling
# refusal, short enough for an exception message
TAIL_LINES = 40


def _kubectl(kubeconfig: Path, *args: str, timeout_s: float = 20.0) -> str:
    try:
        done = subprocess.run(
            [str(find_binary("kubectl")), "--kubeconfig", str(kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (BinaryNotFoundError, OSError, subprocess.TimeoutExpired) as exc:
        return f"(kubectl {' '.join(args)} failed: {exc})"
    out = (done.stdout + done.stderr).strip()
    lines = out.splitlines()
    if len(lines) > TAIL_LINES:
        lines = [f"(... {len(lines) - TAIL_LINES} lines cut)", *lines[-TAIL_LINES:]]
    return "\n".join(lines) or "(nothing)"


def describe_namespace(kubeconfig: Path, namespace: str) -> str:
    """The pods (phase, readiness, restarts), the namespace's events and the recent logs of its
    chart-labelled pods, the crashed containers' previous logs too. Best effort: never raises."""
    logs = (
        "logs",
        "-n",
        namespace,
        "-l",
        "app.kubernetes.io/name",
        "--all-containers",
        "--prefix",
        "--tail=30",
    )
    parts = [
        f"--- pods in {namespace} ---\n" + _kubectl(kubeconfig, "get", "pods", "-n", namespace, "-o", "wide"),
        f"--- events in {namespace} ---\n"
        + _kubectl(kubeconfig, "get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
        f"--- logs in {namespace} ---\n" + _kubectl(kubeconfig, *logs),
    ]
    previous = _kubectl(kubeconfig, *logs, "--previous")
    if "previous terminated container" not in previous and "not found" not in previous:
        parts.append(f"--- logs of restarted containers in {namespace} ---\n{previous}")
    return "\n".join(parts)
