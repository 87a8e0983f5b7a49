"""``async with handle.awake():`` — the reward phase of a colocated trainer.

The reward servers sleep between reward phases so the actor can use their GPU memory (seed 003
§3.3). On enter every replica is woken; on exit (also when the body raised) every replica that
was woken goes back to sleep at ``level``. A push needs the servers awake (a push to a sleeping
server is refused with 409), so push inside the block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import TracebackType

from rewardplane.protocol import DEFAULT_SLEEP_TIMEOUT_S, SleepResponse

from ._client_base import sleep_body
from .async_client import AsyncRewardClient
from .client import RewardClient

log = logging.getLogger(__name__)

HTTP_SLACK_S = 30.0  # the HTTP timeout exceeds the server's own bound on the transition


class AwakeReplicas:
    """Wake a set of reward servers for the length of a ``with`` / ``async with`` block.

    Args:
        urls: called on enter for the servers' base URLs (the cluster handle reads its replicas).
        token: the control-plane token.
        level: the sleep level they return to on exit (1: weights kept in host memory; 2: discarded).
        timeout_s: bound on each server's sleep or wake (including the wait for scoring in flight).
        reload: after a level-2 sleep, rebuild the served weights on wake (from the checkpoint and
            saved pushes). False for a colocated trainer that pushes its full weights first thing in
            the block: nothing is read from disk, and scoring waits for that push (503 until then).

    ``woken`` holds each server's answer to the wake (state, seconds, weights) once entered.
    """

    def __init__(
        self,
        urls: Callable[[], Sequence[str]],
        token: Callable[[], str | None],
        *,
        level: int = 1,
        timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S,
        reload: bool = True,
    ) -> None:
        sleep_body(level, timeout_s)  # a bad level fails here, before anything moves
        self._urls, self._token = urls, token
        self.level, self.timeout_s, self.reload = level, timeout_s, reload
        self.woken: dict[str, SleepResponse] = {}

    def _endpoints(self) -> list[str]:
        urls = list(self._urls())
        if not urls:
            raise ValueError("no reward server to wake: the model lists no replica with a URL")
        return urls

    def _options(self) -> dict[str, object]:
        return {"token": self._token(), "request_timeout_s": self.timeout_s + HTTP_SLACK_S}

    # ---- async --------------------------------------------------------------------------------
    async def __aenter__(self) -> AwakeReplicas:
        self._aclient = AsyncRewardClient(self._endpoints(), **self._options())
        try:
            self.woken = await self._aclient.wake(timeout_s=self.timeout_s, reload=self.reload)
        except BaseException:
            await self._asleep_after_error()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            await self._asleep_after_error()
            return
        try:
            await self._aclient.sleep(self.level, timeout_s=self.timeout_s)
        finally:
            await self._aclient.aclose()

    async def _asleep_after_error(self) -> None:
        """Back to sleep while an error is on its way: a failure here is logged, never raised over it."""
        try:
            await self._aclient.sleep(self.level, timeout_s=self.timeout_s)
        except Exception:
            log.warning("putting the reward servers back to sleep failed", exc_info=True)
        finally:
            await self._aclient.aclose()

    # ---- blocking -------------------------------------------------------------------------------
    def __enter__(self) -> AwakeReplicas:
        self._client = RewardClient(self._endpoints(), **self._options())
        try:
            self.woken = self._client.wake(timeout_s=self.timeout_s, reload=self.reload)
        except BaseException:
            self._sleep_after_error()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._sleep_after_error()
            return
        try:
            self._client.sleep(self.level, timeout_s=self.timeout_s)
        finally:
            self._client.close()

    def _sleep_after_error(self) -> None:
        try:
            self._client.sleep(self.level, timeout_s=self.timeout_s)
        except Exception:
            log.warning("putting the reward servers back to sleep failed", exc_info=True)
        finally:
            self._client.close()
