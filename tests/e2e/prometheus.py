"""Debian's ``prometheus`` (scripts/install-k8s-tools.sh installs it), run on the host for one test:
it scrapes the reward-server Pods and the operator Pod at their Pod IPs (reachable from the host
over the node's bridge; static targets, so no cluster DNS or service discovery is needed), each
reward server labelled as the chart's PodMonitor labels it (``rewardmodel``, ``replica``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from rewardplane.testing.processes import stop_process

SCRAPE_INTERVAL = "1s"  # the test waits for a few scrapes: keep them quick
START_TIMEOUT_S = 60


@dataclass(frozen=True)
class Target:
    address: str  # host:port
    labels: dict[str, str]


def prometheus_binary() -> str:
    """The ``prometheus`` binary; a failure in CI (the setup installs it), else a skip."""
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing in CI; run scripts/install-k8s-tools.sh")
        pytest.skip("prometheus not installed (scripts/install-k8s-tools.sh installs it)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """One prometheus process scraping ``jobs`` (job name → its targets), its data under ``workdir``.
    A context manager: stopped (and waited for) on exit, whatever happened."""

    def __init__(self, workdir: Path, jobs: dict[str, list[Target]]) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [
                {
                    "job_name": job,
                    "static_configs": [{"targets": [t.address], "labels": t.labels} for t in targets],
                }
                for job, targets in jobs.items()
            ],
        }
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Prometheus:
        log = (self.workdir / "prometheus.log").open("wb")
        self._proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()  # the child holds its own descriptor
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not start:\n{self.log()[-3000:]}")
            time.sleep(0.5)
        return self

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            stop_process(self._proc, grace_s=30)

    def log(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now (a PromQL error fails the test)."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        return list(body["data"]["result"])

    def targets_up(self) -> dict[str, bool]:
        """Each scraped address → whether its last scrape succeeded."""
        r = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()
        return {t["labels"]["instance"]: t["health"] == "up" for t in r["data"]["activeTargets"]}
