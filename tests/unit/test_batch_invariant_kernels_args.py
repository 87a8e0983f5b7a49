"""The kernel benchmark's command lines (benchmarks/batch_invariant_kernels.py): each measuring
process gets the run's engine settings and parses into everything the scoring benchmark's
``vllm_kwargs`` (which it shares) reads, so it cannot fail on a GPU for want of an argument."""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

import benchmarks.batch_invariant_kernels as bik  # noqa: E402
from benchmarks.scoring_gpu import vllm_kwargs  # noqa: E402

CONFIG = '{"cudagraph_capture_sizes": [512, 1024]}'


def measure_cmd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> list[str]:
    """The command line the benchmark starts one measuring process with (captured, not run)."""
    seen: list[list[str]] = []

    def capture(cmd: list[str], log: Path, *_: Any) -> int:
        seen.append(cmd)
        log.write_text("not run: the test reads the command line only\n")
        return 1

    monkeypatch.setattr(bik, "run_in_own_group", capture)
    args = bik.parse(argv)
    with pytest.raises(RuntimeError):  # the captured process "failed": nothing was measured
        bik.child("measure", tmp_path, tmp_path / "model", args, {}, ["--mode", "on"])
    (cmd,) = seen
    return cmd


def args_read_by_vllm_kwargs() -> set[str]:
    tree = ast.parse(inspect.getsource(vllm_kwargs))
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "args"
    }


def test_each_measuring_process_gets_the_engine_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cmd = measure_cmd(tmp_path, monkeypatch, ["--compilation-config", CONFIG, "--enforce-eager"])
    phase = bik.parse(cmd[2:])  # what the measuring process parses
    assert phase.phase == "measure" and phase.mode == "on"
    assert json.loads(phase.compilation_config) == json.loads(CONFIG)
    assert phase.enforce_eager is True
    read = args_read_by_vllm_kwargs()
    assert {"compilation_config", "enforce_eager", "max_len"} <= read  # the check sees what it reads
    missing = sorted(a for a in read if not hasattr(phase, a))
    assert not missing, f"vllm_kwargs reads {missing}, which the kernel benchmark does not parse"


def test_without_engine_settings_none_are_passed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cmd = measure_cmd(tmp_path, monkeypatch, [])
    assert "--compilation-config" not in cmd and "--enforce-eager" not in cmd


def test_a_compilation_config_that_is_not_a_json_object_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        bik.parse(["--compilation-config", "[1, 2]"])
    assert "must be a JSON object" in capsys.readouterr().err
