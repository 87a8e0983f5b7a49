"""benchmarks/engine_timeline.py on a synthetic py-spy recording: a burst's arrival (the input thread
hashing while the main thread only launches) and steady running (launch and GPU wait, input idle)
come out as the shares they were built from."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

from benchmarks.engine_timeline import binned, engine_cores, kinds_of_bins, report, shares  # noqa: E402

FRAMES = [
    "Thread.run",  # 0
    "EngineCoreProc.run_busy_loop",  # 1
    "EngineCoreProc._process_input_queue",  # 2
    "Queue.get",  # 3
    "Condition.wait",  # 4
    "EngineCore.step",  # 5
    "GPUModelRunner.execute_model",  # 6
    "AsyncOutputFuture.result",  # 7
    "AsyncGPUPoolingModelRunnerOutput.get_output",  # 8
    "EngineCoreProc.process_input_sockets",  # 9
    "Poller.poll",  # 10
    "Request.update_block_hashes",  # 11
    "sha256",  # 12
    "MsgpackDecoder.decode",  # 13
]
IDLE_MAIN = [1, 2, 3, 4]
LAUNCH = [1, 5, 6]
GPU_WAIT = [1, 5, 7, 8]
POLL = [0, 9, 10]
HASH = [0, 9, 11, 12]
DECODE = [0, 9, 13]
DT = 0.002  # py-spy at 500 Hz


def _profile(name: str, stacks: list[list[int]]) -> dict[str, Any]:
    return {"name": name, "type": "sampled", "samples": stacks, "weights": [DT] * len(stacks)}


def recording() -> dict[str, Any]:
    # 0.4 s idle, 0.4 s arrival (main: launch only; input: 3/4 hashing, 1/4 decoding), 1.0 s steady
    # (main: 60% launch, 40% GPU wait; input idle)
    idle, arrival, steady = 200, 200, 500
    main = (
        [IDLE_MAIN] * idle + [LAUNCH] * arrival + [LAUNCH if i % 5 < 3 else GPU_WAIT for i in range(steady)]
    )
    inputs = [POLL] * idle + [HASH if i % 4 else DECODE for i in range(arrival)] + [POLL] * steady
    api = [[0]] * (idle + arrival + steady)
    return {
        "shared": {"frames": [{"name": n} for n in FRAMES]},
        "profiles": [
            _profile('Process 100 Thread 100 "MainThread"', api),  # the API process: no input thread
            _profile('Process 200 Thread 200 "MainThread"', main),
            _profile('Process 200 Thread 201 "Thread-2 (process_input_sockets)"', inputs),
        ],
    }


def test_only_processes_with_an_input_thread_are_engine_cores() -> None:
    assert [c.pid for c in engine_cores(recording())] == ["200"]


def test_arrival_and_steady_bins_and_their_shares() -> None:
    (core,) = engine_cores(recording())
    main, inputs = binned(core.main, 0.1), binned(core.inputs, 0.1)
    kinds = kinds_of_bins(main, inputs, 0.1)
    assert kinds["arrival"] == [4, 5, 6, 7]
    assert kinds["steady"] == list(range(8, 18))
    assert shares(main, kinds["arrival"]) == pytest.approx({"launch": 1.0})
    assert shares(inputs, kinds["arrival"]) == pytest.approx({"hash": 0.75, "decode": 0.25})
    assert shares(main, kinds["steady"]) == pytest.approx({"launch": 0.6, "gpu_wait": 0.4})
    assert shares(inputs, kinds["steady"]) == pytest.approx({"idle": 1.0})


def test_report_names_each_kind_and_says_when_there_is_no_engine_core() -> None:
    text = report(recording(), 0.1)
    assert "engine core 200" in text and "arrival" in text and "steady" in text
    doc = recording()
    doc["profiles"] = doc["profiles"][:1]
    assert "no vLLM engine core" in report(doc, 0.1)
