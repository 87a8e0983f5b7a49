"""Run inside a fresh network namespace (``test_schemathesis.py``): bring loopback up, start a real
reward server with a control-plane token, and fuzz every endpoint with schemathesis.

Generated ``/init_communicator`` calls name arbitrary hosts and ports; in the namespace nothing but
this server exists, so no generated join can reach anyone else's process or the outside."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rewardplane.testing.servers import start_server

TOKEN = "fuzz-token"


def main(model_dir: str, work_dir: str, max_examples: str) -> int:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
    work = Path(work_dir)
    server = start_server(Path(model_dir), work, token=TOKEN, max_items_per_request=32, max_model_len=64)
    root = Path(__file__).resolve().parents[2]  # the hooks module is imported from the repository root
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, SCHEMATHESIS_HOOKS="tests.integration.schemathesis_hooks", PYTHONPATH=path)
    try:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "all",
                "--exclude-checks",
                # positive_data_acceptance: a schema-valid /score may still be refused with a
                # documented 400 (e.g. a model name this server does not serve)
                "positive_data_acceptance",
                "--max-examples",
                max_examples,
                "--header",
                f"Authorization: Bearer {TOKEN}",
                "--request-timeout",
                "60",
                "--seed",
                "1",
                # one worker: with two, schemathesis' generation of a body was once flaky
                # ("Inconsistent results") in its coverage phase
                "--workers",
                "1",
                "--report",
                "junit",
                "--report-dir",
                str(work / "report"),
            ],
            env=env,
            cwd=work,  # schemathesis keeps its example database in the working directory
            timeout=900,
        ).returncode
    finally:
        server.stop()
        print(server.log()[-3000:], file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
