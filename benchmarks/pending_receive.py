"""What a receive waiting for the trainer costs the scoring kernels on the same GPU (two GPUs).

A push started from the data plane needs the server to wait for the trainer between pushes. Two
ways: a receive posted in advance (an NCCL broadcast pending on a side stream: its kernel occupies
SMs until the trainer sends) or a thread blocked on the group's TCPStore (nothing on the GPU; what
the server does). This measures scoring-like work (bf16 matmuls, the shape of a 7B layer's MLP on
a batch of 8k tokens) on GPU 0 alone, with a pending NCCL broadcast from GPU 1, and with a thread
waiting on the store; and how fast each wakes: a set key → the waiting thread, a small broadcast.

    python benchmarks/pending_receive.py            # writes $OUT/pending_receive.json when OUT is set
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_out import report  # noqa: E402
from rewardplane.testing.gpus import visible_gpus  # noqa: E402
from rewardplane.testing.servers import free_port  # noqa: E402
from rewardplane.transport.comm import Communicator, create_store  # noqa: E402

PEER = r"""
import sys, time, torch
from rewardplane.transport.comm import Communicator, create_store
port, hold_s = int(sys.argv[1]), float(sys.argv[2])
dev = torch.device("cuda", 0)
store = create_store("127.0.0.1", port, is_master=False, world_size=2, timeout_s=120)
comm = Communicator(store, rank=1, world_size=2, device=dev, timeout_s=120, group_id="pending")
header = torch.ones(4096, dtype=torch.uint8, device=dev)
comm.max_flag(0)                 # 1: ready
time.sleep(hold_s)               # the receiver scores meanwhile, a broadcast pending
comm.broadcast(header, 1)
comm.synchronize()
comm.max_flag(0)                 # 2: idle phase done on the receiver
for _ in range(20):              # small broadcasts: the wake-up latency of a posted receive
    comm.max_flag(0)
    comm.broadcast(header, 1)
    comm.synchronize()
comm.max_flag(0)
"""


def scoring_rate(dev: torch.device, seconds: float, stream: torch.cuda.Stream) -> float:
    """TFLOP/s of bf16 matmuls [8192, 4096] x [4096, 11008] on ``stream`` for about ``seconds``."""
    x = torch.randn(8192, 4096, dtype=torch.bfloat16, device=dev)
    w = torch.randn(4096, 11008, dtype=torch.bfloat16, device=dev)
    flops = 2 * 8192 * 4096 * 11008
    with torch.cuda.stream(stream):
        for _ in range(5):
            x @ w
        torch.cuda.synchronize(dev)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(20):
                x @ w
            torch.cuda.current_stream(dev).synchronize()
            n += 20
        return n * flops / (time.perf_counter() - start) / 1e12


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs")
        return 2
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    port, hold_s, measure_s = free_port(), 4.0, 2.0
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, str(port), str(hold_s)],
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=visible_gpus(1)),
    )
    try:
        store = create_store("127.0.0.1", port, is_master=True, world_size=2, timeout_s=120)
        comm = Communicator(store, rank=0, world_size=2, device=dev, timeout_s=120, group_id="pending")
        scoring = torch.cuda.Stream(dev)
        side = torch.cuda.Stream(dev)
        header = torch.empty(4096, dtype=torch.uint8, device=dev)
        alone = scoring_rate(dev, measure_s, scoring)
        comm.max_flag(0)  # 1: the peer holds its broadcast for hold_s
        with torch.cuda.stream(side):
            comm.broadcast(header, 1)  # posted: its kernel waits on the GPU for the peer
            posted = torch.cuda.Event()
            posted.record(side)
        pending = scoring_rate(dev, measure_s, scoring)
        still_pending = not posted.query()
        with torch.cuda.stream(side):
            comm.synchronize()
        comm.max_flag(0)  # 2
        # a thread blocked on the store, as the server's listener between pushes
        stop = threading.Event()
        client = create_store("127.0.0.1", port, is_master=False, world_size=None, timeout_s=120)

        def wait_on_store() -> None:
            while not stop.is_set():
                try:
                    client.wait(["pending/never"], timedelta(seconds=0.5))
                except Exception:
                    pass

        waiter = threading.Thread(target=wait_on_store, daemon=True)
        waiter.start()
        store_waiting = scoring_rate(dev, measure_s, scoring)
        stop.set()
        waiter.join()
        # wake-up latency: a posted small broadcast (sender enqueues right after a reduction)
        bcast = []
        for _ in range(20):
            comm.max_flag(0)
            t0 = time.perf_counter()
            comm.broadcast(header, 1)
            comm.synchronize()
            bcast.append(time.perf_counter() - t0)
        comm.max_flag(0)
        # wake-up latency: set a key → a thread waiting on it returns
        wakes: list[float] = []
        set_at = [0.0]

        def wait_key(key: str) -> None:
            client.wait([key], timedelta(seconds=10))
            wakes.append(time.perf_counter() - set_at[0])

        for i in range(20):
            th = threading.Thread(target=wait_key, args=(f"pending/wake{i}",))
            th.start()
            time.sleep(0.02)
            set_at[0] = time.perf_counter()
            store.set(f"pending/wake{i}", "1")
            th.join()
        comm.close()
    finally:
        peer.wait(timeout=60)
    res = {
        "gpu": torch.cuda.get_device_name(dev),
        "scoring_tflops_alone": alone,
        "scoring_tflops_nccl_receive_pending": pending,
        "receive_was_pending_throughout": still_pending,
        "scoring_tflops_thread_on_store": store_waiting,
        "ratio_pending_nccl": pending / alone,
        "ratio_store_wait": store_waiting / alone,
        "small_broadcast_ms_median": 1000 * statistics.median(bcast),
        "store_wake_ms_median": 1000 * statistics.median(wakes),
    }
    report(res, "pending_receive.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
