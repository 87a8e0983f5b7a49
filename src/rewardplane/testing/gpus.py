"""Which GPUs a child process (a server, a benchmark's peer) should see.

A job started with ``CUDA_VISIBLE_DEVICES=2,3`` sees those GPUs as its devices 0 and 1. A child
given ``CUDA_VISIBLE_DEVICES=0`` would instead land on the host's GPU 0, outside the job's GPUs,
perhaps beside another job. So children get the parent's own list, indexed.
"""

from __future__ import annotations

import os


def visible_gpus(devices: int | str) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child that should use this process's device(s) ``devices``
    (an index, or indices joined by commas: ``"0,1"`` for a tensor-parallel server)."""
    wanted = [int(d) for d in str(devices).split(",")]
    own = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not own:
        return ",".join(str(d) for d in wanted)  # every GPU of the host is visible: indices are the host's
    ids = [v.strip() for v in own.split(",") if v.strip()]
    if any(not 0 <= d < len(ids) for d in wanted):
        raise ValueError(
            f"device(s) {devices} are not among this process's CUDA_VISIBLE_DEVICES={own!r} "
            f"({len(ids)} visible): give the job more GPUs"
        )
    return ",".join(ids[d] for d in wanted)


def gpu_memory_used_mib(device: int = 0) -> int | None:
    """Memory in use on this process's GPU ``device``, as the driver reports it for every process
    (``nvidia-smi``): what a colocated trainer and server take together. None without nvidia-smi."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    gpu = visible_gpus(device)
    flag = f"--id={gpu}"
    out = subprocess.run(
        ["nvidia-smi", flag, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    try:
        return int(out.stdout.strip().splitlines()[0])
    except (IndexError, ValueError):
        return None
