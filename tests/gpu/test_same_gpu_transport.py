"""The same-host transport on one GPU, below the server: a receiving process and the trainer (this
process) on cuda:0 form a group with ``backend="auto"`` (CUDA IPC: NCCL refuses two ranks on one
GPU) and move buckets with ``send_buckets``/``receive_buckets``, as a push does.

Parameters the trainer keeps are read in place from the second push on (exported once); tensors
new on every push go through the staging ring; both land bit for bit, every round. Needs torch and
one GPU only (no vLLM). ``RP_IPC_TEST_MIB`` sets the bytes moved (default 512 MiB); the timings
are printed and, where ``OUT`` is set, written to ``$OUT/same_gpu_transport.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpus(1), pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 4
BUCKET = 256 << 20

RECEIVER = r"""
import json, sys, torch
from rewardplane.protocol import ParamMeta
from rewardplane.transport.buckets import torch_dtype
from rewardplane.transport.checksums import digests
from rewardplane.transport.comm import create_store
from rewardplane.transport.group import open_group
from rewardplane.transport.transfer import receive_buckets
port, rounds, bucket = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
metas = [ParamMeta(**m) for m in json.loads(sys.argv[4])]
dev = torch.device("cuda", 0)
store = create_store("127.0.0.1", port, is_master=False, world_size=2, timeout_s=60)
comm = open_group(store, rank=0, world_size=2, device=dev, timeout_s=60, group_id="t")
params = {m.name: torch.zeros(m.shape, dtype=torch_dtype(m.dtype), device=dev) for m in metas}
inplace = {m.name for m in metas if not m.name.startswith("loaded.")}
def load(items):
    for name, t in items:
        params[name].copy_(t)
for r in range(rounds):
    got = receive_buckets(comm, metas, bucket, 1, load, place=lambda m: params[m.name] if m.name in inplace else None)
    torch.cuda.synchronize(dev)
    comm.max_flag(1 if got.error else 0)
    comm.store.set(f"digest/{r}", json.dumps({"backend": comm.backend, "error": got.error, "digests": digests(list(params.items()))}))
comm.max_flag(0)
comm.close()
"""


def _env() -> dict[str, str]:
    src = [ROOT / p for p in ("core/src", "sdk/src", "operator/src", "images/reward-server/src", "src")]
    path = os.pathsep.join([*map(str, src), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path)


def test_pushes_on_one_gpu_go_over_cuda_ipc_bit_for_bit() -> None:
    import torch

    from rewardplane.testing.servers import free_port
    from rewardplane.transport.buckets import meta_of
    from rewardplane.transport.checksums import digests
    from rewardplane.transport.comm import create_store
    from rewardplane.transport.group import open_group
    from rewardplane.transport.transfer import send_buckets

    dev = torch.device("cuda", 0)
    total = int(os.environ.get("RP_IPC_TEST_MIB", "512")) << 20
    n = 32
    each = total // n // 2  # bf16 elements per tensor
    torch.manual_seed(0)
    kept = {f"layer{i}.weight": torch.randn(each, dtype=torch.bfloat16, device=dev) for i in range(n)}
    # received into a bucket buffer and loaded (not in place), and a tensor made anew every push
    kept["loaded.head"] = torch.randn(4, 64, dtype=torch.float32, device=dev)

    def fresh(r: int) -> dict[str, torch.Tensor]:
        return {"merged.weight": torch.full((1 << 20,), float(r), dtype=torch.bfloat16, device=dev)}

    metas = [meta_of(k, v) for k, v in {**kept, **fresh(0)}.items()]
    port = free_port()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            RECEIVER,
            str(port),
            str(ROUNDS),
            str(BUCKET),
            json.dumps([m.model_dump(mode="json") for m in metas]),
        ],
        env=_env(),
    )
    try:
        store = create_store("127.0.0.1", port, is_master=True, world_size=2, timeout_s=60)
        comm = open_group(store, rank=1, world_size=2, device=dev, timeout_s=60, group_id="t")
        assert comm.backend == "ipc"
        times = []
        for r in range(ROUNDS):
            with torch.no_grad():
                for t in kept.values():
                    t.mul_(1.001)  # a training step, in place
            tensors = {**kept, **fresh(r)}
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            send_buckets(comm, metas, tensors, BUCKET, 1)
            assert comm.max_flag(0) == 0
            times.append(time.perf_counter() - t0)
            got = json.loads(comm.store.get(f"digest/{r}"))
            assert got["backend"] == "ipc" and got["error"] is None, got
            want = digests(list(tensors.items()))
            differ = [k for k in want if tuple(want[k]) != tuple(got["digests"][k])]
            assert differ == [], f"round {r}: {differ[:5]} differ"
        comm.max_flag(0)
        comm.close()
    finally:
        child.wait(timeout=120)
    assert child.returncode == 0
    src = torch.empty(total, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(5):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(dev)
        copies.append(time.perf_counter() - t0)
    figures = {
        "bytes": total,
        "push_ms": [round(1000 * t, 3) for t in times],
        "steady_push_ms_median": 1000 * statistics.median(times[2:]),
        "device_copy_ms_median": 1000 * statistics.median(copies[1:]),
    }
    figures["ratio"] = figures["steady_push_ms_median"] / figures["device_copy_ms_median"]
    print(json.dumps(figures), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "same_gpu_transport.json").write_text(json.dumps(figures, indent=2))
