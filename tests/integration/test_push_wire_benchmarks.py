"""The four-GPU push-wire benchmarks run end to end on CPU (gloo, four real processes): every
pattern's received bytes are checked by the benchmarks themselves, so these also check the
transport's sliced and broadcast wires from one and from two senders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out)}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--cpu", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.mark.parametrize("replica_tp", ["2", "1"])
def test_the_sliced_wire_benchmark_receives_every_element(tmp_path: Path, replica_tp: str) -> None:
    shape = ("--layers", "2", "--hidden", "64", "--intermediate", "128", "--vocab", "256")
    done = _run(
        "sliced_wire.py", *shape, "--bucket-mib", "1", "--reps", "1", "--replica-tp", replica_tp, out=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "sliced_wire-gloo.json").read_text())
    patterns = doc["patterns"]
    assert set(patterns) == {"broadcast-1", "broadcast-2", "sliced-1", "sliced-2"}
    assert all(p["wrong_elements"] == 0 for p in patterns.values()), patterns
    # two senders: each split tensor's rows from both (TP=2: the row-parallel ones to both workers;
    # TP=1: every tensor to both replicas)
    assert patterns["sliced-2"]["box_messages"] > patterns["sliced-1"]["box_messages"] > 0
    assert doc["meta"]["bytes"] > 0 and doc["meta"]["transport"] == "gloo"
    assert "sliced-2 ÷ broadcast-2" in done.stdout


def test_the_raw_pairwise_benchmark_checks_what_it_received(tmp_path: Path) -> None:
    done = _run("pairwise_push.py", "--mib", "8", "--reps", "1", out=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "pairwise_push.json").read_text())["patterns"]
    assert set(rows) == {
        "broadcast-1",
        "p2p-1",
        "p2p-2",
        "p2p-2-rounds",
        "pairs-2-rounds",
        "broadcast-2",
        "broadcast-2-pieces",
    }
