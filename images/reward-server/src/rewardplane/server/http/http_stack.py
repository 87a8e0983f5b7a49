"""Which HTTP parser and event loop uvicorn serves with: httptools and uvloop where they import,
else h11 and asyncio.

Every byte of a request body passes through the parser on the event loop, so the parser sets how
long a 10 MB body holds up ``/health``: h11 is pure Python (~20 ms of parsing per 10 MB body on a
busy 2-core VM), httptools is C. The choice is explicit, and logged, rather than uvicorn's "auto",
so the log says which one a replica really runs; the pure-Python pair stays the fallback where
the C wheels are missing (an unusual platform, a hand-made environment).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class HTTPStack:
    http: str  # uvicorn's ``http``: "httptools" or "h11"
    loop: str  # uvicorn's ``loop``: "uvloop" or "asyncio"

    def describe(self) -> str:
        slow = [name for name, fast in (("httptools", self.http), ("uvloop", self.loop)) if name != fast]
        note = f" (pure Python: install {' and '.join(slow)} for the C ones)" if slow else ""
        return f"HTTP parser {self.http}, event loop {self.loop}{note}"


def _imports(module: str) -> bool:
    # An import, not find_spec: a wheel built for another platform is found but fails to load.
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def choose_http_stack() -> HTTPStack:
    return HTTPStack(
        http="httptools" if _imports("httptools") else "h11",
        loop="uvloop" if _imports("uvloop") else "asyncio",
    )
