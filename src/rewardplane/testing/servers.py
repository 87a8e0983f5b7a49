"""Real reward-server processes on loopback: start one, wait until it is healthy, stop it.

Used by the test suite, the benchmarks and the examples."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rewardplane.protocol import settings
from rewardplane.testing.processes import stop_process

# Ports handed out below Linux's ephemeral range (32768-60999 by default) and Kubernetes' NodePort
# range (30000-32767): a port the kernel picks for bind(0) may be given to any outgoing connection
# (HTTP clients, NCCL's sockets) before the caller binds it, which failed a GPU test with
# EADDRINUSE on the trainer's rendezvous port.
_PORTS = range(20000, 30000)
_handed_out: set[int] = set()
_rng = random.Random()  # not the global one, which tests may seed


def free_port() -> int:
    """A loopback port nobody listens on, not handed out before by this process."""
    for _ in range(200):
        port = _rng.choice(_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {_PORTS.start}-{_PORTS.stop - 1} after 200 tries")


def live_in_group(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies are not: they hold no memory,
    and where this process is a container's init nobody may reap them)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


@dataclass
class ServerHandle:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    token: str | None = None
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server and wait until every process it started is gone as well."""
        stop_process(self.process, sig=sig, grace_s=15, kill_wait_s=5)
        self.end_session()

    def end_session(self, grace_s: float = 10.0) -> None:
        """vLLM's engine core (and any helper) runs in the server's session and can outlive the
        server by a moment, still holding its GPU memory: a server started right after on the same
        GPU then found no room for its KV cache. Wait for them, then kill what is left."""
        pgid = self.process.pid
        deadline = time.monotonic() + grace_s
        while live_in_group(pgid):
            if time.monotonic() > deadline:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    return
                if time.monotonic() > deadline + 5:
                    return
            time.sleep(0.05)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def launch_server(
    model_dir: Path,
    log_dir: Path,
    *,
    token: str | None = None,
    env_extra: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    **opts: Any,
) -> ServerHandle:
    """Start a server process and return at once (see ``wait_healthy``); ``opts`` become flags."""
    port = int(opts.pop("port", 0)) or free_port()
    host = str(opts.pop("host", "127.0.0.1"))
    engine = str(opts.pop("engine", "hf"))
    args = [
        sys.executable,
        "-m",
        "rewardplane.server",
        "--model",
        str(model_dir),
        "--engine",
        engine,
        "--host",
        host,
        "--port",
        str(port),
    ]
    if engine == "hf":
        args += ["--device", str(opts.pop("device", "cpu"))]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    args += extra_args or []
    env = dict(os.environ)
    settings.TOKEN_FILE.export(None, env)
    settings.TOKEN.export(token, env)
    env.setdefault("OMP_NUM_THREADS", "1")  # several servers share 2 cores in CI
    env.update(env_extra or {})
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return ServerHandle(
        url=f"http://{host}:{port}", port=port, process=proc, log_path=log_path, token=token, args=args
    )


def wait_healthy(handle: ServerHandle, timeout_s: float = 120, poll_s: float = 0.2) -> ServerHandle:
    """Wait (bounded) until ``/health`` answers 200; raise with the log's tail if the process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            raise RuntimeError(
                f"server exited with {handle.process.returncode} during start:\n{handle.log()[-6000:]}"
            )
        try:
            if httpx.get(f"{handle.url}/health", timeout=2).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    handle.kill()
    raise RuntimeError(f"server did not become healthy in {timeout_s:.0f}s:\n{handle.log()[-6000:]}")


def start_server(
    model_dir: Path, log_dir: Path, *, startup_timeout_s: float = 120, **kwargs: Any
) -> ServerHandle:
    return wait_healthy(launch_server(model_dir, log_dir, **kwargs), startup_timeout_s)


def start_servers(
    model_dir: Path, log_dir: Path, *option_sets: dict[str, Any], startup_timeout_s: float = 120
) -> list[ServerHandle]:
    """One server per option set (``launch_server``'s keywords), started side by side: most of a
    start is importing torch and loading the model, which overlap. If one does not become healthy,
    every one is stopped and the error raised."""
    handles: list[ServerHandle] = []
    try:
        for opts in option_sets:
            handles.append(launch_server(model_dir, log_dir, **opts))
        return [wait_healthy(h, startup_timeout_s) for h in handles]
    except BaseException:
        for h in handles:
            h.stop()
        raise
