"""Where a vLLM engine core's time goes, from a py-spy recording (speedscope format).

    python benchmarks/engine_timeline.py server.json [--bin 0.1] [--bins]

py-spy (``record --subprocesses --idle --format speedscope``, recipe in docs/gpu.md) samples every
thread of the recorded processes in order. For each vLLM engine core in the file (a process with
vLLM's ``process_input_sockets`` thread) this prints what its two busy threads did, as shares of
wall time:

- the main thread: ``idle`` (waiting for requests), ``launch`` (CPU inside the model runner's
  ``execute_model``: preparing inputs and launching kernels), ``gpu_wait`` (waiting for a step's
  output, the GPU ahead of the CPU), ``schedule``, ``shutdown``, ``other``;
- the input thread, which decodes each request and hashes its prompt's blocks for prefix caching:
  ``idle``, ``decode``, ``hash``, ``other``.

Time is cut into bins of ``--bin`` seconds. A bin where the input thread works for at least
``ARRIVAL_BUSY`` of it is an *arrival* bin (a burst's prompts coming in); a bin where the main
thread steps (launch, GPU wait, schedule: at least 0.8 of the bin) and the input thread is idle
is a *steady* bin. The shares are summed over each
kind, so a burst's start can be set beside the engine's steady running: a main thread that only
launches, with no GPU wait, during arrival bins is CPU-bound there (its launches share the GIL
with the input thread), while in steady bins the GPU sets the pace.

Frame names are vLLM 0.24's. A sample is attributed to the frame a thread was in, including time
spent waiting for the GIL.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INPUT_THREAD = "process_input_sockets"
ARRIVAL_BUSY = 0.3  # input-thread busy share that marks a bin as a burst's arrival


def main_thread_state(frames: Sequence[str]) -> str:
    """What the engine core's main thread does in one sample (``frames``: outermost first)."""
    leaf = frames[-3:]
    if "Queue.get" in leaf or (frames and frames[-1] == "Condition.wait" and "Queue.get" in frames):
        return "idle"
    if any("shutdown" in f for f in frames):
        return "shutdown"
    if any(f.endswith("get_output") or f == "AsyncOutputFuture.result" for f in frames):
        return "gpu_wait"
    if any(f.endswith("execute_model") for f in frames):
        return "launch"
    if any("schedule" in f.lower() for f in frames):
        return "schedule"
    return "other"


def input_thread_state(frames: Sequence[str]) -> str:
    """What the engine core's input thread does in one sample."""
    if frames and frames[-1] == "Poller.poll":
        return "idle"
    if any("hash" in f for f in frames):
        return "hash"
    if any("decode" in f.lower() for f in frames):
        return "decode"
    return "other"


@dataclass
class Thread:
    """One thread's samples: (time from the recording's start, state, seconds)."""

    samples: list[tuple[float, str, float]] = field(default_factory=list)


@dataclass
class EngineCore:
    pid: str
    main: Thread
    inputs: Thread


def _states(profile: dict[str, Any], names: list[str], classify: Any) -> Thread:
    t, out = 0.0, Thread()
    for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
        out.samples.append((t, classify([names[i] for i in stack]), float(weight)))
        t += weight
    return out


def engine_cores(doc: dict[str, Any]) -> list[EngineCore]:
    """Every engine core in a speedscope document from ``py-spy record --subprocesses``."""
    names = [f["name"] for f in doc["shared"]["frames"]]
    by_pid: dict[str, dict[str, dict[str, Any]]] = collections.defaultdict(dict)
    for prof in doc["profiles"]:
        parts = prof["name"].split()  # 'Process 2767 Thread 2943 "Thread-2 (process_input_sockets)"'
        if len(parts) >= 4 and parts[0] == "Process":
            pid, tid = parts[1], parts[3]
            by_pid[pid][INPUT_THREAD if INPUT_THREAD in prof["name"] else tid] = prof
    cores = []
    for pid, threads in by_pid.items():
        if INPUT_THREAD in threads and pid in threads:  # the main thread's id is the process id
            cores.append(
                EngineCore(
                    pid,
                    _states(threads[pid], names, main_thread_state),
                    _states(threads[INPUT_THREAD], names, input_thread_state),
                )
            )
    return cores


Seconds = dict[str, float]  # seconds per state


def binned(thread: Thread, width: float) -> dict[int, Seconds]:
    """Seconds per state in each bin of ``width`` seconds (bin i: [i * width, (i + 1) * width))."""
    bins: dict[int, Seconds] = collections.defaultdict(lambda: collections.defaultdict(float))
    for t, state, w in thread.samples:
        bins[int(t / width)][state] += w
    return bins


def kinds_of_bins(main: dict[int, Seconds], inputs: dict[int, Seconds], width: float) -> dict[str, list[int]]:
    """The bins of arrivals (input thread busy) and of steady running (main thread busy, input idle);
    ``main`` and ``inputs``: the two threads ``binned``."""
    kinds: dict[str, list[int]] = {"arrival": [], "steady": []}
    for b in sorted(set(main) | set(inputs)):
        in_busy = sum(v for s, v in inputs.get(b, {}).items() if s != "idle") / width
        stepping = sum(main.get(b, {}).get(s, 0.0) for s in ("launch", "gpu_wait", "schedule")) / width
        if in_busy >= ARRIVAL_BUSY:
            kinds["arrival"].append(b)
        elif in_busy == 0 and stepping >= 0.8:
            kinds["steady"].append(b)
    return kinds


def shares(per_bin: dict[int, Seconds], bins: Iterable[int]) -> dict[str, float]:
    """Each state's share of the time in ``bins`` (``per_bin``: a thread ``binned``)."""
    total: Seconds = collections.defaultdict(float)
    for b in bins:
        for state, v in per_bin.get(b, {}).items():
            total[state] += v
    seconds = sum(total.values())
    return {s: v / seconds for s, v in sorted(total.items(), key=lambda kv: -kv[1])} if seconds else {}


def _fmt(share: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in share.items())


def report(doc: dict[str, Any], width: float, show_bins: bool = False) -> str:
    lines = []
    cores = engine_cores(doc)
    if not cores:
        return "no vLLM engine core in this recording (record with --subprocesses and --idle)"
    for core in cores:
        main_bins, input_bins = binned(core.main, width), binned(core.inputs, width)
        kinds = kinds_of_bins(main_bins, input_bins, width)
        lines.append(f"engine core {core.pid}:")
        for kind, bins in kinds.items():
            lines.append(f"  {kind:8} {len(bins) * width:5.1f} s  main: {_fmt(shares(main_bins, bins))}")
            lines.append(f"  {'':8} {'':7}  input: {_fmt(shares(input_bins, bins))}")
        if show_bins:
            for b in sorted(set(kinds["arrival"]) | set(kinds["steady"])):
                cells = {
                    **{"M." + k: v for k, v in main_bins.get(b, {}).items()},
                    **{"I." + k: v for k, v in input_bins.get(b, {}).items()},
                }
                lines.append(
                    f"  {b * width:7.2f} "
                    + " ".join(f"{k}:{v / width:.2f}" for k, v in sorted(cells.items()))
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recording", type=Path, help="py-spy's speedscope JSON")
    p.add_argument("--bin", type=float, default=0.1, help="bin width in seconds")
    p.add_argument("--bins", action="store_true", help="also print every arrival and steady bin")
    args = p.parse_args(argv)
    if args.bin <= 0:
        p.error("--bin must be > 0")
    try:
        doc = json.loads(args.recording.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        p.error(f"cannot read {args.recording} as a speedscope JSON: {exc}")
    print(report(doc, args.bin, args.bins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
