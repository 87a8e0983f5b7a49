"""Whether two measured processes ran in environments alike enough for a ratio of their figures to
compare the software rather than the setup (``server_env.describe``'s records).

A ratio between two servers is refused, naming each difference, when they differ in: the event
loop or HTTP parser (uvloop against asyncio, httptools against h11: a front end's cost per
request), the number of processes answering HTTP, the version of any package on the request path,
the CPUs each role (API, engine core, worker) may run on, or an environment variable that steers
vLLM, torch, the allocator or the interpreter. Not compared, since they differ between two
servers by design, not by setup: thread counts, start methods (``vllm serve`` spawns its engine
core, a library user's forks by default), process ids, where the scheduler placed them (recorded
for the reader: ``same_core``) and the benchmark's own per-phase switches (``REWARDPLANE_*``).
What one record lacks (vLLM offline serves no HTTP, so it has no event loop) is not compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

IGNORED_ENV_PREFIXES = ("REWARDPLANE_",)


def _shown(value: object) -> str:
    return "absent" if value is None else repr(value) if isinstance(value, str) else str(value)


def _changed(what: str, a: object, b: object, names: tuple[str, str]) -> str:
    return f"{what}: {_shown(a)} ({names[0]}) vs {_shown(b)} ({names[1]})"


def _unreadable(env: Mapping[str, Any] | None, name: str) -> str | None:
    if not env:
        return f"the environment of {name} was not recorded: a ratio against it cannot be checked"
    if "error" in env:
        return f"the environment of {name} could not be read ({env['error']})"
    return None


def differences(
    a: Mapping[str, Any] | None, b: Mapping[str, Any] | None, names: tuple[str, str] = ("a", "b")
) -> list[str]:
    """Each difference between environments ``a`` and ``b`` that makes a ratio of their figures
    untrustworthy, in words (empty: comparable). ``names`` label the two in the messages."""
    unread = [why for env, name in ((a, names[0]), (b, names[1])) if (why := _unreadable(env, name))]
    if unread or a is None or b is None:
        return unread
    out: list[str] = []
    for key, what in (
        ("event_loop", "event loop"),
        ("http_parser", "HTTP parser"),
        ("api_processes", "processes answering HTTP"),
    ):
        x, y = a.get(key), b.get(key)
        if x is not None and y is not None and x != y:
            out.append(_changed(what, x, y, names))
    va, vb = a.get("versions") or {}, b.get("versions") or {}
    for package in sorted(set(va) | set(vb)):
        if va.get(package) != vb.get(package):
            out.append(_changed(f"{package} version", va.get(package), vb.get(package), names))
    ca, cb = a.get("cpus") or {}, b.get("cpus") or {}
    for proc_role in sorted(set(ca) & set(cb)):
        if ca[proc_role] != cb[proc_role]:
            out.append(
                _changed(f"CPUs the {proc_role} process may run on", ca[proc_role], cb[proc_role], names)
            )
    ea, eb = a.get("env") or {}, b.get("env") or {}
    for key in sorted(set(ea) | set(eb)):
        if not key.startswith(IGNORED_ENV_PREFIXES) and ea.get(key) != eb.get(key):
            out.append(_changed(f"${key}", ea.get(key), eb.get(key), names))
    return out
