"""``--interleave`` in the scoring benchmark (benchmarks/scoring_gpu.py): the reward server and
``vllm serve`` run side by side and take turns on each prompt set. Which one goes first alternates
by round, and a failure is charged to the server it happened on, with that server's log, even
though both servers' contexts are open around it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

from benchmarks.scoring_gpu import PAIR, PhaseFailed, free_port, pair_order, parse, serving  # noqa: E402


def test_the_reward_server_goes_first_in_the_measured_round_then_the_order_alternates() -> None:
    order = pair_order(5)
    assert order[0] == ("server", "vllm-serve")
    assert order == [PAIR, PAIR[::-1], PAIR, PAIR[::-1], PAIR]
    firsts = [o[0] for o in pair_order(6)]
    assert firsts.count("server") == firsts.count("vllm-serve") == 3


def _static_server(tmp_path: Path, kind: str) -> tuple[list[str], int]:
    """A real HTTP server process whose GET /health answers 200 (a file named health)."""
    site = tmp_path / f"site-{kind}"
    site.mkdir()
    (site / "health").write_text("ok")
    port = free_port()
    return [
        sys.executable,
        "-m",
        "http.server",
        str(port),
        "--bind",
        "127.0.0.1",
        "--directory",
        str(site),
    ], port


def test_a_failure_is_charged_to_the_server_it_happened_on(tmp_path: Path) -> None:
    args = parse(["--sizes", "0.4b", "--phase-timeout", "60"])
    (cmd_a, port_a), (cmd_b, port_b) = _static_server(tmp_path, "a"), _static_server(tmp_path, "b")
    with (
        pytest.raises(PhaseFailed) as err,
        serving("server", cmd_a, port_a, tmp_path, args) as (proc_a, _),
        serving("vllm-serve", cmd_b, port_b, tmp_path, args) as (proc_b, _),
    ):
        assert proc_a.poll() is None and proc_b.poll() is None
        raise TimeoutError("no answer")  # inside both: the innermost server's phase
    message = str(err.value)
    assert message.startswith("the vllm-serve phase failed (TimeoutError"), message
    assert f"vllm-serve-{port_b}.log" in message
    assert "the server phase failed" not in message  # not wrapped again by the outer server
    for proc in (proc_a, proc_b):  # both servers stopped on the way out
        assert proc.wait(timeout=30) is not None


def test_a_server_that_exits_at_start_is_named(tmp_path: Path) -> None:
    args = parse(["--sizes", "0.4b", "--phase-timeout", "30"])
    cmd = [sys.executable, "-c", "import sys; print('bad flag'); sys.exit(2)"]
    with pytest.raises(PhaseFailed) as err, serving("vllm-serve", cmd, free_port(), tmp_path, args):
        pass
    assert "the vllm-serve phase failed" in str(err.value) and "bad flag" in str(err.value)
