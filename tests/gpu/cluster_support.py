"""For the operator-on-GPUs test: what the local cluster needs (skip reasons), and which server
process holds how much of which GPU (``nvidia-smi``, attributed to pods through ``/proc``).

The pure parts (parsing, attribution, the memory verdict) are unit-tested on CPU
(``tests/unit/test_gpu_cluster_checks.py``)."""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rewardplane.localcluster.binaries import missing_binaries

# vLLM's memory fraction covers what its worker allocates once its CUDA context exists (the
# start-up snapshot is taken after it, vllm/v1/worker/gpu_worker.py); the context itself (CUDA
# runtime, cuBLAS/NCCL handles: ~0.5 GiB on an H100) is on top, and the server's API process may
# hold a context of its own on the same GPU. This bounds that part, per server.
CONTEXT_ALLOWANCE_MIB = 2048


def cluster_skip_reason(
    missing: list[str], has_module: Callable[[str], bool] = lambda m: importlib.util.find_spec(m) is not None
) -> str | None:
    """Why the local cluster cannot run here (None: it can)."""
    if missing:
        return (
            f"the local cluster's binaries are missing ({', '.join(missing)}): carry the cluster "
            "bundle (bash scripts/gpu-cluster-bundle.sh; bash .whl/k8s1/install.sh there, docs/gpu.md)"
        )
    absent = [m for m in ("kopf", "kubernetes") if not has_module(m)]
    if absent:
        return (
            f"the operator's Python packages are missing ({', '.join(absent)}): install the cluster "
            "bundle's wheels (bash .whl/k8s1/install.sh prints the PYTHONPATH to use)"
        )
    return None


def skip_reason_here() -> str | None:
    return cluster_skip_reason(missing_binaries())


def parse_csv(text: str) -> list[list[str]]:
    """``nvidia-smi --format=csv,noheader,nounits`` rows."""
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    total_mib: int


def parse_gpus(text: str) -> dict[str, Gpu]:
    """uuid → Gpu, from ``--query-gpu=index,uuid,memory.total``."""
    return {row[1]: Gpu(int(row[0]), row[1], int(row[2])) for row in parse_csv(text)}


def attribute_usage(
    apps_csv: str, gpus: Mapping[str, Gpu], pod_of: Callable[[int], str | None]
) -> tuple[dict[str, dict[int, int]], list[str]]:
    """From ``--query-compute-apps=pid,gpu_uuid,used_memory``: pod → {GPU index: MiB} (a server's
    processes summed: the API process and vLLM's engine core), and the rows no pod claims."""
    usage: dict[str, dict[int, int]] = {}
    unclaimed = []
    for row in parse_csv(apps_csv):
        if len(row) < 3 or not row[0].isdigit() or row[1] not in gpus or not row[2].isdigit():
            unclaimed.append(",".join(row))  # "[N/A]" memory must not read as 0 MiB
            continue
        mib = int(row[2])
        pod = pod_of(int(row[0]))
        if pod is None:
            unclaimed.append(",".join(row))
            continue
        per_gpu = usage.setdefault(pod, {})
        index = gpus[row[1]].index
        per_gpu[index] = per_gpu.get(index, 0) + mib
    return usage, unclaimed


def memory_problems(
    usage: Mapping[str, Mapping[int, int]],
    expected: Mapping[str, tuple[int, float]],
    total_mib: Mapping[int, int],
    allowance_mib: int = CONTEXT_ALLOWANCE_MIB,
) -> list[str]:
    """Each expected pod on exactly its GPU, using at most fraction × the device's memory (plus the
    CUDA context allowance); nothing else of ours on that GPU. Returns the problems (empty: fine)."""
    problems = []
    for pod, (gpu, fraction) in sorted(expected.items()):
        got = usage.get(pod, {})
        if set(got) != {gpu}:
            problems.append(f"{pod}: expected on GPU {gpu} only, found on GPUs {sorted(got) or 'none'}")
            continue
        limit = fraction * total_mib[gpu] + allowance_mib
        if got[gpu] > limit:
            problems.append(
                f"{pod}: {got[gpu]} MiB on GPU {gpu}, over {fraction:g} × {total_mib[gpu]} MiB "
                f"+ {allowance_mib} MiB context = {limit:.0f} MiB"
            )
    strangers = sorted(set(usage) - set(expected))
    if strangers:
        problems.append(f"unexpected server processes on the GPUs: {strangers}")
    return problems


def device_problems(
    used_mib: Mapping[int, int],
    expected: Mapping[str, tuple[int, float]],
    total_mib: Mapping[int, int],
    allowance_mib: int = CONTEXT_ALLOWANCE_MIB,
) -> list[str]:
    """The coarse check where processes cannot be attributed (nvidia-smi in a container may report
    host pids): each GPU's total use within the sum of its servers' fractions (plus contexts)."""
    share: dict[int, list[float]] = {}
    for gpu, fraction in expected.values():
        share.setdefault(gpu, []).append(fraction)
    problems = []
    for gpu, fractions in sorted(share.items()):
        limit = sum(fractions) * total_mib[gpu] + len(fractions) * allowance_mib
        if used_mib.get(gpu, 0) > limit:
            problems.append(
                f"GPU {gpu}: {used_mib[gpu]} MiB used, over {' + '.join(f'{f:g}' for f in fractions)} × "
                f"{total_mib[gpu]} MiB + {len(fractions)} × {allowance_mib} MiB context = {limit:.0f} MiB"
            )
    return problems


# -- I/O ------------------------------------------------------------------------------------------
def nvidia_smi(*args: str) -> str:
    done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"nvidia-smi {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def proc_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def pod_of_pid(agent_id: str) -> Callable[[int], str | None]:
    """pid → the pod name the node agent ran it for (its processes carry the agent's marker and
    HOSTNAME=<pod>), or None."""
    from rewardplane.localcluster.nodeagent import MARKER_ENV

    def pod_of(pid: int) -> str | None:
        env = proc_env(pid)
        return env.get("HOSTNAME") if env.get(MARKER_ENV) == agent_id else None

    return pod_of


def pod_pids(agent_id: str) -> dict[str, list[int]]:
    """pod name → the pids the node agent started for it (children included)."""
    owner = pod_of_pid(agent_id)
    out: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pod = owner(int(entry.name))
            if pod is not None:
                out.setdefault(pod, []).append(int(entry.name))
    return out


def log_tails(paths: list[Path], lines: int = 40) -> str:
    parts = []
    for p in paths:
        try:
            text = p.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            text = [f"(unreadable: {exc})"]
        parts.append(f"--- {p} (last {lines} lines)\n" + "\n".join(text))
    return "\n".join(parts)
