"""The server's endpoints, as routers ``app.build_app`` includes: scoring (open), the weight-sync
control plane, persistence, admission and sleep (behind the bearer token, checked by their route
class before the body is read: ``control_route``).

Each route lists the error answers it really gives (``errors(...)``), so the OpenAPI document is a
contract clients and conformance checks can rely on; every error body is ``ErrorResponse``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Body, Query, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from rewardplane.protocol import (
    VERSION_HEADER,
    AdmissionRequest,
    AdmissionResponse,
    BackgroundTasksResponse,
    CloseCommunicatorRequest,
    CloseCommunicatorResponse,
    Endpoints,
    ErrorResponse,
    HealthResponse,
    InitCommunicatorRequest,
    ModelInfo,
    ModelKind,
    ModelTask,
    OpenAIErrorResponse,
    ParamChecksumsResponse,
    ParamMeta,
    ReadyResponse,
    RestoreWeightsRequest,
    RuntimeVersionResponse,
    ScoringRequest,
    ScoringResponse,
    ScoringResult,
    SendWeightsRequest,
    SleepRequest,
    SleepResponse,
    StatusResponse,
    UpdateParamBatchRequest,
    Usage,
    WakeRequest,
    WorldSizeResponse,
)
from rewardplane.server.engines.sleep import SleepService
from rewardplane.server.errors import BadRequest
from rewardplane.server.http.admission import Admission
from rewardplane.server.http.control_route import control_route
from rewardplane.server.http.json_route import JSONRoute
from rewardplane.server.http.scoring import to_score
from rewardplane.server.http.service import ScoringService
from rewardplane.server.http.steps import resolve_aggregation, step_result
from rewardplane.server.weight_sync.control_plane import WeightSyncService

_ERROR_DESCRIPTIONS = {
    400: "The request is well-formed but cannot be served as asked (the message says what to change).",
    401: "Missing or wrong bearer token.",
    403: "The control plane is disabled: the server was started without a token.",
    409: "Conflicts with the server's state (an update or join in progress, an unknown layout, an "
    "older version, nothing persisted); the message says what to wait for or do.",
    413: "The request body is larger than --max-request-bytes.",
    422: "The body or query does not match the schema.",
    503: "This replica cannot answer now (asleep: POST /wake; weights broken by a failed update; engine "
    "not started or dead).",
}


def errors(*codes: int, shape: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error answers a route gives, all in the one error shape
    (``OpenAIErrorResponse`` under /v1/, see ``errors.speaks_openai``)."""
    return {code: {"model": shape, "description": _ERROR_DESCRIPTIONS[code]} for code in codes}


# What every scoring route can answer besides 200 (bad request, too large, schema, replica not serving).
SCORING_ERRORS = errors(400, 413, 422, 503)
OPENAI_SCORING_ERRORS = errors(400, 413, 422, 503, shape=OpenAIErrorResponse)


def scoring_router(scoring: ScoringService, *, update_failed: Callable[[], bool]) -> APIRouter:
    """``/score``, health and information (vLLM's shapes are in ``compat_routes``); one
    ``ScoringEndpoints`` method each."""
    router = APIRouter(route_class=JSONRoute)
    endpoints = ScoringEndpoints(scoring, update_failed)
    router.add_api_route(
        Endpoints.HEALTH,
        endpoints.health,
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": _ERROR_DESCRIPTIONS[503]}},
    )
    router.add_api_route(
        Endpoints.READY,
        endpoints.ready,
        response_model=ReadyResponse,
        responses={503: {"model": ReadyResponse, "description": "not admitted (yet), or broken weights"}},
    )
    router.add_api_route(
        Endpoints.RUNTIME_VERSION,
        endpoints.runtime_version,
        response_model=RuntimeVersionResponse,
        responses=errors(422),
    )
    router.add_api_route(Endpoints.WORLD_SIZE, endpoints.world_size, response_model=WorldSizeResponse)
    router.add_api_route(Endpoints.MODEL_INFO, endpoints.model_info, response_model=ModelInfo)
    router.add_api_route(
        Endpoints.METRICS,
        endpoints.prometheus,
        response_class=Response,
        responses={
            200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}, "description": "Prometheus metrics"}
        },
    )
    router.add_api_route(
        Endpoints.SCORE,
        endpoints.score,
        methods=["POST"],
        response_model=ScoringResponse,
        responses=SCORING_ERRORS,
    )
    return router


class ScoringEndpoints:
    """The scoring router's endpoints over one ``ScoringService``, a public method each.
    ``update_failed``: the last weight update failed and none runs (a trainer waiting on
    ``/runtime_version`` learns it at once)."""

    def __init__(self, scoring: ScoringService, update_failed: Callable[[], bool]) -> None:
        self.scoring = scoring
        self.engine, self.metrics, self.info = scoring.engine, scoring.metrics, scoring.info
        self.update_failed = update_failed

    async def health(self, response: Response) -> HealthResponse:
        g = self.engine.guard
        if g.state == "broken":
            response.status_code = 503  # not ready: take this replica out of rotation
        # Asleep is healthy (200): the replica stays reachable for /wake, and the operator shows it.
        return HealthResponse(
            version=g.version,
            state=g.state,
            sleep_level=g.sleep_level,
            admitted=self.scoring.admission.admitted,
        )

    async def ready(self, response: Response) -> ReadyResponse:
        """The readiness probe: 200 while this replica takes traffic, 503 with the reason while it
        does not (unadmitted: ``rewardplane.protocol.admission``; broken weights)."""
        answer = self.scoring.admission.ready()
        if not answer.ready:
            response.status_code = 503
        return answer

    async def runtime_version(
        self,
        wait_for_version: int | None = Query(default=None, ge=0),
        timeout_s: float = Query(default=30.0, ge=0, le=300),
    ) -> RuntimeVersionResponse:
        """With ``wait_for_version``, answer once that version serves, the update failed, or the
        timeout passed: a trainer learns the outcome of a push in one round trip."""
        g = self.engine.guard
        if wait_for_version is not None:
            deadline = time.monotonic() + timeout_s
            while (
                g.version < wait_for_version
                and g.state != "broken"
                and time.monotonic() < deadline
                and not self.update_failed()
            ):
                # woken by the commit or the update's end; the cap only bounds a missed wake-up
                await g.wait_change(min(0.05, max(0.0, deadline - time.monotonic())))
        return RuntimeVersionResponse(
            version=g.version,
            state=g.state,
            detail=g.broken_reason,
            sleep_level=g.sleep_level,
            delta_base=g.delta_base,
        )

    async def world_size(self) -> WorldSizeResponse:
        return WorldSizeResponse(world_size=self.info.world_size)

    async def model_info(self) -> ModelInfo:
        info = self.info
        return ModelInfo(
            model=info.served_model_name,
            engine=info.engine,
            num_labels=info.num_labels,
            dtype=info.dtype,
            head_dtype=info.head_dtype,
            max_model_len=info.max_model_len,
            pooling_type=info.pooling_types[0],
            version=self.engine.guard.version,
            max_lora_rank=info.max_lora_rank,
            task=info.task,
            max_items_per_request=self.scoring.limits.max_items,
            kind=info.kind,
            process=info.process,
        )

    async def prometheus(self) -> Response:
        self.metrics.weights_version.set(self.engine.guard.version)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def score(self, req: ScoringRequest, response: Response) -> ScoringResponse:
        scoring, info = self.scoring, self.info
        scoring.check_model(req.model)
        scoring.require_task(ModelTask.SCORE)  # before the label check: a judge has no labels
        if req.n_labels is not None and req.n_labels != info.num_labels:
            raise BadRequest(
                f"n_labels {req.n_labels} does not match the served model, which has {info.num_labels} "
                "label(s): drop n_labels or point at the right reward model"
            )
        if req.return_hidden_states:
            raise BadRequest("return_hidden_states is not supported by this server; send false")
        if (
            info.kind == ModelKind.PROCESS
            or req.steps is not None
            or req.prompts is not None
            or req.aggregation
        ):
            return await self._score_steps(req, response)
        if req.pooling_type not in info.pooling_types:
            raise BadRequest(
                f"pooling_type {req.pooling_type.value!r} is not available for this model; "
                f"use one of {[p.value for p in info.pooling_types]}"
            )
        ids = await scoring.tokenize(list(req.inputs), truncate=req.truncate)
        rows, version, prompts = await scoring.run(ids, req.pooling_type, req.truncate)
        response.headers[VERSION_HEADER] = str(version)
        ntok = sum(len(p) for p in prompts)
        return ScoringResponse(
            model=info.served_model_name,
            data=[
                ScoringResult(index=i, score=to_score(row, normalize=req.normalize), num_tokens=len(p))
                for i, (row, p) in enumerate(zip(rows, prompts, strict=True))
            ],
            usage=Usage(prompt_tokens=ntok, total_tokens=ntok),
            version=version,
            metadata={"version": version},
        )

    async def _score_steps(self, req: ScoringRequest, response: Response) -> ScoringResponse:
        """A process reward model's ``/score``: every step's score and their aggregate, one pass each."""
        scoring = self.scoring
        process = scoring.process_config("steps, prompts and aggregation")
        solutions = await scoring.solutions(list(req.inputs), req.steps, req.prompts, req.first_step)
        rows, version = await scoring.run_steps(solutions)
        response.headers[VERSION_HEADER] = str(version)
        how = resolve_aggregation(req.aggregation, process)
        ntok = sum(len(s.ids) for s in solutions)
        return ScoringResponse(
            model=self.info.served_model_name,
            data=[
                step_result(i, r, s, process, how, normalize=req.normalize)
                for i, (r, s) in enumerate(zip(rows, solutions, strict=True))
            ],
            usage=Usage(prompt_tokens=ntok, total_tokens=ntok),
            version=version,
            metadata={"version": version},
        )


def _token_router(token: str | None, parameters: Callable[[], int] = lambda: 0) -> APIRouter:
    """A router whose routes check the token before they read a body (``control_route``)."""
    return APIRouter(responses=errors(401, 403), route_class=control_route(token, parameters))


def control_router(service: WeightSyncService, token: str | None) -> APIRouter:
    """The weight-sync control plane (``control_plane.WeightSyncService``), token-protected."""
    router = _token_router(token, lambda: len(service.manifest))

    @router.post(
        Endpoints.INIT_COMMUNICATOR, response_model=StatusResponse, responses=errors(400, 409, 413, 422)
    )
    async def init_communicator(req: InitCommunicatorRequest) -> StatusResponse:
        await service.init_communicator(req)
        return StatusResponse()

    @router.post(
        Endpoints.UPDATE_PARAM_BATCH, response_model=StatusResponse, responses=errors(400, 409, 413, 422)
    )
    async def update_param_batch(req: UpdateParamBatchRequest) -> StatusResponse:
        version = await service.update(req)
        return StatusResponse(detail={"version": version})

    @router.post(
        Endpoints.CLOSE_COMMUNICATOR,
        response_model=CloseCommunicatorResponse,
        responses=errors(409, 413, 422),
    )
    async def close_communicator(req: CloseCommunicatorRequest | None = None) -> CloseCommunicatorResponse:
        """Leave the trainer's group; a join still waiting for the trainer is cancelled, and named.
        With a ``group_id``, only that group's (a server elsewhere answers ``closed: false``)."""
        closed, cancelled = await service.close(req.group_id if req is not None else None)
        return CloseCommunicatorResponse(closed=closed, cancelled_join=cancelled)

    def background_tasks() -> BackgroundTasksResponse:
        return BackgroundTasksResponse(
            num_background_tasks=service.background_count(),
            last_error=service.last_error,
            last_update=service.last_update,
        )

    # GET and POST (the seed's clients use either), as two operations with their own ids
    @router.get(Endpoints.NUM_BACKGROUND_TASKS, response_model=BackgroundTasksResponse)
    async def num_background_tasks() -> BackgroundTasksResponse:
        return background_tasks()

    @router.post(
        Endpoints.NUM_BACKGROUND_TASKS, response_model=BackgroundTasksResponse, responses=errors(413)
    )
    async def num_background_tasks_post() -> BackgroundTasksResponse:
        return background_tasks()

    @router.get(Endpoints.PARAM_MANIFEST, response_model=list[ParamMeta])
    async def param_manifest() -> list[ParamMeta]:
        return list(service.manifest.values())

    @router.get(Endpoints.PARAM_CHECKSUMS, response_model=ParamChecksumsResponse, responses=errors(503))
    async def param_checksums() -> ParamChecksumsResponse:
        version, workers = await service.param_checksums()
        return ParamChecksumsResponse(version=version, workers=workers)

    return router


def admission_router(admission: Admission, token: str | None) -> APIRouter:
    """``POST /admission``: the operator admits a replica at the model's weights version (or takes
    the admission back); rules in ``rewardplane.protocol.admission``."""
    router = _token_router(token)

    @router.post(Endpoints.ADMISSION, response_model=AdmissionResponse, responses=errors(409, 413, 422))
    async def admission_change(req: AdmissionRequest) -> AdmissionResponse:
        return admission.change(req)

    return router


def sleep_router(service: SleepService, token: str | None) -> APIRouter:
    """``POST /sleep`` and ``POST /wake`` (``sleep.SleepService``; rules in ``rewardplane.protocol.sleep``)."""
    router = _token_router(token)

    @router.post(Endpoints.SLEEP, response_model=SleepResponse, responses=errors(409, 413, 422, 503))
    async def sleep(req: SleepRequest) -> SleepResponse:
        """Release the GPU memory (level 1: weights to host memory; level 2: weights discarded)."""
        return await service.sleep(req.level, req.timeout_s)

    @router.post(Endpoints.WAKE, response_model=SleepResponse, responses=errors(413, 422, 503))
    async def wake(req: WakeRequest | None = Body(default=None)) -> SleepResponse:
        """Take the memory back and serve the same weights (after level 2: reloaded, else broken)."""
        req = req or WakeRequest()
        return await service.wake(req.timeout_s, reload=req.reload)

    return router


def persistence_router(service: WeightSyncService, token: str | None) -> APIRouter:
    """``POST /restore_weights``: load what ``--weights-dir`` saved; ``POST /send_weights``: send this
    replica's weights to a restarted peer. The operator calls both to bring a replica back."""
    router = _token_router(token)

    @router.post(
        Endpoints.RESTORE_WEIGHTS, response_model=StatusResponse, responses=errors(409, 413, 422, 503)
    )
    async def restore_weights(req: RestoreWeightsRequest) -> StatusResponse:
        count = await service.restore(req.version, req.timeout_s)
        return StatusResponse(detail={"version": req.version, "parameters": count})

    @router.post(Endpoints.SEND_WEIGHTS, response_model=StatusResponse, responses=errors(409, 413, 422))
    async def send(req: SendWeightsRequest) -> StatusResponse:
        """Peer restore: send this replica's weights to joining peers (peer.py)."""
        await service.send_weights(req)
        return StatusResponse(detail={"version": req.version, "rank": req.world_size - 1})

    return router
