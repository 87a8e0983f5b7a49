"""Package metadata states ranges, not pins: the resolver keeps a trainer's own torch, and the
server with vLLM (which pins its torch) resolves. The CPU pin lives in constraints/cpu.txt."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = ["core", "sdk", "operator", "images/reward-server", "."]


def _dry_run(tmp_path: Path, *requirements: str) -> dict[str, str]:
    """What pip would install (name → version) for these requirements into this environment."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "-q", "--no-build-isolation"]
    cmd += ["--report", str(report), *requirements]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def test_no_distribution_pins_torch() -> None:
    for d in DISTRIBUTIONS:
        meta = tomllib.loads((ROOT / d / "pyproject.toml").read_text())["project"]
        reqs = list(meta.get("dependencies", []))
        for extra in meta.get("optional-dependencies", {}).values():
            reqs += extra
        torch_reqs = [r for r in reqs if r.replace(" ", "").startswith("torch")]
        assert all("==" not in r for r in torch_reqs), f"{d} pins torch: {torch_reqs}"
    assert "torch==" in (ROOT / "constraints/cpu.txt").read_text()


def test_installing_the_trainer_extras_keeps_the_installed_torch(tmp_path: Path) -> None:
    import torch

    plan = _dry_run(tmp_path, "./core", "./sdk[train,cluster]", "./.[train,cluster]")
    assert "torch" not in plan, f"pip would replace torch {torch.__version__} with {plan['torch']}"
    assert {"rewardplane", "rewardplane-sdk", "rewardplane-core"} <= set(plan)


@pytest.mark.skipif(not _pypi_reachable(), reason="needs the package index to resolve vLLM's dependencies")
def test_the_server_with_vllm_resolves_with_vllms_torch() -> None:
    # uv's resolver over the same metadata: pip's dry run of this set takes 80 s, uv's ~5 s
    cmd = [str(Path(sys.executable).with_name("uv")), "pip", "compile", "--no-header", "--quiet"]
    cmd += ["--python-version", f"{sys.version_info.major}.{sys.version_info.minor}"]
    cmd += ["core/pyproject.toml", "images/reward-server/pyproject.toml", "--extra", "vllm"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = dict(
        line.split("==", 1)
        for line in result.stdout.splitlines()
        if "==" in line and not line.startswith(" ")
    )
    assert plan["vllm"] == "0.24.0"
    assert plan["torch"].startswith("2.11"), plan["torch"]
