"""Container probes (readiness, liveness) for the node agent.

``ProbeTracker`` is the pure state machine (when a probe is due, when the result flips after
``successThreshold``/``failureThreshold``); ``run_probe`` performs one probe against the pod IP.
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
    exec_argv: Callable[[list[str]], tuple[list[str], dict[str, str]]] | None = None,
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
