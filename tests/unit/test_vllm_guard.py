"""Without vLLM (CI), the vLLM engine fails with an actionable message, and the server exits 2."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="vllm is installed here; the guard only matters without it",
)

HINT = "pip install 'rewardplane[vllm]'"


def test_import_raises_actionable_import_error() -> None:
    sys.modules.pop("rewardplane.server.engines.vllm_engine", None)
    with pytest.raises(ImportError) as info:
        importlib.import_module("rewardplane.server.engines.vllm_engine")
    message = str(info.value)
    assert HINT in message
    assert "GPU" in message
    assert "--engine hf" in message


def test_server_with_vllm_engine_exits_2_with_the_hint(tmp_path: Path) -> None:
    # The model folder is never read: the engine import fails first.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rewardplane.server",
            "--engine",
            "vllm",
            "--model",
            str(tmp_path),
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert HINT in proc.stderr
    assert "GPU" in proc.stderr
