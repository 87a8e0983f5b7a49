"""The control plane's side of pushes started from the data plane: listening on the group's store
after a join, admitting a header (same checks as an announce), and committing what the workers
received (``data_push.PushListener`` calls these)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from rewardplane.protocol import (
    STALE_BASE,
    InitCommunicatorRequest,
    PushHeader,
    PushLoaded,
    PushVerdict,
)
from rewardplane.server.threads import run_in_daemon_thread
from rewardplane.server.weight_sync.control_state import ControlPlaneState, DataPush, merge, task_error
from rewardplane.server.weight_sync.data_push import PushListener
from rewardplane.server.weight_sync.push_channel import ChannelHub
from rewardplane.server.weight_sync.worker_calls import WorkerReceived

log = logging.getLogger(__name__)
# How long a replica's workers have to join the push channel after a group is formed (seconds).
CHANNEL_CONNECT_TIMEOUT_S = 30.0


class DataPlanePushes:
    """Pushes whose header arrives in the group's store (``data_push.PushListener`` calls these)."""

    def __init__(self, state: ControlPlaneState) -> None:
        self.state = state

    async def listen(self, req: InitCommunicatorRequest, group_id: str) -> None:
        """After a join: wait for the trainer's push headers on the group's store. Where the workers
        cannot listen, or the store cannot be reached, pushes keep going over HTTP only."""
        channel = ChannelHub()
        try:
            listening = await self.state.calls.listen(channel.address, channel.authkey)
            if not listening or not all(listening):
                channel.close()
                return
            ranks = [req.rank_offset + i for i in range(len(listening))]
            # Daemon threads, not asyncio's executor (joined at exit): the trainer's store may
            # accept and never answer (a trainer stopped in a debugger), and a stopping server must
            # not wait out the store's timeout for it.
            await run_in_daemon_thread(
                channel.accept, ranks, CHANNEL_CONNECT_TIMEOUT_S, name="rp-channel-accept"
            )
            group = (req.host, req.port, group_id, req.timeout_s)
            loop = asyncio.get_running_loop()
            listener = await run_in_daemon_thread(
                PushListener, self, loop, group, req.rank_offset, ranks, channel, name="rp-push-store"
            )
            await run_in_daemon_thread(listener.start, name="rp-push-listen")
            self.state.listener = listener
        except Exception as exc:
            channel.close()  # the workers' listeners end: pushes go over HTTP
            log.warning("pushes from this group go over HTTP only: listening for them failed (%s)", exc)

    def stop_listening(self) -> None:
        listener, self.state.listener = self.state.listener, None
        if listener is not None:
            listener.stop()

    async def admit_data_push(self, header: PushHeader, arrived: float) -> DataPush:
        """Validate a push header like an announce (same checks, same messages), then take the
        exclusive lock (streamed) and send the cache reset; or refuse it, moving nothing."""
        push = DataPush(header, arrived)
        guard = self.state.guard
        await self.state.let_committed_update_finish(header.timeout_s)
        layout = self.state.layouts.get(header.layout_id)
        if (
            layout is None
            or layout.bucket_bytes != header.bucket_bytes
            or layout.id not in self.state.worker_layouts
        ):
            push.error, push.code = (
                f"layout {header.layout_id} is not known to this replica's workers (restarted, or forgotten); "
                "announce it over HTTP — the SDK does so by itself",
                "unknown_layout",
            )
        elif header.version <= guard.version and guard.state != "broken":
            push.error = f"version {header.version} is not newer than the served version {guard.version}; versions must increase"
        elif (refusal := self.state.delta_refusal(header.base_version)) is not None:
            push.error, push.code = refusal, STALE_BASE
        elif self.state.busy():
            push.error = "another weight update is in progress; wait for it to finish"
        elif (refusal := guard.write_refusal()) is not None:  # as the HTTP path's lock would answer (409)
            push.error = refusal
        elif not self.state.has_comm:
            push.error = "no communicator: the group failed; form it again (/init_communicator)"
        if push.error is not None or layout is None:  # an unknown layout was refused above
            push.code = push.code if push.code in ("unknown_layout", STALE_BASE) else "refused"
            return push
        push.layout = layout
        self.state.layouts.move_to_end(layout.id)
        self.state.data_push = push
        push.stamps["task"] = time.monotonic()
        if header.atomic:
            return push  # staged while the old weights serve; the lock only for the swap
        lock = guard.updating(timeout_s=header.timeout_s)
        try:
            await lock.__aenter__()
        except TimeoutError:
            self.state.data_push = None
            push.error = f"scoring in flight did not finish within timeout_s={header.timeout_s:g}s; retry"
            push.code = "refused"
            return push
        push.lock = lock
        push.stamps["locked"] = time.monotonic()
        return push

    def start_cache_reset(self, push: DataPush) -> None:
        """Nothing is scored while the lock is held: cached blocks of the old weights are dropped
        while the bytes arrive (as in the HTTP path). Sent once the workers were told to receive
        (``PushListener``), off their critical path. Once per push."""
        if push.lock is not None and push.reset is None:
            push.stamps["reset"] = time.monotonic()
            push.reset = asyncio.ensure_future(self.state.port.reset_cache())

    async def finish_data_push(
        self, push: DataPush, results: list[PushLoaded], tell: Callable[[PushVerdict], None]
    ) -> PushVerdict:
        """The workers' reports in: commit (atomic: swap under the lock first), or mark broken
        where weights were partly overwritten; release the lock. The verdict goes to the workers
        through ``tell`` (they confirm it to the trainer in the commit reduction) unless the ready
        reduction refused the push (then no worker waits for one): a commit is told as soon as the
        lock is released, before its bookkeeping, since the trainer waits for it."""
        header, guard = push.header, self.state.guard
        if push.error is not None:  # refused at admission: nothing was held
            return PushVerdict(committed=False, code="refused", error=push.error)
        version, layout = header.version, push.layout
        assert layout is not None
        merged = merge([WorkerReceived.reported(r) for r in results])
        merged["sliced"] = header.sliced
        push.stamps.update(merged.pop("times"))
        push.stamps["returned"] = time.monotonic()
        refused = any(r.refused for r in results)
        committed = False
        try:
            if refused:
                merged["error"] = merged["error"] or "another replica refused the push"
            elif header.atomic and merged["ok"]:
                async with guard.updating(timeout_s=header.timeout_s):
                    push.stamps["locked"] = time.monotonic()
                    await self.state.calls.apply_staged(layout.metadata)
                    await self.state.drop_adapter_under(header.training_mode)
                    await self.state.port.reset_cache()
                    guard.commit(version)
                    committed = True
            elif header.atomic:
                await self.state.calls.drop_staged()
            else:
                self.start_cache_reset(push)  # where the go never went out
                assert push.reset is not None
                reset_error = await task_error(push.reset)
                if merged["ok"] and reset_error is None:
                    # a full or merged push replaces what a served adapter adapted (HTTP path alike)
                    await self.state.drop_adapter_under(header.training_mode)
                    guard.commit(version)
                    committed = True
                elif merged["ok"] or merged["partial"]:
                    reason = merged["error"] or f"the prefix cache was not reset: {reset_error}"
                    guard.mark_broken(f"update to version {version} failed part-way: {reason}")
        except Exception as exc:
            merged["error"] = f"{type(exc).__name__}: {exc}"
            if guard.state == "updating":
                guard.mark_broken(f"update to version {version} failed: {exc}")
        finally:
            if push.lock is not None:
                await push.lock.__aexit__(None, None, None)
            self.state.data_push = None
            guard.signal_change()
        if committed:
            push.stamps["committed"] = time.monotonic()
            tell(PushVerdict(committed=True))
        merged["ok"] = committed
        stamps = push.stamps  # for the log line: waited for the lock, then received (streamed)
        if not header.atomic and "locked" in stamps:
            merged["lock_s"] = stamps["locked"] - stamps["task"]
            merged["receive_s"] = stamps["returned"] - stamps["locked"]
        if refused:  # nothing moved: not a failure of this replica
            log.info("push of version %d refused: %s", version, merged["error"])
            return PushVerdict(committed=False, code="refused", error=merged["error"])
        self.state.record(
            version,
            header.training_mode.value,
            merged,
            dict(push.stamps),
            push.arrived,
            push.arrived,
            "data_plane",
        )
        if not committed:
            self.state.has_comm = False  # the workers leave the group after the commit reduction
            verdict = PushVerdict(committed=False, code="failed", error=merged["error"])
            tell(verdict)
            return verdict
        if self.state.store is not None:
            self.state.spawn(self.state.persist(version), f"persist-start-v{version}")
        return PushVerdict(committed=True)

    async def push_outcomes(self, seq: int, timeout_s: float) -> list[PushLoaded]:
        """The workers' reports of push ``seq`` asked over the engine (the store is gone)."""
        return await self.state.calls.push_outcomes(seq, timeout_s)
