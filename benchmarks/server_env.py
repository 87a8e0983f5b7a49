"""What a benchmarked server process tree ran with, read from outside through Linux's ``/proc``: the
event loop and HTTP parser its API processes loaded, how many processes answer HTTP, each
process's role, start method, CPU affinity and the CPU it last ran on, the environment variables
that steer vLLM, torch and Python, and the versions of the packages on its request path as its
own interpreter resolves them.

The same code reads the reward server and ``vllm serve``, which the benchmark cannot change, so
nothing is asked of the process itself:

- event loop and parser: whether uvloop's and httptools' C extensions are mapped into an API
  process (``/proc/PID/maps``). uvicorn's ``auto`` (``vllm serve``) and the reward server's own
  choice both take httptools and uvloop whenever they import, so a mapped extension is the one
  serving; without it the process runs asyncio's loop and h11.
- API processes: those holding the server's listening socket (``/proc/PID/net/tcp`` against
  ``/proc/PID/fd``), so extra ``--api-server-count`` processes count.
- environment: ``/proc/PID/environ`` is what the process was started with (changes it made to its
  own environment afterwards do not show), so only the root process's is compared: that is what
  the benchmark gave it.
- versions: a one-line probe run with the root process's interpreter, environment and working
  folder, so it resolves the same ``sys.path``.

``describe`` returns a JSON-ready dict; ``env_diff.differences`` compares two of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

# Environment variables that change how an engine or a Python server runs (threads, kernels,
# allocators, the interpreter's own switches); everything else (paths of logs, OUT, ...) is left out.
ENV_PREFIXES = (
    "VLLM_",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "CUDA_",
    "NCCL_",
    "TORCH",
    "PYTORCH_",
    "TOKENIZERS_",
    "RAYON_",
    "MALLOC_",
    "PYTHON",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "UVICORN_",
    "HF_",
    "TRANSFORMERS_",
    "TRITON_",
    "REWARDPLANE_",
)
# The distributions on a scoring or chat request's path, in either server; the last four only
# vllm serve loads (its metrics middleware runs on every request, and vLLM 0.24 patches it for
# FastAPI 0.137 and later, so its cost follows both versions).
PACKAGES = (
    "vllm",
    "torch",
    "transformers",
    "tokenizers",
    "uvicorn",
    "uvloop",
    "httptools",
    "h11",
    "fastapi",
    "starlette",
    "pydantic",
    "pyzmq",
    "msgspec",
    "prometheus-client",
    "prometheus-fastapi-instrumentator",
    "model-hosting-container-standards",
    "watchfiles",
)
PROBE = (
    "import importlib.metadata as m, json, sys\n"
    "def v(d):\n"
    "    try:\n"
    "        return m.version(d)\n"
    "    except m.PackageNotFoundError:\n"
    "        return None\n"
    "print(json.dumps({d: v(d) for d in sys.argv[1:]}))"
)
PROBE_TIMEOUT_S = 60.0
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's state column


def cpu_list(cpus: set[int] | list[int]) -> str:
    """CPU ids as the kernel writes them: ``0-7,16,18-19``."""
    ids = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        runs.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(runs)


def parse_cpu_list(text: str) -> set[int]:
    """The inverse of ``cpu_list`` (the format of ``/sys/.../cpulist`` files)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _read(path: str) -> str:
    return Path(path).read_text(errors="replace")


def tree(root: int) -> list[int]:
    """``root`` and its descendants, parents first."""
    out: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return out


def _cmdline(pid: int) -> list[str]:
    return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]


def _stat(pid: int) -> tuple[str, list[str]]:
    """The process's name and the fields after it in ``/proc/PID/stat``."""
    stat = _read(f"/proc/{pid}/stat")
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()


def listening_inodes(pid: int, port: int) -> set[str]:
    """Inodes of the sockets listening on ``port`` in ``pid``'s network namespace."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = _read(f"/proc/{pid}/net/{table}").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def holds_any(pid: int, inodes: set[str]) -> bool:
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def mapped(pid: int, *packages: str) -> set[str]:
    """Which of ``packages`` have a file of theirs mapped into ``pid`` (their C extensions)."""
    try:
        maps = _read(f"/proc/{pid}/maps")
    except OSError:
        return set()
    return {p for p in packages if f"/{p}/" in maps}


def environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.partition("=")[::2] for item in raw.split("\0") if "=" in item)


def relevant_env(pid: int) -> dict[str, str]:
    return {k: v for k, v in environ(pid).items() if k.startswith(ENV_PREFIXES)}


def versions(pid: int) -> dict[str, str | None]:
    """``PACKAGES``' versions as ``pid``'s own interpreter, environment and folder resolve them."""
    # argv[0], not /proc/PID/exe: a virtual environment's python is a link to the base interpreter,
    # and only started through the link does it see the environment's packages
    first = _cmdline(pid)[0]
    exe = first if os.path.isabs(first) and os.path.exists(first) else os.readlink(f"/proc/{pid}/exe")
    out = subprocess.run(
        [exe, "-c", PROBE, *PACKAGES],
        env=environ(pid),
        cwd=os.readlink(f"/proc/{pid}/cwd"),
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        check=True,
    )
    found: dict[str, str | None] = json.loads(out.stdout)
    return found


def core_of(cpu: int) -> str:
    """The physical core a CPU id belongs to (its hyperthread siblings share one), as
    ``package:core``; the CPU itself where the topology is not exposed."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        return f"{_read(base + '/physical_package_id').strip()}:{_read(base + '/core_id').strip()}"
    except OSError:
        return f"cpu{cpu}"


def role(name: str, cmd: list[str], listens: bool) -> str:
    """What a process of a server's tree does. ``listens``: it holds the listening socket (a forked
    engine core inherits it too, hence the names first; ``assign_api`` then tells the serving
    holders from a supervisor that only hands the socket on)."""
    if name.startswith("VLLM::EngineCor"):  # vLLM's title, cut to the kernel's 15 characters
        return "engine"
    if name.startswith("VLLM::Worker"):
        return "worker"
    if any("resource_tracker" in a for a in cmd):
        return "resource-tracker"
    return "listener" if listens else "other"


def assign_api(processes: list[dict[str, Any]]) -> None:
    """Among the processes holding the listening socket, those with no holder below them answer
    HTTP (``api``); a holder above others is a supervisor (uvicorn's ``--workers``, ``vllm serve
    --api-server-count N``)."""
    holders = {p["pid"]: p for p in processes if p["role"] == "listener"}
    above = {p["ppid"] for p in holders.values()}
    for pid, p in holders.items():
        p["role"] = "supervisor" if pid in above else "api"


def start_method(cmd: list[str], parent_cmd: list[str] | None) -> str:
    """``exec`` for a process started as a program, ``spawn`` for multiprocessing's spawn (a fresh
    interpreter that imports everything again), ``fork`` for a copy of its parent."""
    if any("spawn_main" in a or a == "--multiprocessing-fork" for a in cmd):
        return "spawn"
    if parent_cmd is not None and cmd == parent_cmd:
        return "fork"
    return "exec"


def process_facts(pid: int, cmds: dict[int, list[str]], inodes: set[str]) -> dict[str, Any]:
    """One process's facts; ``cmds``: the command lines of the processes read so far (its parent's
    among them), to which its own is added."""
    name, fields = _stat(pid)
    cmd = cmds[pid] = _cmdline(pid)
    parent_cmd = cmds.get(int(fields[1]))
    threads = int(
        next(
            line.split()[1]
            for line in _read(f"/proc/{pid}/status").splitlines()
            if line.startswith("Threads:")
        )
    )
    last = int(fields[36])  # "processor": the CPU it last ran on (field 39 of stat)
    return {
        "pid": pid,
        "name": name,
        "ppid": int(fields[1]),
        "role": role(name, cmd, bool(inodes) and holds_any(pid, inodes)),
        "start": start_method(cmd, parent_cmd),
        "threads": threads,
        "cpus": cpu_list(os.sched_getaffinity(pid)),
        "last_cpu": last,
        "last_core": core_of(last),
    }


def shared_cores(processes: list[dict[str, Any]]) -> list[str]:
    """Pairs of the API and engine processes that last ran on one physical core (two hyperthreads
    of a core, or the same CPU): each slows the other."""
    busy = [p for p in processes if p["role"] in ("api", "engine", "worker")]
    return [
        f"{a['role']} {a['pid']} and {b['role']} {b['pid']} on core {a['last_core']}"
        for i, a in enumerate(busy)
        for b in busy[i + 1 :]
        if a["last_core"] == b["last_core"]
    ]


def describe(root: int, port: int | None) -> dict[str, Any]:
    """What the process tree under ``root`` runs with (``port``: where it serves HTTP; None for a
    process that serves none, such as vLLM offline). Never raises: what could not be read is named
    under ``error``, and ``env_diff`` refuses to compare it."""
    try:
        inodes = listening_inodes(root, port) if port is not None else set()
        procs: list[dict[str, Any]] = []
        cmds: dict[int, list[str]] = {}
        for pid in tree(root):  # parents first: each one's command line is known to its children
            try:
                procs.append(process_facts(pid, cmds, inodes))
            except (OSError, StopIteration, ValueError, IndexError):
                continue  # a process that ended meanwhile
        assign_api(procs)
        api = [p for p in procs if p["role"] == "api"]
        out: dict[str, Any] = {"processes": procs, "api_processes": len(api) if port is not None else None}
        if port is not None:
            loaded = [mapped(p["pid"], "uvloop", "httptools") for p in api]
            out["event_loop"] = (
                "+".join(sorted({"uvloop" if "uvloop" in m else "asyncio" for m in loaded})) or None
            )
            out["http_parser"] = (
                "+".join(sorted({"httptools" if "httptools" in m else "h11" for m in loaded})) or None
            )
        out["engine_processes"] = sum(p["role"] == "engine" for p in procs)
        out["cpus"] = {
            r: cpu_list(set().union(*(parse_cpu_list(p["cpus"]) for p in procs if p["role"] == r)))
            for r in ("api", "engine", "worker")
            if any(p["role"] == r for p in procs)
        }
        out["same_core"] = shared_cores(procs)
        out["env"] = relevant_env(root)
        out["versions"] = versions(root)
        return out
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def host() -> dict[str, Any]:
    """The machine: CPU model, logical CPUs, the cores and NUMA nodes behind them, this process's
    CPU affinity, and the load at the start (another job on the host shows there)."""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        None,
    )
    allowed = os.sched_getaffinity(0)
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    return {
        "cpu_model": model,
        "logical_cpus": os.cpu_count(),
        "physical_cores_allowed": len({core_of(c) for c in allowed}),
        "cpus_allowed": cpu_list(allowed),
        "numa_nodes": {n: _read(f"/sys/devices/system/node/{n}/cpulist").strip() for n in nodes},
        "load_average": list(os.getloadavg()),
    }


def same_core_shares(samples: list[dict[str, str]]) -> dict[str, float]:
    """For each pair of processes, the share of ``samples`` (each: process label -> the physical core
    its main thread was on) in which both were on one core; pairs never seen together are left out."""
    together: dict[str, int] = {}
    seen: dict[str, int] = {}
    for sample in samples:
        labels = sorted(sample)
        for i, a in enumerate(labels):
            for b in labels[i + 1 :]:
                pair = f"{a} + {b}"
                seen[pair] = seen.get(pair, 0) + 1
                together[pair] = together.get(pair, 0) + (sample[a] == sample[b])
    return {pair: round(together[pair] / n, 3) for pair, n in seen.items()}


class CoreSharing:
    """While a round runs, the physical core of the main thread of each process under ``root`` and of
    this process (the benchmark's client), sampled every ``interval_s`` from ``/proc``; ``shares()``:
    for each pair, the share of samples on one core. Two busy threads on the hyperthreads of one
    core run slower each; where the scheduler puts them is fixed for neither server."""

    CLIENT = "client (this process)"

    def __init__(self, root: int, interval_s: float = 0.05) -> None:
        self.root, self.interval_s = root, interval_s
        self.samples: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="core-sharing", daemon=True)

    def _sample(self, pids: list[int]) -> dict[str, str]:
        out: dict[str, str] = {}
        for pid in pids:
            try:
                name, fields = _stat(pid)
            except (OSError, ValueError):
                continue  # ended meanwhile
            label = self.CLIENT if pid == os.getpid() else f"{pid}:{name}"
            out[label] = core_of(int(fields[36]))
        return out

    def _run(self) -> None:
        pids = [*tree(self.root), os.getpid()]
        while not self._stop.wait(self.interval_s):
            self.samples.append(self._sample(pids))

    def __enter__(self) -> CoreSharing:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def shares(self) -> dict[str, float]:
        return same_core_shares(self.samples)
