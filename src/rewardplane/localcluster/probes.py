"""Container probes (startup, readiness, liveness) for the node agent.

``ProbeTracker`` is the pure state machine (when a probe is due, when the result flips after
``successThreshold``/``failureThreshold``); ``run_probe`` performs one probe against the pod IP;
``ContainerProbes`` runs a container's probes in the kubelet's order and says what follows.
"""

from __future__ import annotations

import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Probe = Mapping[str, Any]
ExecArgv = Callable[[list[str]], tuple[list[str], dict[str, str]]]  # an exec probe's argv → (argv, env)


def resolve_port(port: int | str, container: Mapping[str, Any]) -> int:
    """A probe port given as a number or as the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"probe port {port!r} is not a number and names none of the container's ports")


def run_probe(
    probe: Probe,
    *,
    pod_ip: str,
    container: Mapping[str, Any],
    exec_argv: ExecArgv | None = None,
) -> tuple[bool, str]:
    """One probe attempt, bounded by ``timeoutSeconds`` (default 1). Returns (success, detail)."""
    timeout = float(probe.get("timeoutSeconds") or 1)
    try:
        if "httpGet" in probe:
            hg = probe["httpGet"]
            scheme = str(hg.get("scheme", "HTTP")).lower()
            host = hg.get("host") or pod_ip
            port = resolve_port(hg["port"], container)
            path = hg.get("path", "/")
            if not path.startswith("/"):
                path = "/" + path
            req = urllib.request.Request(f"{scheme}://{host}:{port}{path}")
            for h in hg.get("httpHeaders") or []:
                req.add_header(h["name"], h["value"])
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    code = resp.status
            except urllib.error.HTTPError as exc:
                code = exc.code
            return 200 <= code < 400, f"HTTP probe got status {code}"
        if "tcpSocket" in probe:
            ts = probe["tcpSocket"]
            host = ts.get("host") or pod_ip
            port = resolve_port(ts["port"], container)
            with socket.create_connection((host, port), timeout=timeout):
                return True, "tcp connect ok"
        if "exec" in probe:
            argv = list(probe["exec"].get("command") or [])
            env: dict[str, str] | None = None
            if exec_argv is not None:
                argv, env = exec_argv(argv)
            done = subprocess.run(argv, env=env, capture_output=True, timeout=timeout)
            return done.returncode == 0, f"exec probe exited {done.returncode}"
    except (OSError, ValueError, subprocess.TimeoutExpired, urllib.error.URLError) as exc:
        return False, f"probe failed: {exc}"
    return False, f"unsupported probe handler {sorted(probe)}; use httpGet, tcpSocket or exec"


@dataclass
class ProbeTracker:
    """Kubernetes probe semantics: first attempt after ``initialDelaySeconds``, then every
    ``periodSeconds``; the result flips after ``successThreshold`` consecutive successes or
    ``failureThreshold`` consecutive failures."""

    probe: Probe
    healthy: bool  # the starting result (readiness starts false, liveness true)
    next_due: float = 0.0
    successes: int = 0
    failures: int = 0
    last_detail: str = ""

    def start(self, running_since: float) -> None:
        self.next_due = running_since + float(self.probe.get("initialDelaySeconds") or 0)
        self.successes = self.failures = 0

    def due(self, now: float) -> bool:
        return now >= self.next_due

    def record(self, ok: bool, detail: str, now: float) -> bool:
        """Record one result; return the (possibly flipped) health."""
        self.next_due = now + float(self.probe.get("periodSeconds") or 10)
        self.last_detail = detail
        if ok:
            self.successes += 1
            self.failures = 0
            if self.successes >= int(self.probe.get("successThreshold") or 1):
                self.healthy = True
        else:
            self.failures += 1
            self.successes = 0
            if self.failures >= int(self.probe.get("failureThreshold") or 3):
                self.healthy = False
        return self.healthy


@dataclass
class ProbeVerdict:
    """What one look at a container's probes found."""

    started: bool = False  # the startup probe passed just now: the other probes start
    ready: bool | None = None  # the readiness result, when the readiness probe ran
    ready_detail: str = ""
    failed: str | None = None  # "liveness" or "startup": that probe failed, the process restarts
    failed_detail: str = ""


class ContainerProbes:
    """A container's startup, readiness and liveness probes, run as the kubelet runs them: until
    the startup probe passes no other probe runs; ``failureThreshold`` startup failures in a row, or
    a liveness probe that turns unhealthy, restart the process."""

    def __init__(self, container: Mapping[str, Any]) -> None:
        self.container = container
        rp, lp, sp = (container.get(k) for k in ("readinessProbe", "livenessProbe", "startupProbe"))
        self.readiness = ProbeTracker(rp, healthy=False) if rp else None
        self.liveness = ProbeTracker(lp, healthy=True) if lp else None
        self.startup = ProbeTracker(sp, healthy=False) if sp else None

    @property
    def gates_start(self) -> bool:
        """A probe says when the process has started (startup or readiness)."""
        return self.startup is not None or self.readiness is not None

    def process_started(self, now: float) -> None:
        """A new run of the process: every probe starts over."""
        for tracker in (self.readiness, self.liveness, self.startup):
            if tracker:
                tracker.healthy = tracker is self.liveness
                tracker.start(now)

    def check(self, pod_ip: str, exec_argv: ExecArgv, now: Callable[[], float]) -> ProbeVerdict:
        """Run the probes that are due."""
        verdict = ProbeVerdict()
        if self.startup is not None and not self.startup.healthy:
            self._check_startup(self.startup, pod_ip, exec_argv, now, verdict)
            return verdict
        for tracker in (self.readiness, self.liveness):
            if tracker is None or not tracker.due(now()):
                continue
            ok, detail = self._run(tracker, pod_ip, exec_argv)
            healthy = tracker.record(ok, detail, now())
            if tracker is self.readiness:
                verdict.ready, verdict.ready_detail = healthy, detail
            elif not healthy:
                verdict.failed, verdict.failed_detail = "liveness", detail
                break
        return verdict

    def _check_startup(
        self,
        tracker: ProbeTracker,
        pod_ip: str,
        exec_argv: ExecArgv,
        now: Callable[[], float],
        verdict: ProbeVerdict,
    ) -> None:
        if not tracker.due(now()):
            return
        ok, detail = self._run(tracker, pod_ip, exec_argv)
        tracker.record(ok, detail, now())
        if ok:
            tracker.healthy = True
            verdict.started = True
            for other in (self.readiness, self.liveness):
                if other:
                    other.start(now())
        elif tracker.failures >= int(tracker.probe.get("failureThreshold") or 3):
            verdict.failed, verdict.failed_detail = "startup", detail

    def _run(self, tracker: ProbeTracker, pod_ip: str, exec_argv: ExecArgv) -> tuple[bool, str]:
        return run_probe(tracker.probe, pod_ip=pod_ip, container=self.container, exec_argv=exec_argv)
