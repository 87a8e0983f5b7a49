"""A server that cannot load its model says why at once, as the last line it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _start(model: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rewardplane.server", "--model", model, "--engine", "hf", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_model_path_fails_fast_with_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = _start(str(missing))
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert f"model not found at {missing}" in last and "spec.model.source" in last
    assert "huggingface" not in result.stderr.lower() and "repo id" not in result.stderr.lower()


def test_folder_without_a_checkpoint_is_named(tmp_path: Path) -> None:
    result = _start(str(tmp_path))
    assert result.returncode == 2
    assert "has no config.json" in result.stderr.strip().splitlines()[-1]
