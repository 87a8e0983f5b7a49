"""The scoring benchmark's A/B of the final decoder layer on the pooled rows
(benchmarks/scoring_gpu.py ``--offline-every-row``): the second offline phase runs vLLM's own model
(``REWARDPLANE_LAST_TOKEN_ONLY=0`` in its process, which vLLM's workers inherit), and the gain is
each prompt set's ratio, with the median and the scores' largest gap."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

import benchmarks.scoring_gpu as bench  # noqa: E402
from rewardplane.protocol.settings import LAST_TOKEN_ONLY  # noqa: E402


def test_gain_is_per_prompt_set_with_its_median() -> None:
    pooled = {"round_seconds": [1.0, 2.0, 4.0], "scores": [[0.5], [1.0]]}
    every = {"round_seconds": [1.1, 2.0, 4.8], "scores": [[0.51], [0.97]]}
    gain = bench.pooled_rows_gain(pooled, every, [1000, 1000, 2000])
    assert gain["pooled_rows_vs_every_row_rounds"] == pytest.approx([1.1, 1.0, 1.2])
    assert gain["pooled_rows_vs_every_row"] == pytest.approx(1.1)
    assert gain["offline_every_row_tok_s"] == pytest.approx(500.0)  # median of 909, 500, 417
    assert gain["pooled_rows_vs_every_row_max_abs_diff"] == pytest.approx(0.03)


@pytest.mark.parametrize(("phase", "expected"), [("offline", None), (bench.EVERY_ROW_PHASE, "0")])
def test_only_the_every_row_phase_turns_the_pooled_rows_off(
    phase: str, expected: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(LAST_TOKEN_ONLY.name, raising=False)
    (tmp_path / "prompts.json").write_text(json.dumps({"main": [[1, 2]]}))
    seen: dict[str, Any] = {}

    def offline(model_dir: Path, prompts: Any, args: Any) -> dict[str, Any]:
        import os

        seen["setting"] = os.environ.get(LAST_TOKEN_ONLY.name)
        return {"round_seconds": [1.0]}

    monkeypatch.setattr(bench, "phase_offline", offline)
    monkeypatch.setattr(bench, "settle_heap", lambda: None)
    cmd = bench.phase_cmd(phase, tmp_path / "m", tmp_path, bench.parse(["--sizes", "0.4b"]))
    assert bench.main(cmd[2:]) == 0
    assert seen["setting"] == expected
    assert json.loads((tmp_path / f"{phase}.json").read_text()) == {"round_seconds": [1.0]}


def test_the_option_parses() -> None:
    assert bench.parse(["--sizes", "1.4b", "--offline-every-row"]).offline_every_row
    assert not bench.parse(["--sizes", "1.4b"]).offline_every_row
