"""``rewardplane status | score | push --url``: the command line against a real server process,
without a cluster (direct mode)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rewardplane.testing.servers import free_port

TOKEN = "cli-token"


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rewardplane", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(1200)  # three fresh interpreters that import torch: minutes on a busy 2-core VM
def test_status_score_and_push_with_url(server_factory, tiny_model_dir: Path, tmp_path: Path) -> None:
    server = server_factory(tiny_model_dir, token=TOKEN)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)

    scored = _cli("score", "--url", server.url, "a prompt and its answer", "another")
    assert scored.returncode == 0, scored.stderr
    lines = scored.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].endswith("\ta prompt and its answer"), scored.stdout
    float(lines[0].split("\t")[0])  # a raw score

    pushed = _cli(
        "push", "--url", server.url, "--from", str(tiny_model_dir), "--version", "3", "--mode", "head_only",
        "--token-file", str(token_file), "--group-port", str(free_port()),
    )  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed version 3 (head_only) to 1 server(s)" in pushed.stdout

    status = _cli("status", "--url", server.url)
    assert status.returncode == 0, status.stderr
    assert f"{server.url}: ok" in status.stdout and "weights version 3" in status.stdout
