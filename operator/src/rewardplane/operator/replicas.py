"""The operator's calls to reward servers, behind one small interface.

``Replicas`` is what the reconciler and the WeightSync driver need from a replica's HTTP API;
``HttpReplicas`` implements it with httpx, and unit tests pass a fake (``rewardplane.testing``)
so the push and restore decisions run without servers. Every call has a timeout; a failed call
raises ``ReplicaError`` naming the URL and what the server said.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from rewardplane.protocol import (
    AdmissionRequest,
    AdmissionResponse,
    BackgroundTasksResponse,
    CloseCommunicatorRequest,
    CloseCommunicatorResponse,
    Endpoints,
    HealthResponse,
    InitCommunicatorRequest,
    ParamMeta,
    RestoreWeightsRequest,
    RewardModelTrainingMode,
    RuntimeVersionResponse,
    SendWeightsRequest,
    UpdateParamBatchRequest,
)
from rewardplane.protocol.auth import auth_headers

from .status import ProbeResult

# Short: a hung server must not hold up the status of every other replica.
PROBE_TIMEOUT = httpx.Timeout(2.0, connect=1.0)
CALL_TIMEOUT = httpx.Timeout(10.0, connect=3.0)
WAIT_POLL_S = 30.0  # one long poll of /runtime_version (the server takes at most 300 s)
# A close that cancels a join past its rendezvous waits for that join's push channel (30 s at most).
CLOSE_TIMEOUT_S = 40.0


class ReplicaError(RuntimeError):
    """A replica did not answer, or answered with an error (the message says which and what;
    ``code``: the error's ``detail.code`` where the server gave one, e.g. ``STALE_BASE``)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class Replicas(Protocol):
    """A reward server's HTTP API as the operator uses it; ``url`` is the server's base URL."""

    def probe(self, url: str) -> ProbeResult: ...

    def runtime(self, url: str) -> Mapping[str, Any]: ...

    def world_size(self, url: str) -> int: ...

    def background_tasks(self, url: str, token: str) -> Mapping[str, Any]: ...

    def manifest(self, url: str, token: str) -> list[ParamMeta]: ...

    def init_communicator(self, url: str, token: str, req: InitCommunicatorRequest) -> None: ...

    def close_communicator(self, url: str, token: str, group_id: str) -> CloseCommunicatorResponse: ...

    def update_param_batch(
        self, url: str, token: str, req: UpdateParamBatchRequest, timeout_s: float
    ) -> None: ...

    def restore_weights(self, url: str, token: str, req: RestoreWeightsRequest) -> None: ...

    def send_weights(self, url: str, token: str, req: SendWeightsRequest) -> None: ...

    def admission(self, url: str, token: str, req: AdmissionRequest) -> AdmissionResponse: ...

    def wait_for_version(self, url: str, version: int, timeout_s: float) -> Mapping[str, Any]: ...


def _error(resp: httpx.Response) -> tuple[str, str | None]:
    """An error answer's message, and its ``detail.code`` where the server gave one."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500], None
    if not isinstance(body, dict):
        return str(body)[:500], None
    detail = body.get("detail")
    code = detail.get("code") if isinstance(detail, dict) else None
    return str(body.get("error") or detail or body)[:500], code if isinstance(code, str) else None


class HttpReplicas:
    """``Replicas`` over one pooled httpx client."""

    def __init__(self, client: httpx.Client | None = None) -> None:
        self._http = client or httpx.Client()

    def close(self) -> None:
        self._http.close()

    def _get(
        self, url: str, path: str, token: str | None = None, timeout: httpx.Timeout = CALL_TIMEOUT
    ) -> Any:
        headers = auth_headers(token) if token else None
        resp = _answered(url, path, lambda: self._http.get(url + path, headers=headers, timeout=timeout))
        try:
            return resp.json()
        except ValueError as exc:
            raise ReplicaError(f"{url}{path} answered something that is not JSON: {resp.text[:200]}") from exc

    def _post(self, url: str, path: str, token: str, body: dict[str, Any], timeout_s: float) -> Any:
        timeout = httpx.Timeout(timeout_s, connect=3.0)
        resp = _answered(
            url,
            path,
            lambda: self._http.post(url + path, json=body, headers=auth_headers(token), timeout=timeout),
        )
        try:
            return resp.json()
        except ValueError:
            return None

    def probe(self, url: str) -> ProbeResult:
        try:
            health = HealthResponse.model_validate(self._get(url, Endpoints.HEALTH, timeout=PROBE_TIMEOUT))
            runtime = RuntimeVersionResponse.model_validate(
                self._get(url, Endpoints.RUNTIME_VERSION, timeout=PROBE_TIMEOUT)
            )
        except (ReplicaError, ValueError) as exc:
            return ProbeResult(error=str(exc))
        return ProbeResult(
            version=runtime.version,
            state=runtime.state,
            sleep_level=runtime.sleep_level,
            admitted=health.admitted,
        )

    def runtime(self, url: str) -> Mapping[str, Any]:
        body = self._get(url, Endpoints.RUNTIME_VERSION)
        if not isinstance(body, dict):
            raise ReplicaError(f"{url}{Endpoints.RUNTIME_VERSION} answered {body!r}")
        return body

    def world_size(self, url: str) -> int:
        body = self._get(url, Endpoints.WORLD_SIZE)
        try:
            return int(body["world_size"])
        except (TypeError, KeyError, ValueError) as exc:
            raise ReplicaError(f"{url}{Endpoints.WORLD_SIZE} answered {body!r}") from exc

    def background_tasks(self, url: str, token: str) -> Mapping[str, Any]:
        body = self._get(url, Endpoints.NUM_BACKGROUND_TASKS, token)
        return BackgroundTasksResponse.model_validate(body).model_dump()

    def manifest(self, url: str, token: str) -> list[ParamMeta]:
        body = self._get(url, Endpoints.PARAM_MANIFEST, token)
        return [ParamMeta.model_validate(m) for m in body]

    def init_communicator(self, url: str, token: str, req: InitCommunicatorRequest) -> None:
        self._post(url, Endpoints.INIT_COMMUNICATOR, token, req.model_dump(mode="json"), 10.0)

    def close_communicator(self, url: str, token: str, group_id: str) -> CloseCommunicatorResponse:
        body = CloseCommunicatorRequest(group_id=group_id).model_dump(mode="json")
        answer = self._post(url, Endpoints.CLOSE_COMMUNICATOR, token, body, CLOSE_TIMEOUT_S)
        try:
            return CloseCommunicatorResponse.model_validate(answer)
        except ValueError as exc:
            raise ReplicaError(f"{url}{Endpoints.CLOSE_COMMUNICATOR} answered {answer!r}: {exc}") from exc

    def update_param_batch(
        self, url: str, token: str, req: UpdateParamBatchRequest, timeout_s: float
    ) -> None:
        self._post(url, Endpoints.UPDATE_PARAM_BATCH, token, req.model_dump(mode="json"), timeout_s)

    def restore_weights(self, url: str, token: str, req: RestoreWeightsRequest) -> None:
        self._post(url, Endpoints.RESTORE_WEIGHTS, token, req.model_dump(mode="json"), req.timeout_s + 5.0)

    def send_weights(self, url: str, token: str, req: SendWeightsRequest) -> None:
        self._post(url, Endpoints.SEND_WEIGHTS, token, req.model_dump(mode="json"), 10.0)

    def admission(self, url: str, token: str, req: AdmissionRequest) -> AdmissionResponse:
        body = self._post(url, Endpoints.ADMISSION, token, req.model_dump(mode="json"), 10.0)
        try:
            return AdmissionResponse.model_validate(body)
        except ValueError as exc:
            raise ReplicaError(f"{url}{Endpoints.ADMISSION} answered {body!r}") from exc

    def wait_for_version(self, url: str, version: int, timeout_s: float) -> Mapping[str, Any]:
        """/runtime_version once the replica serves ``version`` (or reports broken, or the update
        failed), else at the deadline: long polls of at most ``WAIT_POLL_S`` each."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            wait = min(WAIT_POLL_S, left)
            body = self._get(
                url,
                f"{Endpoints.RUNTIME_VERSION}?wait_for_version={version}&timeout_s={wait:.3f}",
                timeout=httpx.Timeout(wait + 5.0, connect=3.0),
            )
            if not isinstance(body, dict):
                raise ReplicaError(f"{url}{Endpoints.RUNTIME_VERSION} answered {body!r}")
            if int(body.get("version", -1)) >= version or body.get("state") == "broken" or left <= wait:
                return body


# --------------------------------------------------------------------------------------------
# Peer restore: bring replicas to the current version from a healthy peer
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Receiver:
    pod: str
    url: str
    world_size: int


def restore_from_peer(
    replicas: Replicas,
    token: str,
    *,
    source_url: str,
    source_host: str,
    port: int,
    receivers: Sequence[Receiver],
    version: int,
    timeout_s: float,
    group_id: str,
) -> None:
    """Start a full push of ``version`` from the replica at ``source_url`` to ``receivers``.

    The source hosts the rendezvous on ``source_host:port`` and is the last rank; receiver i's
    workers start at Σ world sizes of the receivers before it (the same layout as a trainer's push,
    so the receivers need nothing new). Returns once every receiver accepted; the reconciler sees
    them reach ``version`` on its next passes. Raises ``ReplicaError`` naming the replica that refused.
    """
    metadata = replicas.manifest(source_url, token)
    world = sum(r.world_size for r in receivers) + 1
    replicas.send_weights(
        source_url,
        token,
        SendWeightsRequest(
            port=port, world_size=world, version=version, timeout_s=timeout_s, group_id=group_id
        ),
    )
    offset = 0
    for r in receivers:
        replicas.init_communicator(
            r.url,
            token,
            InitCommunicatorRequest(
                host=source_host,
                port=port,
                world_size=world,
                rank_offset=offset,
                timeout_s=timeout_s,
                group_id=group_id,
            ),
        )
        offset += r.world_size
    announce = UpdateParamBatchRequest(
        metadata=metadata, training_mode=RewardModelTrainingMode.FULL, version=version, timeout_s=timeout_s
    )
    for r in receivers:
        replicas.update_param_batch(r.url, token, announce, timeout_s + 5.0)


def _answered(url: str, path: str, call: Callable[[], httpx.Response]) -> httpx.Response:
    """The answer of ``call`` (a request to ``url + path``); ReplicaError when there is none or it
    is an error."""
    try:
        resp = call()
    except httpx.HTTPError as exc:
        raise ReplicaError(f"{url}{path} did not answer: {type(exc).__name__}: {exc}") from exc
    if resp.status_code >= 400:
        message, code = _error(resp)
        raise ReplicaError(f"{url}{path} answered {resp.status_code}: {message}", code)
    return resp
