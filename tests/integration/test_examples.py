"""The reward-model examples run end to end in their quick mode (each starts its own reward
server, trains, pushes and checks the trained direction itself); here we also read the result
line and check the direction from outside."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "reward_model"


@pytest.mark.parametrize(
    "script", ["train_rm_head_only", "train_rm_lora", "train_rm_full", "cold_start_rlhf"]
)
def test_example_trains_in_the_preferred_direction(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{script}.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["margin_after"] > result["margin_before"]
    assert result["after"] >= 0.9 > result["before"]
    if script == "cold_start_rlhf":
        assert result["policy_after"] > result["policy_before"]


def test_llm_judge_example_learns_its_verdicts() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "llm_judge.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    # the random judge's answers are unreadable (counted, written as the default); the pushed one's are scores
    assert result["failures_before"] > 0 and result["failures_after"] == 0
    assert result["after"] >= 0.9 > result["before"]
