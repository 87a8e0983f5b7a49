"""One pod's life on the node: a thread that prepares the pod (volumes, GPUs), starts its first
container's process, probes it, restarts it with the kubelet's back-off, reports the pod's status
and, once the pod is deleted, stops the process and deletes the Pod. Every wait is bounded.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from rewardplane.localcluster.backoff import KUBELET, crash_loop_message, fallback_termination_message
from rewardplane.localcluster.gpus import pinned_devices
from rewardplane.localcluster.nodeagent.config import (
    API_TIMEOUT_S,
    CONFIG_RETRY_S,
    START_MARKER,
    TICK_S,
    AgentConfig,
)
from rewardplane.localcluster.nodeagent.launch import grace_period, parse_time, process_env
from rewardplane.localcluster.nodeagent.processes import exit_code, kill_group, last_run_output, spawn
from rewardplane.localcluster.nodeagent.volumes import (
    remove_short_link,
    short_link_path,
    short_volumes_link,
    write_volumes,
)
from rewardplane.localcluster.podspec import (
    ContainerRuntime,
    Objects,
    Pod,
    PodConfigError,
    ProcessPlan,
    build_pod_status,
    gpu_request,
    map_argv,
    plan_process,
    plan_volumes,
    rfc3339,
)
from rewardplane.localcluster.probes import ContainerProbes

log = logging.getLogger("rewardplane.nodeagent")


class PodHost(Protocol):
    """What a pod worker needs from its agent: the settings, the API, and the node's shared
    resources (addresses, GPUs), handed out under the agent's lock."""

    cfg: AgentConfig
    core: Any  # kubernetes.client.CoreV1Api

    def allocate_ip(self, uid: str, preferred: str | None) -> str: ...
    def claim_gpus(self, uid: str, name: str, n: int) -> tuple[int, ...]: ...
    def pin_gpus(self, uid: str, name: str, devices: tuple[int, ...]) -> None: ...
    def begin_gpu_start(self, uid: str, *, mark: bool) -> str | None: ...
    def set_gpu_starting(self, uid: str, starting: bool) -> None: ...
    def read_refs(self, pod: Pod) -> tuple[Objects, Objects]: ...
    def worker_done(self, worker: PodWorker) -> None: ...


class PodWorker(threading.Thread):
    """Owns one pod's process from start to deletion; every wait is bounded."""

    def __init__(self, agent: PodHost, pod: Pod) -> None:
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
        if spec.get("initContainers"):
            # e.g. a RewardModel's model download (s3://, https://, hf:// sources): those need a
            # real node; the server then finds no model and says so.
            log.warning(
                "pod %s/%s: the node agent does not run init containers (%s); use a real node for "
                "models downloaded from s3://, https:// or hf:// sources",
                self.ns,
                self.pod_name,
                ", ".join(str(c.get("name")) for c in spec["initContainers"]),
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
        self.probes = ContainerProbes(self.container)
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
        self.rt.pod_start = time.time() if not started else parse_time(started)
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
        return grace_period(pod, self.agent.cfg.max_grace_s)

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
        self._on_exit(exit_code(rc), time.time())

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
        blocker = self.agent.begin_gpu_start(self.uid, mark=self.probes.gates_start) if pinned else None
        if blocker:
            self._config_problem("ContainerCreating", blocker, now)
            return
        env = process_env(
            os.environ,
            pod_name=self.pod_name,
            agent_id=self.agent.cfg.agent_id,
            gpu_ids=gpu_ids,
            pinned=pinned,
            pod_env=plan.env,
        )
        cwd = plan.cwd if plan.cwd and Path(plan.cwd).is_dir() else str(self.pod_dir)
        if self.starts > 0:
            self.rt.restart_count += 1
        self.starts += 1
        with open(self.log_path, "ab") as logf:
            logf.write(f"--- {rfc3339(now)} {START_MARKER}{self.starts}: {plan.argv}\n".encode())
            logf.flush()
            try:
                self.proc = spawn(plan.argv, env=env, cwd=cwd, log=logf)
            except OSError as exc:
                logf.write(f"--- start failed: {exc}\n".encode())
                self.rt.running_since = now  # so that _on_exit records a start time
                self._on_exit(128, now, reason="StartError", message=str(exc))
                return
        self.plan = plan
        self.rt.pid = self.proc.pid
        self.rt.running_since = now
        self.rt.waiting_reason = self.rt.waiting_message = None
        self.rt.ready = self.probes.readiness is None
        self.rt.started = self.probes.startup is None  # as the kubelet: started once the startup probe passed
        self.probes.process_started(now)
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
        verdict = self.probes.check(self.rt.pod_ip or "127.0.0.1", self._exec_argv, time.time)
        if verdict.started:
            self.rt.started = True
            self.agent.set_gpu_starting(self.uid, False)
        if verdict.ready is not None:
            if verdict.ready != self.rt.ready:
                log.info(
                    "pod %s/%s: ready=%s (%s)", self.ns, self.pod_name, verdict.ready, verdict.ready_detail
                )
            if verdict.ready:
                self.agent.set_gpu_starting(self.uid, False)
            self.rt.ready = verdict.ready
        if verdict.failed is not None:
            log.warning(
                "pod %s/%s: %s probe failed (%s); restarting",
                self.ns,
                self.pod_name,
                verdict.failed,
                verdict.failed_detail,
            )
            code = kill_group(self.proc, self._grace(self.pod))
            message = f"{verdict.failed} probe failed: {verdict.failed_detail}"
            self._on_exit(code, time.time(), reason="Error", message=message)

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
        self._record_exit(
            code, reason, started, now, message if message is not None else self._log_cause(code)
        )
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

    def _record_exit(self, code: int, reason: str, started: float, ended: float, message: str | None) -> None:
        """The run is over: its exit becomes the container's last state; nothing runs now."""
        self.rt.last_exit = (code, reason, started, ended)
        self.rt.last_exit_message = message
        self.rt.running_since = self.rt.pid = None
        self.rt.ready = False
        self.proc = None
        self.agent.set_gpu_starting(self.uid, False)

    def _log_cause(self, code: int) -> str | None:
        """``FallbackToLogsOnError``: a failed run's log tail (this run's lines only) as its cause."""
        if code == 0 or self.container.get("terminationMessagePolicy") != "FallbackToLogsOnError":
            return None
        text = last_run_output(self.log_path)
        return (fallback_termination_message(text) or None) if text is not None else None

    def _stop_process(self, grace_s: float) -> None:
        if self.proc is None:
            return
        code = kill_group(self.proc, grace_s)
        log.info("pod %s/%s: stopped (exit %d)", self.ns, self.pod_name, code)
        now = time.time()
        self._record_exit(
            code, "Completed" if code == 0 else "Error", self.rt.running_since or now, now, None
        )

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
