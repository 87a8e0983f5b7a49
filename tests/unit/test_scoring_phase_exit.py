"""The scoring benchmark's phases (benchmarks/scoring_gpu.py ``run_phase``): a phase that wrote its
result and then crashed on the way out keeps its figures, marked with its exit status; one that
wrote nothing fails with its log."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

import benchmarks.scoring_gpu as bench  # noqa: E402


def _phase(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    monkeypatch.setattr(
        bench, "phase_cmd", lambda name, model, work, args, extra=None: [sys.executable, "-c", code]
    )


def test_a_crash_after_the_result_keeps_the_figures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "offline.json"
    _phase(
        monkeypatch,
        f"import os; open({str(result)!r}, 'w').write('{{\"tok_s\": 5.0}}'); print('bye'); os.abort()",
    )
    out = bench.run_phase("offline", tmp_path / "m", tmp_path, bench.parse(["--sizes", "0.4b"]))
    assert out["tok_s"] == 5.0
    assert out["exit_status"] == -6  # SIGABRT
    printed = capsys.readouterr().out
    assert "WARNING: phase offline exited with -6 after writing its result" in printed
    assert "bye" in printed  # the log's tail


def test_a_phase_without_a_result_fails_with_its_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _phase(monkeypatch, "import sys; print('out of memory'); sys.exit(3)")
    with pytest.raises(RuntimeError, match=r"phase offline failed \(exit 3\)[\s\S]*out of memory"):
        bench.run_phase("offline", tmp_path / "m", tmp_path, bench.parse(["--sizes", "0.4b"]))
