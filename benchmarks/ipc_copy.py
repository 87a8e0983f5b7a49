"""The floor of a same-GPU push: copying a model's tensors from one process into another on one GPU
through CUDA IPC, with nothing of rewardplane in the way.

A child process opens the parent's tensors (torch's own CUDA IPC sharing: one handle per storage)
and copies them into one buffer of its own, tensor by tensor, as a per-tensor receive does. It
reports, medians of ``--reps`` after a first copy:

- opening the handles; the first copy after opening;
- a ``copy_`` per tensor, one ``torch._foreach_copy_`` over all of them, and the ``copy_`` calls
  captured once as a CUDA graph and replayed: the CPU's time to enqueue the copies and the GPU's
  time to run them (CUDA events);
- one flat copy out of a single shared buffer of the same bytes (the IPC limit).

    python benchmarks/ipc_copy.py --size 7b          # alone (colocated_push.py runs it as a part)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _timed(dev: torch.device, enqueue: Callable[[], object]) -> dict[str, float]:
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    enqueue()
    t1 = time.perf_counter()
    end.record()
    end.synchronize()
    t2 = time.perf_counter()
    return {
        "cpu_enqueue_ms": 1000 * (t1 - t0),
        "gpu_ms": start.elapsed_time(end),
        "wall_ms": 1000 * (t2 - t0),
    }


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _graph_of(enqueue: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``enqueue``'s work captured as one CUDA graph (what a same-GPU receiver replays)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()):
        graph.capture_begin(capture_error_mode="thread_local")
        enqueue()
        graph.capture_end()
    return graph


def _child(inbox: Any, outbox: Any, reps: int) -> None:
    try:
        t0 = time.perf_counter()
        tensors, flat = inbox.get()  # unpickling opens every storage's handle
        opened_ms = 1000 * (time.perf_counter() - t0)
        dev = flat.device
        torch.cuda.set_device(dev)
        srcs = [t.reshape(-1).view(torch.uint8) for t in tensors]
        dst = torch.empty(flat.numel(), dtype=torch.uint8, device=dev)
        dsts, at = [], 0
        for s in srcs:
            dsts.append(dst[at : at + s.numel()])
            at += s.numel()

        def loop() -> None:
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s, non_blocking=True)

        first = _timed(dev, loop)
        graph = _graph_of(loop)  # captured once, replayed every round
        out = {
            "tensors": len(srcs),
            "bytes": flat.numel(),
            "open_ms": opened_ms,
            "first_copy": first,
            "per_tensor_copy": _medians([_timed(dev, loop) for _ in range(reps)]),
            "foreach_copy": _medians(
                [
                    _timed(dev, lambda: torch._foreach_copy_(dsts, srcs, non_blocking=True))
                    for _ in range(reps)
                ]
            ),
            "graph_copy": _medians([_timed(dev, graph.replay) for _ in range(reps)]),
            "flat_copy": _medians(
                [_timed(dev, lambda: dst.copy_(flat, non_blocking=True)) for _ in range(reps)]
            ),
        }
        outbox.put(("ok", out))
    except BaseException as exc:
        outbox.put(("error", f"{type(exc).__name__}: {exc}"))


def cross_process_copy(
    params: dict[str, torch.Tensor], reps: int, timeout_s: float = 300.0
) -> dict[str, Any]:
    """The child's figures (module docstring) for ``params``, which stay where they are."""
    tensors = [t.detach() for t in params.values()]
    dev = tensors[0].device
    flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8, device=dev)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child, args=(inbox, outbox, reps), daemon=True)
    child.start()
    try:
        inbox.put((tensors, flat))
        status, out = outbox.get(timeout=timeout_s)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if status != "ok":
        raise RuntimeError(f"the copying process failed: {out}")
    pt, fe, gr, fl = out["per_tensor_copy"], out["foreach_copy"], out["graph_copy"], out["flat_copy"]
    print(
        f"   across processes, {out['tensors']} tensors, {out['bytes'] / 1e9:.2f} GB: open {out['open_ms']:.1f} ms, "
        f"first copy {out['first_copy']['wall_ms']:.2f} ms; per tensor {pt['wall_ms']:.2f} ms "
        f"(CPU {pt['cpu_enqueue_ms']:.2f}, GPU {pt['gpu_ms']:.2f}); foreach {fe['wall_ms']:.2f} ms "
        f"(CPU {fe['cpu_enqueue_ms']:.2f}, GPU {fe['gpu_ms']:.2f}); graph {gr['wall_ms']:.2f} ms "
        f"(CPU {gr['cpu_enqueue_ms']:.2f}, GPU {gr['gpu_ms']:.2f}); flat {fl['gpu_ms']:.2f} ms",
        flush=True,
    )
    return out


def main() -> int:
    from benchmarks.weight_sync import SIZES, build_trainer_model, make_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="7b", choices=sorted(SIZES))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import tempfile

    ckpt = make_checkpoint(args.size, Path(tempfile.mkdtemp(prefix="ipc-copy-")))
    model = build_trainer_model(ckpt, torch.device("cuda", 0))
    print(json.dumps(cross_process_copy(model.state_dict(), args.reps), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
