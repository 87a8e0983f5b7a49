"""The control plane's side of pushes started from the data plane (docs/weight-sync.md).

After a replica joins a trainer's group, a thread waits on the group's store for the trainer's
``PushHeader``. For each it asks the service (on the event loop, where the weights lock lives) to
admit the push — validate, take the lock — tells this replica's workers to receive or refuse
(``PushGo``), collects their ``PushLoaded`` reports, lets the service commit, and writes the
``PushVerdict`` the workers then reduce with the trainer. No HTTP request, no engine RPC on the path.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from rewardplane.protocol import STOP_LISTENING, PushGo, PushHeader, PushKeys, PushLoaded, PushVerdict
from rewardplane.server.weight_sync.push_channel import COMING, SPIN_S, ChannelClosed, ChannelHub
from rewardplane.transport.signals import StoreClosed, group_store, put, wait_value

log = logging.getLogger(__name__)

# A streamed push sends the engine's cache invalidation (vLLM: the cache salt's epoch advances, an
# attribute write, ``prefix_cache``) once this replica's workers were told to receive, off their
# critical path; commit waits for it.

T = TypeVar("T")
STOP_TIMEOUT_S = 5.0


class PushHost(Protocol):
    """The control plane's side (``control_data_plane.DataPlanePushes``), run on the event loop."""

    async def admit_data_push(self, header: PushHeader, arrived: float) -> Any:
        """A ``control_state.DataPush``: ``error`` (refused, with ``code``) or admitted, ``apply``."""
        ...

    def start_cache_reset(self, push: Any) -> None:
        """Send the engine's cache reset of an admitted streamed push (once)."""
        ...

    async def finish_data_push(
        self, push: Any, results: list[PushLoaded], tell: Callable[[PushVerdict], None]
    ) -> PushVerdict:
        """Commit or not; ``tell`` the workers the verdict (unless the ready reduction refused)."""
        ...

    async def push_outcomes(self, seq: int, timeout_s: float) -> list[PushLoaded]: ...


class PushListener:
    """One replica's wait for the trainer's pushes in one group (a daemon thread)."""

    def __init__(
        self,
        host: PushHost,
        loop: asyncio.AbstractEventLoop,
        group: tuple[str, int, str, float],
        replica: int,
        ranks: list[int],
        channel: ChannelHub,
    ) -> None:
        self.host, self.loop, self.group = host, loop, group
        self.replica, self.ranks, self.channel = replica, ranks, channel
        self.seq = 0
        self._stop = threading.Event()
        address, port, group_id, timeout_s = group
        self.store = group_store(address, port, group_id, timeout_s)
        self._thread = threading.Thread(target=self._run, name=f"rp-push-watch-{group_id}", daemon=True)

    def start(self) -> None:
        # the trainer checks this key before using the data plane. Written before the thread
        # starts: a store client serves one call at a time, and the thread's wait holds it
        put(self.store, PushKeys.listening(self.replica), "1")
        self._thread.start()

    def stop(self) -> None:
        """Ends this thread (blocked on the header's key: a stop is written there by a fresh
        client, in the background; a store that is gone ended the wait already) and, once it has
        finished any push in flight, the workers' listeners (it closes the channel)."""
        if self._stop.is_set():
            return
        self._stop.set()
        seq, (address, port, group_id, _) = self.seq, self.group

        def write_stop() -> None:
            try:
                store = group_store(address, port, group_id, STOP_TIMEOUT_S)
                # only where nothing was written yet: never over a push in flight
                store.compare_set(PushKeys.header(seq), "", STOP_LISTENING)
            except Exception as exc:  # the trainer's store is gone: the wait ended with it
                log.debug("could not write the stop for group %s: %s", group_id, exc)

        threading.Thread(target=write_stop, name="rp-push-stop", daemon=True).start()
        if not self._thread.is_alive():  # never started, or ended: nothing else closes the channel
            self.channel.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                raw = wait_value(self.store, PushKeys.header(self.seq), None, self._stop)
                if raw is None or raw == STOP_LISTENING.encode() or self._stop.is_set():
                    return
                self._serve(raw, time.monotonic())
                self.seq += 1
        except StoreClosed as exc:
            log.info("stopped waiting for pushes in group %s: %s", self.group[2], exc)
        except Exception:
            log.exception("waiting for pushes failed; pushes go over HTTP until the group is formed again")
        finally:
            self.channel.close()  # the workers' listeners end

    def _serve(self, raw: bytes, arrived: float) -> None:
        seq, replica = self.seq, self.replica
        self._tell_workers(COMING, best_effort=True)  # they wake while the push is admitted
        try:
            header = PushHeader.model_validate_json(raw)
            if header.seq != seq:
                raise ValueError(f"header for push {header.seq} under push {seq}'s key")
        except ValueError as exc:  # a trainer that speaks another protocol: refuse, clearly
            error = f"bad push header: {exc}"
            put(
                self.store,
                PushKeys.verdict(seq, replica),
                PushVerdict(committed=False, code="refused", error=error),
            )
            self._tell_workers(PushGo(seq=seq, error=error))  # they refuse in the ready reduction
            return
        wait_s = header.timeout_s + 60.0
        push = self._call(self.host.admit_data_push(header, arrived), wait_s)
        if push.error is not None:  # the reason first: the trainer reads it once the reduction says no
            verdict = PushVerdict(committed=False, code=push.code, error=push.error)
            put(self.store, PushKeys.verdict(seq, replica), verdict)
        go = PushGo(
            seq=seq,
            layout_id=header.layout_id,
            bucket_bytes=header.bucket_bytes,
            apply=push.apply,
            error=push.error,
            sliced=header.sliced,
        )
        try:
            push.stamps["go"] = time.monotonic()  # the control plane's part ends: the workers' starts
            self._tell_workers(go)
            if push.error is None:
                self.loop.call_soon_threadsafe(self.host.start_cache_reset, push)
            results = [PushLoaded.model_validate_json(self._next_report(r, wait_s)) for r in self.ranks]
            push.stamps["reported"] = time.monotonic()  # every worker's report is in (this thread)
        except (ChannelClosed, TimeoutError) as exc:  # a worker is gone or stuck: ask them over the engine
            log.warning("push %d: %s; asking the workers what they loaded", seq, exc)
            results = self._call(self.host.push_outcomes(seq, wait_s), wait_s + 10.0)
        # the workers hear the verdict from the event loop, the moment it is known (no hop back here)
        tell = functools.partial(self._tell_workers, best_effort=True)
        verdict = self._call(self.host.finish_data_push(push, results, tell), wait_s)
        if push.error is None:
            put(self.store, PushKeys.verdict(seq, replica), verdict)  # the trainer reads it on a failure

    def _tell_workers(self, message: PushGo | PushVerdict | bytes, best_effort: bool = False) -> None:
        """Every worker of this replica. ``best_effort``: past a worker that left the channel (its
        transfer failed) to the others."""
        raw = message if isinstance(message, bytes) else message.model_dump_json().encode()
        for rank in self.ranks:
            try:
                self.channel.send(rank, raw)
            except ChannelClosed as exc:
                if not best_effort:
                    raise
                log.warning("push %d: rank %d left the push channel: %s", self.seq, rank, exc)

    def _next_report(self, rank: int, timeout_s: float) -> bytes:
        """The worker's next report: what it loaded (or staged)."""
        return self.channel.recv(rank, timeout_s, spin_s=SPIN_S)  # a head-only push reports within it
