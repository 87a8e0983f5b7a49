"""The layers of docs/architecture.md hold, and the contract check really catches a violation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ["core/src", "sdk/src", "operator/src", "images/reward-server/src", "src"]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter not installed (extra dev)")


def _lint(src_roots: list[Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in src_roots)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_layers_contract_holds_for_the_tree() -> None:
    result = _lint([ROOT / r for r in SOURCE_ROOTS], ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_sdk_importing_the_operator_breaks_the_contract(tmp_path: Path) -> None:
    copies = []
    for r in SOURCE_ROOTS:
        dst = tmp_path / r
        shutil.copytree(ROOT / r, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        copies.append(dst)
    client = tmp_path / "sdk/src/rewardplane/sdk/client.py"
    client.write_text(client.read_text() + "\nfrom rewardplane.operator import planning  # noqa\n")
    result = _lint(copies, tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert "rewardplane.sdk.client -> rewardplane.operator.planning" in result.stdout


@pytest.mark.parametrize(
    "module", ["rewardplane.server", "rewardplane.operator", "rewardplane.modelfetch", "rewardplane"]
)
def test_python_dash_m_entry_points_still_start(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()


def test_every_module_path_follows_its_import_name() -> None:
    """No folder map: a module's file is <source root>/<import path>.py in one of the roots."""
    for r in SOURCE_ROOTS:
        for path in (ROOT / r / "rewardplane").rglob("*.py"):
            name = ".".join(path.relative_to(ROOT / r).with_suffix("").parts).removesuffix(".__init__")
            assert name.startswith("rewardplane")
            spec_origin = __import__("importlib.util").util.find_spec(name)
            if spec_origin is None or spec_origin.origin is None:
                continue  # e.g. a module that imports vLLM: not importable here, found by path only
            assert Path(spec_origin.origin).resolve() == path.resolve(), name
    assert not (ROOT / "src/rewardplane/__init__.py").exists(), "rewardplane must stay a namespace package"
