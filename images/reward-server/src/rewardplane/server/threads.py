"""Where blocking work runs, so that none of it can hold up another kind.

- Model forwards: each engine's own executor (the transformers engine: one thread).
- Tokenization: ``tokenizer_pool()``, a small pool of its own; Hugging Face's fast tokenizers
  release the GIL, so a large input tokenizes while the event loop answers ``/health``.
- Control-plane waits (joining a trainer's group, receiving a push): ``run_in_daemon_thread``, a
  thread per call. A rendezvous that waits out its timeout then holds no thread that scoring
  needs, and, being a daemon, it cannot keep a stopping server alive (a worker of Python's
  ``ThreadPoolExecutor`` is joined at interpreter exit, which once kept a SIGTERMed server up for
  minutes).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


async def run_in_daemon_thread(fn: Callable[..., T], *args: Any, name: str) -> T:
    """``fn(*args)`` on a new daemon thread; the awaiting task gets its result or exception.

    Cancelling the awaiting task does not stop ``fn`` (nothing can interrupt a blocked C call);
    its outcome is then dropped."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():
            setter(value)

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            outcome: tuple[Callable[[Any], None], Any] = (future.set_exception, exc)
        else:
            outcome = (future.set_result, result)
        try:
            loop.call_soon_threadsafe(deliver, *outcome)
        except RuntimeError:  # the loop closed while fn ran (the server is stopping)
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future


def tokenizer_pool() -> ThreadPoolExecutor:
    # Two threads: one large input does not queue every small one behind it.
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="rp-tokenize")
