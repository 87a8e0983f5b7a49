"""What the chaos steps of the real-node suite use: a trainer's scoring loop through the SDK that
counts every error, and a trainer held at one step of its push (so that the operator can be
deleted while the push's WeightSync is in a given phase)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

TEXT_TOLERANCE = 2e-3


@dataclass
class SdkScoring:
    """Scores ``texts`` through ``RewardModelHandle.client()`` in a loop while a block runs, as a
    trainer's reward step does (each call takes the ready replicas from the model's status), and
    samples the RewardModel's status beside it. Every exception is a client error; every answer is
    compared with ``expected``."""

    handle: Any  # rewardplane.sdk.cluster.RewardModelHandle
    texts: list[str]
    expected: list[float]
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    statuses: list[tuple[float, str, int, int]] = field(default_factory=list)  # (t, phase, ready, version)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _score(self) -> None:
        while not self._stop.is_set():
            try:
                got = self.handle.client().score_batch(self.texts, normalize=False)
            except Exception as exc:
                self.errors.append(f"{time.strftime('%H:%M:%S')} {exc!r}")
            else:
                worst = max(abs(a - b) for a, b in zip(got, self.expected, strict=True))
                if worst > TEXT_TOLERANCE:
                    self.wrong.append(f"scores off by {worst:.2e}: {got}")
            self.requests += 1
            self._stop.wait(0.02)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                st = self.handle.get().get("status") or {}
            except Exception:  # the API server is not what these steps disturb; a miss is no finding
                st = None
            if st is not None:
                self.statuses.append(
                    (
                        time.monotonic(),
                        str(st.get("phase")),
                        int(st.get("readyReplicas") or 0),
                        int(st.get("weightsVersion") or 0),
                    )
                )
            self._stop.wait(0.2)

    def __enter__(self) -> SdkScoring:
        for target in (self._score, self._sample):
            thread = threading.Thread(target=target, name=f"sdk-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def wait_requests(self, more: int, timeout_s: float = 60) -> None:
        """Until ``more`` further requests were made (so a fault lands on a loop that runs)."""
        target = self.requests + more
        deadline = time.monotonic() + timeout_s
        while self.requests < target:
            if time.monotonic() > deadline:
                pytest.fail(f"the SDK loop made {self.requests} requests, not {target}, in {timeout_s:.0f} s")
            time.sleep(0.05)

    def unready_s(self, replicas: int) -> float:
        """How long the sampled status showed fewer than ``replicas`` ready (to 0.2 s)."""
        total, prev = 0.0, None
        for t, _, ready, _ in self.statuses:
            if prev is not None and prev[1] < replicas:
                total += t - prev[0]
            prev = (t, ready)
        return total

    def check(self, min_requests: int) -> None:
        assert not self.errors, (
            f"{len(self.errors)} client errors in {self.requests} requests: {self.errors[:5]}"
        )
        assert not self.wrong, f"{len(self.wrong)} wrong answers: {self.wrong[:3]}"
        assert self.requests >= min_requests, f"only {self.requests} requests: the loop saw too little"


class TrainerHold:
    """Holds the push of this process's trainer (the SDK's cluster-mode push) once, at one step,
    until :meth:`release`: ``join`` holds it before it joins the replicas' group (the operator
    waits for it in phase Rendezvous), ``send`` before it broadcasts the first bucket
    (Transferring). ``request`` runs ``at_request`` right before the trainer creates its
    WeightSync (the Pending step freezes a replica there). Later pushes pass freely."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        step: Literal["request", "join", "send"],
        *,
        at_request: Callable[[], None] | None = None,
        timeout_s: float = 120,
    ) -> None:
        from rewardplane.sdk.push.wire.objects import PushObjects
        from rewardplane.sdk.push.wire.operator import OperatorPush

        self.reached = threading.Event()
        self._released = threading.Event()
        self._armed = True
        self._timeout_s = timeout_s
        if step == "request":
            request = PushObjects.request_push

            def requested(this: PushObjects, spec: dict[str, Any]) -> int:
                if self._take() and at_request is not None:
                    at_request()
                return request(this, spec)

            monkeypatch.setattr(PushObjects, "request_push", requested)
        elif step == "join":
            join = OperatorPush.join_group

            def joining(this: OperatorPush, *args: Any, **kwargs: Any) -> Any:
                if self._take():
                    self._released.wait(self._timeout_s)
                return join(this, *args, **kwargs)

            monkeypatch.setattr(OperatorPush, "join_group", joining)
        else:
            import rewardplane.transport.transfer as transfer

            send = transfer.send_buckets

            def sending(*args: Any, **kwargs: Any) -> Any:
                if self._take():
                    self._released.wait(self._timeout_s)
                return send(*args, **kwargs)

            monkeypatch.setattr(transfer, "send_buckets", sending)

    def _take(self) -> bool:
        if not self._armed:
            return False
        self._armed = False
        self.reached.set()
        return True

    def release(self) -> None:
        self._released.set()


class Freezer:
    """Stops a process (SIGSTOP) on :meth:`freeze` until :meth:`thaw`; a context that always thaws."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._stopped = False

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self._stopped = True

    def thaw(self) -> None:
        if self._stopped:
            os.kill(self.pid, signal.SIGCONT)
            self._stopped = False

    def __enter__(self) -> Freezer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.thaw()
