"""The scoring benchmark's command lines (benchmarks/scoring_gpu.py): a compilation config given once
reaches every vLLM engine it starts, so an A/B of engine settings compares like with like; a config
that is not a JSON object is refused before anything starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

from benchmarks.scoring_gpu import parse, phase_cmd, server_cmd, vllm_serve_cmd  # noqa: E402

CONFIG = '{"cudagraph_capture_sizes": [512, 1024, 16384]}'


def _value_after(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, cmd
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("judge", [False, True])
def test_the_compilation_config_reaches_the_server_and_vllm_serve(judge: bool) -> None:
    args = parse(["--sizes", "0.4b", "--compilation-config", CONFIG])
    model = Path("/models/m")
    for cmd in (
        server_cmd(model, 8000, args, judge=judge),
        vllm_serve_cmd(model, 8001, args, {}, judge=judge),
    ):
        assert json.loads(_value_after(cmd, "--compilation-config")) == json.loads(CONFIG)


def test_the_offline_phase_runs_with_the_same_engine_settings(tmp_path: Path) -> None:
    args = parse(["--sizes", "0.4b", "--compilation-config", CONFIG, "--enforce-eager"])
    cmd = phase_cmd("offline", tmp_path / "model", tmp_path, args)
    phase = parse(cmd[2:])  # what the phase's own process parses
    assert phase.phase == "offline"
    assert json.loads(phase.compilation_config) == json.loads(CONFIG)
    assert phase.enforce_eager


def test_without_a_compilation_config_no_engine_gets_one() -> None:
    args = parse(["--sizes", "0.4b"])
    model = Path("/models/m")
    assert "--compilation-config" not in server_cmd(model, 8000, args)
    assert "--compilation-config" not in vllm_serve_cmd(model, 8001, args, {})


@pytest.mark.parametrize("bad", ["{not json", "[512, 1024]"])
def test_a_config_that_is_not_a_json_object_is_refused(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--sizes", "0.4b", "--compilation-config", bad])
    assert "--compilation-config" in capsys.readouterr().err


@pytest.mark.parametrize("judge", [False, True])
def test_vllm_serve_gets_the_servers_batch_settings_unless_asked_for_its_own(judge: bool) -> None:
    model, limits = Path("/models/m"), {"max_num_batched_tokens": 16384, "max_num_seqs": 1024}
    same = vllm_serve_cmd(model, 8001, parse(["--sizes", "0.4b"]), limits, judge=judge)
    own = vllm_serve_cmd(
        model, 8001, parse(["--sizes", "0.4b", "--vllm-serve-settings", "own"]), limits, judge=judge
    )
    assert _value_after(same, "--max-num-batched-tokens") == "16384"
    assert _value_after(same, "--max-num-seqs") == "1024"
    assert "--max-num-batched-tokens" not in own and "--max-num-seqs" not in own
    assert ("--no-enable-chunked-prefill" in same) is not judge  # the scorer's engine setting only
    assert "--no-enable-chunked-prefill" not in own
    # the model served stays the same: head dtype and pooling (a scorer), length and memory
    for flag in ("--max-model-len", "--gpu-memory-utilization", "--runner"):
        assert _value_after(own, flag) == _value_after(same, flag)
    if not judge:
        assert json.loads(_value_after(own, "--pooler-config")) == {"pooling_type": "LAST"}
        assert json.loads(_value_after(own, "--hf-overrides")) == {"head_dtype": "float32"}
