"""A stand-in for reward servers in the operator's unit tests: ``FakeReplicas`` implements the
operator's ``Replicas`` interface over in-memory replica states, and records every call.

What it models of a real server: the served version and state, the world size, refusals (409)
set by the test, and an update that lands after a number of polls (or fails with an error).
The integration suites run the same operator code against real server processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rewardplane.operator.replicas import ReplicaError
from rewardplane.operator.status import ProbeResult
from rewardplane.protocol import (
    AdmissionRequest,
    AdmissionResponse,
    CancelledJoin,
    CloseCommunicatorResponse,
    InitCommunicatorRequest,
    ParamMeta,
    RestoreWeightsRequest,
    SendWeightsRequest,
    UpdateParamBatchRequest,
)


@dataclass
class FakeReplica:
    version: int = 0
    state: str = "serving"
    world_size: int = 1
    answers: bool = True
    """False: every call fails as a connection error would."""
    refuse: dict[str, str] = field(default_factory=dict)
    """Call name → the 409 message it answers with."""
    polls_until_done: int = 1
    """After an accepted update: /runtime_version polls until the new version is served."""
    update_error: str | None = None
    """An accepted update fails with this error instead (the server reports it and stays put)."""
    saved_version: int | None = None
    sleep_level: int | None = None
    """Set with ``state="sleeping"``: the level the replica sleeps at."""
    admitted: bool = True
    """False: started with --require-admission and not admitted yet."""
    group: str | None = None
    """The group_id of the group this replica is joining or in (set by init_communicator)."""
    _pending: int | None = None
    _polls: int = 0
    _last_error: str | None = None


# The calls a real server answers only with the bearer token.
CONTROL_PLANE_CALLS = frozenset(
    {
        "background_tasks",
        "manifest",
        "init_communicator",
        "close_communicator",
        "update_param_batch",
        "restore_weights",
        "send_weights",
        "admission",
    }
)


class FakeReplicas:
    def __init__(self, replicas: Mapping[str, FakeReplica] | None = None, token: str = "tok") -> None:
        self.replicas: dict[str, FakeReplica] = dict(replicas or {})
        self.token = token  # what the control-plane calls must carry, as a real server checks
        self.calls: list[tuple[str, str]] = []
        self.manifest_of: list[ParamMeta] = [ParamMeta(name="score.weight", dtype="float32", shape=(1, 4))]

    def _get(self, call: str, url: str, token: str | None = None) -> FakeReplica:
        self.calls.append((call, url))
        if call in CONTROL_PLANE_CALLS and token != self.token:
            raise ReplicaError(f"{url}/{call} answered 401: wrong bearer token")
        r = self.replicas.get(url)
        if r is None or not r.answers:
            raise ReplicaError(f"{url} did not answer: ConnectError")
        if call in r.refuse:
            raise ReplicaError(f"{url}/{call} answered 409: {r.refuse[call]}")
        return r

    def probe(self, url: str) -> ProbeResult:
        try:
            r = self._get("probe", url)
        except ReplicaError as exc:
            return ProbeResult(error=str(exc))
        return ProbeResult(version=r.version, state=r.state, sleep_level=r.sleep_level, admitted=r.admitted)

    def runtime(self, url: str) -> Mapping[str, Any]:
        r = self._get("runtime", url)
        if r._pending is not None:
            r._polls += 1
            if r._polls >= r.polls_until_done:
                if r.update_error is None:
                    r.version, r.state = r._pending, "serving"
                else:
                    r._last_error = r.update_error
                r._pending = None
        return {"version": r.version, "state": r.state}

    def world_size(self, url: str) -> int:
        return self._get("world_size", url).world_size

    def background_tasks(self, url: str, token: str) -> Mapping[str, Any]:
        r = self._get("background_tasks", url, token)
        return {"num_background_tasks": 1 if r._pending is not None else 0, "last_error": r._last_error}

    def manifest(self, url: str, token: str) -> list[ParamMeta]:
        self._get("manifest", url, token)
        return list(self.manifest_of)

    def init_communicator(self, url: str, token: str, req: InitCommunicatorRequest) -> None:
        self._get("init_communicator", url, token).group = req.group_id

    def close_communicator(self, url: str, token: str, group_id: str) -> CloseCommunicatorResponse:
        """Leaves ``group_id`` only (a replica in another group, or in none, answers closed false)."""
        r = self._get("close_communicator", url, token)
        if r.group != group_id:
            return CloseCommunicatorResponse(closed=False)
        r.group = None
        return CloseCommunicatorResponse(
            cancelled_join=CancelledJoin(host="trainer", port=1, group_id=group_id, pending_s=1.0)
        )

    def update_param_batch(
        self, url: str, token: str, req: UpdateParamBatchRequest, timeout_s: float
    ) -> None:
        r = self._get("update_param_batch", url, token)
        r._pending, r._polls, r._last_error = req.version, 0, None

    def restore_weights(self, url: str, token: str, req: RestoreWeightsRequest) -> None:
        r = self._get("restore_weights", url, token)
        if r.saved_version != req.version:
            raise ReplicaError(
                f"{url}/restore_weights answered 409: no saved weights of version {req.version}"
            )
        r.version = req.version

    def send_weights(self, url: str, token: str, req: SendWeightsRequest) -> None:
        r = self._get("send_weights", url, token)
        if r.version != req.version:
            raise ReplicaError(
                f"{url}/send_weights answered 409: serves version {r.version}, not {req.version}"
            )

    def admission(self, url: str, token: str, req: AdmissionRequest) -> AdmissionResponse:
        r = self._get("admission", url, token)
        if req.admit and (r.version != req.version or r.state == "broken"):
            raise ReplicaError(
                f"{url}/admission answered 409: serves version {r.version} ({r.state}), not {req.version}"
            )
        changed, r.admitted = r.admitted != req.admit, req.admit
        return AdmissionResponse(admitted=r.admitted, version=r.version, changed=changed)

    def wait_for_version(self, url: str, version: int, timeout_s: float) -> Mapping[str, Any]:
        """One poll (a real server holds the call until the version serves or the timeout)."""
        return self.runtime(url)
