"""A client that scores through a RewardModel's Service the whole time a block runs, and records
every answer's weights version: what any client that resolves the Service (OpenRLHF, verl, the
README's ``http://<rm>:8001``) is served while replicas come, go, restart and take pushes."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from kubernetes.client.exceptions import ApiException

TEXT = "a text scored through the Service the whole time"


@dataclass
class Answer:
    at: float
    ip: str
    version: int


@dataclass
class ServiceWatch:
    """Every round reads the Service's Endpoints (the addresses it routes to: ready Pods only) and
    scores one text at each address. An answer whose version is not in ``allowed`` counts as a
    *violation* when the Endpoints listed that address both before and after it (a replica that
    left the Endpoints meanwhile is what kube-proxy lag also shows, and no promise of ours).

    ``allowed`` may be changed while the watch runs (a push in flight serves the old version until
    it commits, then the new one)."""

    core: Any  # kubernetes.client.CoreV1Api
    service: str
    namespace: str
    allowed: set[int]
    answers: list[Answer] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    refused: int = 0  # non-200 answers (a replica leaving), never a wrong version
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def addresses(self) -> dict[str, int]:
        """ip → HTTP port of every address the Service routes to now."""
        try:
            ep = self.core.read_namespaced_endpoints(self.service, self.namespace)
        except ApiException:
            return {}
        out: dict[str, int] = {}
        for subset in ep.subsets or []:
            port = next((p.port for p in subset.ports or [] if p.name == "http"), None)
            for addr in subset.addresses or []:
                if port is not None:
                    out[addr.ip] = port
        return out

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                for ip, port in sorted(self.addresses().items()):
                    try:
                        resp = http.post(
                            f"http://{ip}:{port}/score", json={"input": [TEXT], "normalize": False}
                        )
                    except httpx.HTTPError:
                        self.refused += 1
                        continue
                    if resp.status_code != 200:
                        self.refused += 1
                        continue
                    version = int(resp.json()["version"])
                    self.answers.append(Answer(time.monotonic(), ip, version))
                    if version not in self.allowed and ip in self.addresses():
                        self.violations.append(
                            f"{ip} answered with weights version {version} (allowed {sorted(self.allowed)}) "
                            "while the Service routed to it"
                        )
                self._stop.wait(0.05)

    def __enter__(self) -> ServiceWatch:
        self._thread = threading.Thread(target=self._run, name="service-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def versions(self) -> Counter[int]:
        return Counter(a.version for a in self.answers)

    def check(self, min_answers: int = 1) -> None:
        """Fail on any violation; and on too few answers, which would make the watch prove nothing."""
        assert not self.violations, "the Service routed to replicas on other weights:\n" + "\n".join(
            self.violations[:10]
        )
        assert len(self.answers) >= min_answers, (
            f"only {len(self.answers)} answers through the Service ({self.refused} refused): the watch saw too little"
        )
