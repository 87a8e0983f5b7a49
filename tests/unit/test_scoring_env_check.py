"""The scoring benchmark records each measured process's environment (benchmarks/server_env.py)
and refuses a ratio between two whose environments differ in a way that matters
(benchmarks/env_diff.py), naming each difference: a front end on asyncio and h11 against one on
uvloop and httptools measures the setup, not the software."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # benchmarks/, after everything else

import benchmarks.scoring_gpu as bench  # noqa: E402
from benchmarks import env_diff, server_env  # noqa: E402

NAMES = ("the reward server", "vllm serve")


def _env(**changes: Any) -> dict[str, Any]:
    """A recorded environment as ``server_env.describe`` writes it."""
    env: dict[str, Any] = {
        "processes": [],
        "api_processes": 1,
        "event_loop": "uvloop",
        "http_parser": "httptools",
        "engine_processes": 1,
        "cpus": {"api": "0-15", "engine": "0-15"},
        "same_core": [],
        "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONPATH": "/tmp/site"},
        "versions": {"vllm": "0.24.0", "uvicorn": "0.54.0", "httptools": "0.9.0", "uvloop": "0.23.0"},
    }
    env.update(changes)
    return env


def test_alike_environments_are_comparable() -> None:
    assert env_diff.differences(_env(), _env(), NAMES) == []


def test_each_difference_that_matters_is_named() -> None:
    slow = _env(
        event_loop="asyncio",
        http_parser="h11",
        api_processes=4,
        cpus={"api": "0-7", "engine": "0-15"},
        env={"VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONPATH": "/tmp/site", "OMP_NUM_THREADS": "1"},
        versions={"vllm": "0.24.0", "uvicorn": "0.40.0", "uvloop": "0.23.0"},
    )
    assert env_diff.differences(_env(), slow, NAMES) == [
        "event loop: 'uvloop' (the reward server) vs 'asyncio' (vllm serve)",
        "HTTP parser: 'httptools' (the reward server) vs 'h11' (vllm serve)",
        "processes answering HTTP: 1 (the reward server) vs 4 (vllm serve)",
        "httptools version: '0.9.0' (the reward server) vs absent (vllm serve)",
        "uvicorn version: '0.54.0' (the reward server) vs '0.40.0' (vllm serve)",
        "CPUs the api process may run on: '0-15' (the reward server) vs '0-7' (vllm serve)",
        "$OMP_NUM_THREADS: absent (the reward server) vs '1' (vllm serve)",
    ]


def test_what_differs_by_design_or_does_not_apply_is_not_compared() -> None:
    placed = _env(
        processes=[{"pid": 7, "role": "engine", "threads": 90, "start": "spawn"}],
        same_core=["api 6 and engine 7 on core 0:3"],
        env={
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "PYTHONPATH": "/tmp/site",
            "REWARDPLANE_LAST_TOKEN_ONLY": "0",
        },
    )
    assert env_diff.differences(_env(), placed, NAMES) == []
    # vLLM offline serves no HTTP: no loop, parser or API process to compare, only the engine's CPUs
    offline = _env(api_processes=None, cpus={"engine": "0-15"})
    del offline["event_loop"], offline["http_parser"]
    assert env_diff.differences(_env(), offline, ("the reward server", "vLLM offline")) == []


def test_an_environment_not_recorded_or_unreadable_is_refused() -> None:
    assert env_diff.differences(_env(), None, NAMES) == [
        "the environment of vllm serve was not recorded: a ratio against it cannot be checked"
    ]
    [why] = env_diff.differences({"error": "PermissionError: /proc/7/environ"}, _env(), NAMES)
    assert why == "the environment of the reward server could not be read (PermissionError: /proc/7/environ)"


def _row(server: dict[str, Any], serve: dict[str, Any]) -> dict[str, Any]:
    rounds = [1.02, 1.05, 1.03, 1.04, 1.01]
    return {
        "kind": "judge",
        "size": "0.4b",
        "interleaved": True,
        "environments": {"server": server, "vllm_serve": serve},
        "server_vs_vllm_serve": 1.03,
        "server_vs_vllm_serve_rounds": rounds,
        "server_out_tok_s_rounds": [25_000.0] * 5,
    }


def test_a_refused_ratio_is_left_out_and_its_goal_names_why() -> None:
    row = bench.summarised(_row(_env(), _env(event_loop="asyncio")))
    assert "server_vs_vllm_serve" not in row and "server_vs_vllm_serve_rounds" not in row
    assert row["server_vs_vllm_serve_refused"] == [
        "event loop: 'uvloop' (the reward server) vs 'asyncio' (vllm serve)"
    ]
    assert row["server_out_tok_s_spread"]["median"] == 25_000.0  # each server's own figures stay
    [goal] = bench.goals([row])
    assert goal["value"] is None and not goal["judged"] and not goal["met"]
    line = bench.goal_line(goal)
    assert line.endswith(
        "-: not judged: environments differ: event loop: 'uvloop' (the reward server) vs 'asyncio' (vllm serve)"
    )


def test_a_comparable_ratio_keeps_its_rounds_and_spread() -> None:
    row = bench.summarised(_row(_env(), _env()))
    assert row["server_vs_vllm_serve_spread"] == {
        "n": 5,
        "min": 1.01,
        "q1": 1.02,
        "median": 1.03,
        "q3": 1.04,
        "max": 1.05,
    }
    [goal] = bench.goals([row])
    assert goal["judged"] and goal["met"]
    assert bench.goal_line(goal).endswith(
        "1.030 (min 1.010, quartiles 1.020-1.040, max 1.050; 5 rounds), goal: lower quartile >= 1.0: met"
    )
    sequential = bench.summarised({**_row(_env(), _env()), "interleaved": False})
    [goal] = bench.goals([sequential])
    assert not goal["judged"] and "one after the other" in goal["why"]


@pytest.fixture
def two_uvicorns(tmp_path: Path) -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
    """Two real uvicorn servers of one ASGI app: uvloop with httptools, and asyncio with h11 (the
    fallback a server gets where the C wheels are missing). Yields each one's (pid, port)."""
    (tmp_path / "tiny_app.py").write_text(
        "async def app(scope, receive, send):\n"
        "    if scope['type'] == 'http':\n"
        "        await send({'type': 'http.response.start', 'status': 200, 'headers': []})\n"
        "        await send({'type': 'http.response.body', 'body': b'ok'})\n"
    )
    procs: list[subprocess.Popen[bytes]] = []
    started: list[tuple[int, int]] = []
    try:
        for loop, http in (("uvloop", "httptools"), ("asyncio", "h11")):
            port = bench.free_port()
            cmd = [sys.executable, "-m", "uvicorn", "tiny_app:app", "--port", str(port)]
            cmd += ["--loop", loop, "--http", http, "--log-level", "warning"]
            procs.append(subprocess.Popen(cmd, cwd=tmp_path))
            started.append((procs[-1].pid, port))
        for _, port in started:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        yield started[0], started[1]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def test_real_servers_on_other_loops_and_parsers_are_told_apart(
    two_uvicorns: tuple[tuple[int, int], tuple[int, int]],
) -> None:
    (fast_pid, fast_port), (slow_pid, slow_port) = two_uvicorns
    fast, slow = server_env.describe(fast_pid, fast_port), server_env.describe(slow_pid, slow_port)
    assert (fast["event_loop"], fast["http_parser"], fast["api_processes"]) == ("uvloop", "httptools", 1)
    assert (slow["event_loop"], slow["http_parser"], slow["api_processes"]) == ("asyncio", "h11", 1)
    [api] = [p for p in fast["processes"] if p["role"] == "api"]
    assert api["pid"] == fast_pid and api["start"] == "exec" and api["cpus"] == fast["cpus"]["api"]
    # the versions as the server's own interpreter resolves them: this virtual environment's
    assert fast["versions"]["uvicorn"] == slow["versions"]["uvicorn"] is not None
    assert env_diff.differences(fast, slow, NAMES) == [
        "event loop: 'uvloop' (the reward server) vs 'asyncio' (vllm serve)",
        "HTTP parser: 'httptools' (the reward server) vs 'h11' (vllm serve)",
    ]
    alike = copy.deepcopy(slow)
    alike.update(event_loop="uvloop", http_parser="httptools")
    assert env_diff.differences(fast, alike, NAMES) == []


def test_the_host_is_described() -> None:
    host = server_env.host()
    assert host["logical_cpus"] >= 1 and host["cpus_allowed"]
    assert server_env.parse_cpu_list(host["cpus_allowed"]) == set(server_env.os.sched_getaffinity(0))
    assert server_env.cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def test_core_sharing_is_the_share_of_samples_on_one_core() -> None:
    samples = [
        {"1:api": "0:1", "2:engine": "0:1", "client": "0:2"},
        {"1:api": "0:1", "2:engine": "0:3", "client": "0:3"},
        {"1:api": "0:4", "2:engine": "0:4"},  # the client not seen in this sample
        {"1:api": "0:5", "2:engine": "0:6"},
    ]
    assert server_env.same_core_shares(samples) == {
        "1:api + 2:engine": 0.5,
        "1:api + client": 0.0,
        "2:engine + client": 0.5,
    }


def test_core_sharing_samples_a_real_process_tree_and_this_client() -> None:
    spin = "import time\nt = time.time()\nwhile time.time() - t < 3: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        with server_env.CoreSharing(child.pid, interval_s=0.02) as sharing:
            time.sleep(0.5)
        assert len(sharing.samples) >= 5
        for sample in sharing.samples:  # the child's main thread and this client's, by core
            [label] = set(sample) - {server_env.CoreSharing.CLIENT}
            assert label.startswith(f"{child.pid}:") and server_env.CoreSharing.CLIENT in sample
        [(pair, share)] = sharing.shares().items()
        assert server_env.CoreSharing.CLIENT in pair and 0.0 <= share <= 1.0
    finally:
        child.kill()
        child.wait(timeout=30)
