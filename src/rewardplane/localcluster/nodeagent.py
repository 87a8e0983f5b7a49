"""The node agent: a stand-in for the kubelet that runs Pods as local processes.

It registers a Node (capacity incl. ``nvidia.com/gpu``), keeps it Ready with heartbeats, and
watches Pods bound to it (``spec.nodeName``; there is no scheduler, the operator binds pods
itself). For each pod it:

- gives the pod its own loopback address 127.N.0.x (x from 2 up; N: ``--pod-network``, 0 by
  default) as ``status.podIP``;
- writes Secret / ConfigMap volumes into a per-pod directory and rewrites each volumeMount's
  ``mountPath`` prefix in command, args and env values to that directory (there is no mount
  namespace: the process sees the host's filesystem);
- hands out GPUs (:mod:`.gpus`): whole devices for ``nvidia.com/gpu`` requests, none that a
  shared-mode pod pins with its own ``CUDA_VISIBLE_DEVICES``; pods pinning one device start one at
  a time (vLLM measures the device's free memory while it starts);
- runs the first container's ``command`` + ``args`` (``$(VAR)`` expanded; ``python``/``python3``
  become the agent's own interpreter) in its own process group, output to a per-pod log file;
- reports status through the status subresource: phase, podIP, containerStatuses, conditions,
  Ready only once the readinessProbe passes; restarts crashed processes with the kubelet's
  back-off (:mod:`.backoff`: CrashLoopBackOff, the log's tail as the cause);
- on deletion stops the process (SIGTERM, SIGKILL after the grace period) and deletes the Pod
  with gracePeriodSeconds=0, as the kubelet does.

Pure logic lives in :mod:`.podspec`, :mod:`.probes`, :mod:`.gpus` and :mod:`.backoff`; this module is
the I/O around it.
Run it as ``rewardplane node`` or ``python -m rewardplane.localcluster.nodeagent``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rewardplane.localcluster.backoff import KUBELET, crash_loop_message, fallback_termination_message
from rewardplane.localcluster.gpus import GpuInventory, pinned_devices
from rewardplane.localcluster.podspec import (
    ContainerRuntime,
    IPAllocator,
    Objects,
    Pod,
    PodConfigError,
    ProcessPlan,
    VolumePlan,
    build_pod_status,
    decode_secret_data,
    encode_configmap_data,
    gpu_request,
    map_argv,
    plan_process,
    plan_volumes,
    rfc3339,
)
from rewardplane.localcluster.probes import ProbeTracker, run_probe

log = logging.getLogger("rewardplane.nodeagent")

TICK_S = 0.25  # how often a pod worker looks at its process and probes
API_TIMEOUT_S = 10  # every API call is bounded
CONFIG_RETRY_S = 2.0  # retry a pod whose Secret/ConfigMap is missing
START_MARKER = "rewardplane node agent: start #"  # the agent's line before each run in a pod's log
MARKER_ENV = "REWARDPLANE_NODE_AGENT_ID"  # finds our processes left over after an agent crash
POD_NETWORK_ENV = "REWARDPLANE_POD_NETWORK"  # --pod-network's default


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


# -- the Node object (pure) ------------------------------------------------------------------------
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


# -- process helpers --------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it if the agent's spawning thread dies, so a killed
    agent leaves no pod processes behind (Linux only; harmless elsewhere)."""
    if _PRCTL is not None:
        with contextlib.suppress(Exception):
            _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_PRCTL: Callable[..., int] | None
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def kill_group(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM the process group, SIGKILL after ``grace_s``; returns the exit code (bounded)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=max(grace_s, 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers the leader left in its group
    rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    return 128 - rc if rc < 0 else rc  # -15 (signal) -> 143, as container runtimes report


def kill_leftovers(agent_id: str) -> int:
    """Kill process groups an earlier (crashed) agent with the same id left running."""
    killed = 0
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{MARKER_ENV}={agent_id}".encode() in environ:
            pid = int(entry.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                    killed += 1
    return killed


def _json(resp: Any) -> dict[str, Any]:
    return json.loads(resp.data)


# -- one pod -----------------------------------------------------------------------------------------
class PodWorker(threading.Thread):
    """Owns one pod's process from start to deletion; every wait is bounded."""

    def __init__(self, agent: NodeAgent, pod: Pod) -> None:
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.ns: str = meta.get("namespace", "default")
        self.pod_name: str = meta["name"]
        super().__init__(name=f"pod-{self.ns}/{self.pod_name}", daemon=True)
        self.agent = agent
        self.pod = pod
        self._lock = threading.Lock()
        self.wake = threading.Event()
        self._gone = False
        self._shutdown = False
        spec = pod.get("spec", {})
        containers = spec.get("containers") or [{}]
        self.container: dict[str, Any] = containers[0]
        if len(containers) > 1:
            log.warning(
                "pod %s/%s: only the first container (%s) runs; %d others are ignored",
                self.ns,
                self.pod_name,
                self.container.get("name"),
                len(containers) - 1,
            )
        self.rt = ContainerRuntime(
            name=self.container.get("name", "main"), image=self.container.get("image", "")
        )
        self.restart_policy = spec.get("restartPolicy", "Always")
        self.pod_dir = agent.cfg.state_dir / "pods" / f"{self.ns}_{self.pod_name}_{self.uid[:8]}"
        self.log_path = self.pod_dir / f"{self.rt.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.plan: ProcessPlan | None = None
        self.starts = 0
        self.backoff_s: float | None = None  # the kubelet's per-container back-off (None: no crash yet)
        self.next_start = 0.0
        rp, lp = self.container.get("readinessProbe"), self.container.get("livenessProbe")
        self.readiness = ProbeTracker(rp, healthy=False) if rp else None
        self.liveness = ProbeTracker(lp, healthy=True) if lp else None
        # As the kubelet does: until the startup probe passes, no other probe runs.
        sp = self.container.get("startupProbe")
        self.startup = ProbeTracker(sp, healthy=False) if sp else None
        self.last_status: dict[str, Any] | None = None

    # -- called from the agent's threads
    def update(self, pod: Pod) -> None:
        with self._lock:
            self.pod = pod
        self.wake.set()

    def gone(self) -> None:
        self._gone = True
        self.wake.set()

    def shutdown(self) -> None:
        self._shutdown = True
        self.wake.set()

    # -- the worker thread
    def run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("pod %s/%s: worker failed", self.ns, self.pod_name)
        finally:
            if self.proc is not None:
                kill_group(self.proc, 2.0)
                self.proc = None
            shutil.rmtree(self.pod_dir / "volumes", ignore_errors=True)  # secrets off the disk
            remove_short_link(short_link_path(self.uid))
            self.agent.worker_done(self)

    def _loop(self) -> None:
        prev_ip = (self.pod.get("status") or {}).get("podIP")
        self.rt.pod_ip = self.agent.allocate_ip(self.uid, prev_ip)
        started = (self.pod.get("status") or {}).get("startTime")
        self.rt.pod_start = time.time() if not started else _parse_time(started)
        # After an agent restart the pod's process is a new one: count it as a restart.
        prev = ((self.pod.get("status") or {}).get("containerStatuses") or [{}])[0]
        if prev.get("containerID") or prev.get("restartCount"):
            self.starts = 1
            self.rt.restart_count = int(prev.get("restartCount") or 0)
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        while True:
            with self._lock:
                pod = self.pod
            if self._gone:
                self._stop_process(min(self._grace(pod), 5.0))
                return
            if self._shutdown:
                self._stop_process(min(self._grace(pod), self.agent.cfg.max_grace_s))
                self.rt.waiting_reason, self.rt.waiting_message = "NodeAgentStopped", "the node agent stopped"
                self._report(time.time())
                return
            if pod["metadata"].get("deletionTimestamp"):
                self._stop_process(self._grace(pod))
                self._delete_pod()
                return
            now = time.time()
            self._tick(now)
            self._report(now)
            self.wake.wait(TICK_S)
            self.wake.clear()

    def _grace(self, pod: Pod) -> float:
        meta, spec = pod.get("metadata", {}), pod.get("spec", {})
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", 30)
        return float(min(max(int(grace), 0), self.agent.cfg.max_grace_s))

    def _tick(self, now: float) -> None:
        if self.rt.terminal_phase:
            return
        if self.proc is None:
            if now >= self.next_start:
                self._try_start(now)
            return
        rc = self.proc.poll()
        if rc is None:
            self._probe()
            return
        self._on_exit(128 - rc if rc < 0 else rc, time.time())

    # -- start
    def _try_start(self, now: float) -> None:
        try:
            plan, gpu_ids, pinned = self._prepare()
        except PodConfigError as exc:
            self._config_problem("CreateContainerConfigError", str(exc), now)
            return
        except Exception as exc:  # API unreachable and the like: transient
            self._config_problem("ContainerCreating", f"preparing the pod failed: {exc}", now)
            return
        # A pod on a shared GPU starts only when no neighbour is starting, and then blocks them
        # until its first probe passes (vLLM measures the device's free memory while it starts).
        has_probe = self.startup is not None or self.readiness is not None
        blocker = self.agent.begin_gpu_start(self.uid, mark=has_probe) if pinned else None
        if blocker:
            self._config_problem("ContainerCreating", blocker, now)
            return
        env = dict(os.environ)
        env.pop("KUBECONFIG", None)  # the pod gets no admin credentials by accident
        env.update({"HOSTNAME": self.pod_name, "PYTHONUNBUFFERED": "1", MARKER_ENV: self.agent.cfg.agent_id})
        if gpu_ids or pinned:
            # device ids are nvidia-smi's (PCI order), not CUDA's default fastest-first order
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if gpu_ids:
            ids = ",".join(str(i) for i in gpu_ids)
            env.update({"CUDA_VISIBLE_DEVICES": ids, "NVIDIA_VISIBLE_DEVICES": ids})
        env.update(plan.env)
        cwd = plan.cwd if plan.cwd and Path(plan.cwd).is_dir() else str(self.pod_dir)
        restarting = self.starts > 0
        with open(self.log_path, "ab") as logf:
            logf.write(f"--- {rfc3339(now)} {START_MARKER}{self.starts + 1}: {plan.argv}\n".encode())
            logf.flush()
            try:
                self.proc = subprocess.Popen(
                    plan.argv,
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent if _PRCTL is not None else None,
                )
            except OSError as exc:
                logf.write(f"--- start failed: {exc}\n".encode())
                self.starts += 1
                if restarting:
                    self.rt.restart_count += 1
                self.rt.running_since = now  # so that _on_exit records a start time
                self._on_exit(128, now, reason="StartError", message=str(exc))
                return
        self.starts += 1
        if restarting:
            self.rt.restart_count += 1
        self.plan = plan
        self.rt.pid = self.proc.pid
        self.rt.running_since = now
        self.rt.waiting_reason = self.rt.waiting_message = None
        self.rt.ready = self.readiness is None
        self.rt.started = self.startup is None  # as the kubelet: started once the startup probe passed
        for tracker in (self.readiness, self.liveness, self.startup):
            if tracker:
                tracker.healthy = tracker is self.liveness
                tracker.start(now)
        log.info(
            "pod %s/%s: started pid %d on %s: %s",
            self.ns,
            self.pod_name,
            self.proc.pid,
            self.rt.pod_ip,
            plan.argv,
        )

    def _config_problem(self, reason: str, message: str, now: float) -> None:
        if message != self.rt.waiting_message:
            log.warning("pod %s/%s: %s: %s", self.ns, self.pod_name, reason, message)
        self.rt.waiting_reason, self.rt.waiting_message = reason, message
        self.next_start = now + CONFIG_RETRY_S

    def _prepare(self) -> tuple[ProcessPlan, tuple[int, ...], tuple[int, ...]]:
        """Read the Secrets/ConfigMaps the pod uses, write its volumes, plan the process; claim
        its GPUs. Returns (plan, devices the agent chose for it, devices it pins itself)."""
        with self._lock:
            pod = self.pod
        secrets, configmaps = self.agent.read_refs(pod)
        per_pod = short_volumes_link(self.uid, self.pod_dir / "volumes")
        volumes = plan_volumes(
            pod,
            pod_dir=self.pod_dir,
            volumes_dir=per_pod,
            shared_dir=self.agent.cfg.state_dir / "volumes",
            secrets=secrets,
            configmaps=configmaps,
        )
        write_volumes(volumes.values(), per_pod)
        plan = plan_process(
            pod, pod_ip=self.rt.pod_ip or "127.0.0.1", secrets=secrets, configmaps=configmaps, volumes=volumes
        )
        n_gpu = gpu_request(pod)
        name = f"{self.ns}/{self.pod_name}"
        if n_gpu:
            return plan, self.agent.claim_gpus(self.uid, name, n_gpu), ()
        pinned = pinned_devices(plan.env, n_gpu, self.agent.cfg.gpus)
        if pinned:
            self.agent.pin_gpus(self.uid, name, pinned)
        return plan, (), pinned

    # -- running
    def _probe(self) -> None:
        assert self.proc is not None
        if self.startup is not None and not self.startup.healthy:
            self._probe_startup(self.startup)
            return
        for tracker in (self.readiness, self.liveness):
            if tracker is None or not tracker.due(time.time()):
                continue
            ok, detail = run_probe(
                tracker.probe,
                pod_ip=self.rt.pod_ip or "127.0.0.1",
                container=self.container,
                exec_argv=self._exec_argv,
            )
            healthy = tracker.record(ok, detail, time.time())
            if tracker is self.readiness:
                if healthy != self.rt.ready:
                    log.info("pod %s/%s: ready=%s (%s)", self.ns, self.pod_name, healthy, detail)
                if healthy:
                    self.agent.set_gpu_starting(self.uid, False)
                self.rt.ready = healthy
            elif not healthy:
                log.warning(
                    "pod %s/%s: liveness probe failed (%s); restarting", self.ns, self.pod_name, detail
                )
                code = kill_group(self.proc, self._grace(self.pod))
                self._on_exit(code, time.time(), reason="Error", message=f"liveness probe failed: {detail}")
                return

    def _probe_startup(self, tracker: ProbeTracker) -> None:
        """Run the startup probe: its first success starts the other probes; ``failureThreshold``
        failures in a row restart the process."""
        assert self.proc is not None
        if not tracker.due(time.time()):
            return
        ok, detail = run_probe(
            tracker.probe,
            pod_ip=self.rt.pod_ip or "127.0.0.1",
            container=self.container,
            exec_argv=self._exec_argv,
        )
        tracker.record(ok, detail, time.time())
        if ok:
            tracker.healthy = True
            self.rt.started = True
            self.agent.set_gpu_starting(self.uid, False)
            for other in (self.readiness, self.liveness):
                if other:
                    other.start(time.time())
        elif tracker.failures >= int(tracker.probe.get("failureThreshold") or 3):
            log.warning("pod %s/%s: startup probe failed (%s); restarting", self.ns, self.pod_name, detail)
            code = kill_group(self.proc, self._grace(self.pod))
            self._on_exit(code, time.time(), reason="Error", message=f"startup probe failed: {detail}")

    def _exec_argv(self, argv: list[str]) -> tuple[list[str], dict[str, str]]:
        plan = self.plan
        env = dict(os.environ)
        if plan is None:
            return argv, env
        env.update(plan.env)
        return map_argv(argv, plan.env, plan.mounts), env

    def _on_exit(
        self, code: int, now: float, *, reason: str | None = None, message: str | None = None
    ) -> None:
        reason = reason or ("Completed" if code == 0 else "Error")
        started = self.rt.running_since or now
        self.rt.last_exit = (code, reason, started, now)
        self.rt.last_exit_message = message if message is not None else self._log_cause(code)
        self.rt.running_since = None
        self.rt.pid = None
        self.rt.ready = False
        self.proc = None
        self.agent.set_gpu_starting(self.uid, False)
        log.info("pod %s/%s: process exited with code %d (%s)", self.ns, self.pod_name, code, reason)
        if not (self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and code != 0)):
            self.rt.terminal_phase = "Succeeded" if code == 0 else "Failed"
            return
        delay, self.backoff_s = KUBELET.after_exit(self.backoff_s, now - started)
        self.next_start = now + delay
        if delay == 0:  # the kubelet restarts at once: no back-off to show
            self.rt.waiting_reason, self.rt.waiting_message = None, None
            return
        self.rt.waiting_reason = "CrashLoopBackOff"  # also after exit 0: Always means keep running
        self.rt.waiting_message = crash_loop_message(delay, self.rt.name, self.pod_name, self.ns, self.uid)

    def _log_cause(self, code: int) -> str | None:
        """``FallbackToLogsOnError``: a failed run's log tail (this run's lines only) as its cause."""
        if code == 0 or self.container.get("terminationMessagePolicy") != "FallbackToLogsOnError":
            return None
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return None
        marker = text.rfind(START_MARKER)
        if marker >= 0:
            text = text[text.find("\n", marker) + 1 :]
        return fallback_termination_message(text) or None

    def _stop_process(self, grace_s: float) -> None:
        if self.proc is None:
            return
        code = kill_group(self.proc, grace_s)
        log.info("pod %s/%s: stopped (exit %d)", self.ns, self.pod_name, code)
        self.rt.last_exit = (
            code,
            "Completed" if code == 0 else "Error",
            self.rt.running_since or time.time(),
            time.time(),
        )
        self.rt.last_exit_message = None
        self.rt.running_since = self.rt.pid = None
        self.rt.ready = False
        self.proc = None
        self.agent.set_gpu_starting(self.uid, False)

    # -- API
    def _report(self, now: float) -> None:
        status = build_pod_status(self.rt, now)
        if status == self.last_status:
            return
        with self._lock:
            qos = (self.pod.get("status") or {}).get("qosClass")
        if qos:
            status["qosClass"] = qos
        try:
            # JSON-patch `replace /status`: the whole status at once (a merge patch would keep
            # a stale `waiting` beside a new `running`) and no resourceVersion races: only this
            # agent writes the status of pods bound to its node.
            self.agent.core.patch_namespaced_pod_status(
                self.pod_name,
                self.ns,
                [{"op": "replace", "path": "/status", "value": status}],
                _content_type="application/json-patch+json",
                _request_timeout=API_TIMEOUT_S,
            )
            status.pop("qosClass", None)
            self.last_status = status
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                self._gone = True
            else:
                log.warning("pod %s/%s: status update failed (will retry): %s", self.ns, self.pod_name, exc)

    def _delete_pod(self) -> None:
        from kubernetes import client

        try:
            self.agent.core.delete_namespaced_pod(
                self.pod_name,
                self.ns,
                grace_period_seconds=0,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)
                ),
                _request_timeout=API_TIMEOUT_S,
            )
            log.info("pod %s/%s: deleted", self.ns, self.pod_name)
        except Exception as exc:
            if getattr(exc, "status", None) not in (404, 409):
                log.warning("pod %s/%s: final delete failed: %s", self.ns, self.pod_name, exc)


# Unix socket paths are limited to 107 bytes (sockaddr_un); programs put sockets under $TMPDIR
# (vLLM: ``ipc://$TMPDIR/<uuid>``, 43 bytes of it). A pod's emptyDir under a long state directory
# leaves no room, so the node agent reaches the per-pod volumes through a short link instead.
SHORT_LINK_PREFIX = "rp-"


def short_link_path(pod_uid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"{SHORT_LINK_PREFIX}{pod_uid.replace('-', '')[:12]}"


def short_volumes_link(pod_uid: str, target: Path) -> Path:
    """A short symlink (``<tmp>/rp-<uid>``) to ``target`` (the pod's volumes directory), made or
    refreshed here; the pod's processes see its volumes through it. ``remove_short_link`` drops it."""
    link = short_link_path(pod_uid)
    target.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        if Path(os.readlink(link)) == target:
            return link
        link.unlink()
    elif link.exists():  # not ours: keep the long path rather than touch it
        log.warning("%s exists and is not a link; pod volumes keep their long path %s", link, target)
        return target
    link.symlink_to(target, target_is_directory=True)
    return link


def remove_short_link(link: Path) -> None:
    if link.is_symlink():
        link.unlink(missing_ok=True)


def write_volumes(volumes: Any, per_pod_dir: Path) -> None:
    """Create each volume's directory and (re)write Secret/ConfigMap keys as files; the pod's own
    (under ``per_pod_dir``) are private to it."""
    for vol in volumes:
        assert isinstance(vol, VolumePlan)
        if vol.files or vol.directory.is_relative_to(per_pod_dir):
            if vol.files:
                shutil.rmtree(vol.directory, ignore_errors=True)  # keys removed upstream vanish
            vol.directory.mkdir(parents=True, exist_ok=True)
            vol.directory.chmod(0o700)
        else:
            vol.directory.mkdir(parents=True, exist_ok=True)
        for rel, data in vol.files.items():
            target = vol.directory / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(vol.mode)


def _parse_time(ts: str) -> float:
    try:
        return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return time.time()


# -- the agent -----------------------------------------------------------------------------------------
class NodeAgent:
    """Registers the Node, heartbeats, watches its pods and runs a PodWorker for each."""

    def __init__(self, api_client: Any, cfg: AgentConfig) -> None:
        from kubernetes import client

        self.cfg = cfg
        self.core = client.CoreV1Api(api_client)
        self.stop_event = threading.Event()
        self._ips = IPAllocator(network=cfg.pod_network)
        self._gpus = GpuInventory(cfg.gpus)
        self._alloc_lock = threading.Lock()
        self._workers: dict[str, PodWorker] = {}
        self._workers_lock = threading.Lock()
        self._selector = f"spec.nodeName={cfg.node_name}"

    # -- allocation (called from workers)
    def allocate_ip(self, uid: str, preferred: str | None) -> str:
        with self._alloc_lock:
            return self._ips.allocate(uid, preferred)

    def claim_gpus(self, uid: str, name: str, n: int) -> tuple[int, ...]:
        with self._alloc_lock:
            return self._gpus.claim_exclusive(uid, name, n)

    def pin_gpus(self, uid: str, name: str, devices: tuple[int, ...]) -> None:
        with self._alloc_lock:
            self._gpus.pin(uid, name, devices)

    def begin_gpu_start(self, uid: str, *, mark: bool) -> str | None:
        with self._alloc_lock:
            return self._gpus.begin_start(uid, mark=mark)

    def set_gpu_starting(self, uid: str, starting: bool) -> None:
        with self._alloc_lock:
            self._gpus.set_starting(uid, starting)

    def worker_done(self, worker: PodWorker) -> None:
        with self._alloc_lock:
            self._ips.release(worker.uid)
            self._gpus.release(worker.uid)
        with self._workers_lock:
            if self._workers.get(worker.uid) is worker:
                del self._workers[worker.uid]

    def read_refs(self, pod: Pod) -> tuple[Objects, Objects]:
        """The Secrets and ConfigMaps the pod references (absent ones are simply missing)."""
        ns = pod["metadata"].get("namespace", "default")
        secret_names, cm_names = referenced_objects(pod)
        secrets: dict[tuple[str, str], dict[str, bytes]] = {}
        configmaps: dict[tuple[str, str], dict[str, bytes]] = {}
        for name in secret_names:
            obj = self._read(self.core.read_namespaced_secret, name, ns)
            if obj is not None:
                secrets[(ns, name)] = {
                    **decode_secret_data(obj.get("data")),
                    **{k: v.encode() for k, v in (obj.get("stringData") or {}).items()},
                }
        for name in cm_names:
            obj = self._read(self.core.read_namespaced_config_map, name, ns)
            if obj is not None:
                configmaps[(ns, name)] = encode_configmap_data(obj.get("data"), obj.get("binaryData"))
        return secrets, configmaps

    @staticmethod
    def _read(fn: Any, name: str, ns: str) -> dict[str, Any] | None:
        try:
            return _json(fn(name, ns, _preload_content=False, _request_timeout=API_TIMEOUT_S))
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return None
            raise

    # -- lifecycle
    def run(self) -> None:
        """Block until ``stop()``; then stop every pod process (bounded) and mark the node down."""
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        n = kill_leftovers(self.cfg.agent_id)
        if n:
            log.warning("killed %d process group(s) left by an earlier agent for this node", n)
        self._register_until_ok()
        threads = [
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
            threading.Thread(target=self._watch_loop, name="watch", daemon=True),
        ]
        for t in threads:
            t.start()
        log.info(
            "node %s registered (gpus=%d); watching pods with %s",
            self.cfg.node_name,
            self.cfg.gpus,
            self._selector,
        )
        self.stop_event.wait()
        self._shutdown()

    def stop(self) -> None:
        self.stop_event.set()

    def _shutdown(self) -> None:
        with self._workers_lock:
            workers = list(self._workers.values())
        for w in workers:
            w.shutdown()
        deadline = time.monotonic() + self.cfg.max_grace_s + 15
        for w in workers:
            w.join(timeout=max(deadline - time.monotonic(), 0.1))
        with contextlib.suppress(Exception):
            self._patch_node_status(
                ready=False, reason="NodeAgentStopped", message="the rewardplane node agent stopped"
            )
        log.info("node agent stopped")

    # -- node
    def _register_until_ok(self) -> None:
        delay = 0.5
        while not self.stop_event.is_set():
            try:
                self._register()
                return
            except Exception as exc:
                log.warning(
                    "registering node %s failed (retrying in %.0fs): %s", self.cfg.node_name, delay, exc
                )
                self.stop_event.wait(delay)
                delay = min(delay * 2, 10)

    def _register(self) -> None:
        body = node_object(self.cfg)
        try:
            # the client serializes a plain dict as it would a V1Node; its stubs only name V1Node
            self.core.create_node(body, _request_timeout=API_TIMEOUT_S)  # type: ignore[arg-type]
        except Exception as exc:
            if getattr(exc, "status", None) != 409:
                raise
            self.core.patch_node(
                self.cfg.node_name,
                {"metadata": {"labels": body["metadata"]["labels"]}},
                _content_type="application/strategic-merge-patch+json",
                _request_timeout=API_TIMEOUT_S,
            )
        self._patch_node_status()

    def _patch_node_status(self, **kw: Any) -> None:
        status = node_status(self.cfg, time.time(), **kw)
        self.core.patch_node_status(
            self.cfg.node_name,
            {"status": status},
            _content_type="application/strategic-merge-patch+json",
            _request_timeout=API_TIMEOUT_S,
        )

    def _heartbeat_loop(self) -> None:
        while not self.stop_event.wait(self.cfg.heartbeat_s):
            try:
                self._patch_node_status()
            except Exception as exc:
                if getattr(exc, "status", None) == 404:  # someone deleted the Node: register again
                    with contextlib.suppress(Exception):
                        self._register()
                else:
                    log.warning("node heartbeat failed: %s", exc)

    # -- pods
    def _watch_loop(self) -> None:
        from kubernetes import watch

        delay = 0.5
        while not self.stop_event.is_set():
            try:
                rv = self._relist()
                w = watch.Watch()
                for event in w.stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=self._selector,
                    resource_version=rv,
                    timeout_seconds=self.cfg.watch_timeout_s,
                    _request_timeout=(API_TIMEOUT_S, self.cfg.watch_timeout_s + API_TIMEOUT_S),
                    deserialize=False,
                ):
                    if self.stop_event.is_set():
                        w.stop()
                        break
                    self._on_event(event)
                delay = 0.5
            except Exception as exc:
                log.warning("pod watch failed (re-listing in %.1fs): %s", delay, exc)
                self.stop_event.wait(delay)
                delay = min(delay * 2, 10)

    def _relist(self) -> str:
        data = _json(
            self.core.list_pod_for_all_namespaces(
                field_selector=self._selector, _preload_content=False, _request_timeout=API_TIMEOUT_S
            )
        )
        live = set()
        for pod in data.get("items") or []:
            live.add(pod["metadata"]["uid"])
            self._on_pod(pod)
        with self._workers_lock:
            vanished = [w for uid, w in self._workers.items() if uid not in live]
        for w in vanished:
            w.gone()
        return str(data["metadata"]["resourceVersion"])

    def _on_event(self, event: dict[str, Any]) -> None:
        obj = event.get("raw_object") or event.get("object")
        if isinstance(obj, (bytes, str)):
            obj = json.loads(obj)
        if event.get("type") == "ERROR" or not isinstance(obj, dict) or obj.get("kind") == "Status":
            raise RuntimeError(f"watch error: {obj}")  # e.g. 410 Gone: re-list
        if event.get("type") == "DELETED":
            with self._workers_lock:
                w = self._workers.get(obj["metadata"]["uid"])
            if w:
                w.gone()
            return
        self._on_pod(obj)

    def _on_pod(self, pod: Pod) -> None:
        if self.stop_event.is_set():
            return
        uid = pod["metadata"]["uid"]
        with self._workers_lock:
            w = self._workers.get(uid)
            if w is not None:
                w.update(pod)
                return
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp"):
                return  # finished before this agent started: never run again
            w = PodWorker(self, pod)
            self._workers[uid] = w
        w.start()


def referenced_objects(pod: Pod) -> tuple[set[str], set[str]]:
    """Names of the Secrets and ConfigMaps a pod's first container and volumes refer to."""
    secrets: set[str] = set()
    cms: set[str] = set()
    spec = pod.get("spec", {})
    for c in (spec.get("containers") or [])[:1]:
        for src in c.get("envFrom") or []:
            if src.get("secretRef"):
                secrets.add(src["secretRef"]["name"])
            if src.get("configMapRef"):
                cms.add(src["configMapRef"]["name"])
        for var in c.get("env") or []:
            vf = var.get("valueFrom") or {}
            if vf.get("secretKeyRef"):
                secrets.add(vf["secretKeyRef"]["name"])
            if vf.get("configMapKeyRef"):
                cms.add(vf["configMapKeyRef"]["name"])
    for vol in spec.get("volumes") or []:
        if vol.get("secret"):
            secrets.add(vol["secret"].get("secretName", ""))
        if vol.get("configMap"):
            cms.add(vol["configMap"].get("name", ""))
    return secrets - {""}, cms - {""}


# -- CLI -------------------------------------------------------------------------------------------------
def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--label {item!r}: expected KEY=VALUE")
        labels[key] = value
    return labels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rewardplane node",
        description=(
            "Run a node agent: register a Node and run Pods bound to it (spec.nodeName) as local "
            "processes on their own loopback addresses."
        ),
    )
    p.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG"),
        help="kubeconfig of the cluster (default: $KUBECONFIG)",
    )
    p.add_argument("--node-name", default="local-node")
    p.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu capacity to advertise")
    p.add_argument("--cpu", default=str(os.cpu_count() or 1))
    p.add_argument("--memory", default=None, help="memory capacity, e.g. 16Gi (default: MemTotal)")
    p.add_argument("--max-pods", type=int, default=110)
    p.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="node label (repeatable)"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="pod logs and volumes (default: ~/.cache/rewardplane/node/<node-name>)",
    )
    p.add_argument("--heartbeat-s", type=float, default=10.0)
    p.add_argument("--max-grace-s", type=float, default=30.0)
    p.add_argument(
        "--pod-network",
        type=int,
        default=os.environ.get(POD_NETWORK_ENV, "0"),  # a string default goes through type=int too
        metavar="N",
        help=(
            f"pods get the loopback addresses 127.N.0.2, 127.N.0.3, ... (default 0, or ${POD_NETWORK_ENV}); "
            "node agents on one host need different values"
        ),
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.kubeconfig:
        print("rewardplane node: no kubeconfig; pass --kubeconfig PATH or set KUBECONFIG", file=sys.stderr)
        return 2
    if args.gpus < 0:
        print("rewardplane node: --gpus must be >= 0", file=sys.stderr)
        return 2
    if not 0 <= args.pod_network <= 255:
        print(
            "rewardplane node: --pod-network must be 0-255 (the second octet of 127.N.x.y)", file=sys.stderr
        )
        return 2
    from kubernetes import config as kconfig

    try:
        api = kconfig.new_client_from_config(config_file=args.kubeconfig)
    except Exception as exc:
        print(f"rewardplane node: cannot load kubeconfig {args.kubeconfig}: {exc}", file=sys.stderr)
        return 2
    state_dir = args.state_dir or Path.home() / ".cache" / "rewardplane" / "node" / args.node_name
    cfg = AgentConfig(
        node_name=args.node_name,
        gpus=args.gpus,
        cpu=args.cpu,
        memory=args.memory or detect_memory(),
        max_pods=args.max_pods,
        labels=parse_labels(args.label),
        state_dir=state_dir.expanduser(),
        heartbeat_s=args.heartbeat_s,
        max_grace_s=args.max_grace_s,
        pod_network=args.pod_network,
    )
    agent = NodeAgent(api, cfg)

    def _on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        agent.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
