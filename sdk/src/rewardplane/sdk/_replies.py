"""Reading reward servers' answers: each reply parsed into the protocol's models, and the pieces
of a split batch put back together in input order, with the versions that scored them.

Pure functions over ``httpx.Response`` objects (no I/O), shared by both scoring clients.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from rewardplane.protocol import (
    VERSION_HEADER,
    ChatCompletionResponse,
    ClassifyResponse,
    Score,
    ScoringRequest,
    ScoringResponse,
    ScoringResult,
    Usage,
)

from ._exceptions import RewardClientError
from .chunking import reassemble

M = TypeVar("M", bound=BaseModel)

ScoreInfo = dict[str, Any]
"""Transport details of one ``score`` call: ``versions``, ``chunks`` (start, stop, endpoint,
version, attempts), ``request``, ``raw_responses``, ``elapsed_s``."""


@dataclass(frozen=True)
class Piece:
    """One request's share of a batch and what came back for it."""

    rows: range
    url: str
    attempts: int
    response: ScoringResponse
    raw: dict[str, Any]


def parse_piece(resp: httpx.Response, url: str, attempts: int, rows: range) -> Piece:
    try:
        raw = resp.json()
        parsed = ScoringResponse.model_validate(raw)
    except (ValueError, ValidationError) as exc:
        raise RewardClientError(
            f"reward server {url} sent an unreadable /score reply ({exc}); is it a rewardplane "
            "server of a compatible version?"
        ) from exc
    header = resp.headers.get(VERSION_HEADER)
    if header is not None and "version" not in raw:  # body is authoritative when both exist
        parsed = parsed.model_copy(update={"version": int(header)})
    return Piece(rows=rows, url=url, attempts=attempts, response=parsed, raw=raw)


def empty_answer(request: ScoringRequest, base: dict[str, Any]) -> tuple[ScoringResponse, ScoreInfo]:
    meta: dict[str, Any] = {"versions": [], "endpoints": [], "mixed_versions": False}
    return (
        ScoringResponse(model=request.model, data=[], version=0, metadata=meta),
        {"versions": [], "chunks": [], "request": base, "raw_responses": [], "elapsed_s": 0.0},
    )


def assemble(
    pieces: Sequence[Piece], n: int, base: dict[str, Any], start: float
) -> tuple[ScoringResponse, ScoreInfo]:
    try:
        ordered = reassemble(
            [p.rows for p in pieces], [sorted(p.response.data, key=lambda d: d.index) for p in pieces], n
        )
    except ValueError as exc:
        raise RewardClientError(f"reward server reply does not match the request: {exc}") from exc
    data = [
        ScoringResult(index=i, score=d.score, num_tokens=d.num_tokens, steps=d.steps)
        for i, d in enumerate(ordered)
    ]
    versions = [p.response.version for p in pieces]
    chunks = [
        {
            "start": p.rows.start,
            "stop": p.rows.stop,
            "endpoint": p.url,
            "version": p.response.version,
            "attempts": p.attempts,
        }
        for p in pieces
    ]
    metadata: dict[str, Any] = dict(pieces[0].response.metadata) if len(pieces) == 1 else {}
    metadata.update(
        versions=versions, endpoints=[p.url for p in pieces], mixed_versions=len(set(versions)) > 1
    )
    response = ScoringResponse(
        model=pieces[0].response.model,
        data=data,
        usage=Usage(
            prompt_tokens=sum(p.response.usage.prompt_tokens for p in pieces),
            total_tokens=sum(p.response.usage.total_tokens for p in pieces),
        ),
        version=min(versions),
        metadata=metadata,
    )
    info = {
        "versions": versions,
        "chunks": chunks,
        "request": base,
        "raw_responses": [p.raw for p in pieces],
        "elapsed_s": time.monotonic() - start,
    }
    return response, info


def parse_chat_completion(resp: httpx.Response, url: str) -> ChatCompletionResponse:
    try:
        return ChatCompletionResponse.model_validate(resp.json())
    except (ValueError, ValidationError) as exc:
        raise RewardClientError(
            f"server {url} sent an unreadable /v1/chat/completions reply ({exc}); is it a rewardplane "
            "server of task generate (or another OpenAI-compatible server)?"
        ) from exc


def parse_classify(resp: httpx.Response, url: str) -> Score:
    try:
        probs = ClassifyResponse.model_validate(resp.json()).data[0].probs
    except (ValueError, ValidationError, IndexError) as exc:
        raise RewardClientError(
            f"reward server {url} sent an unreadable /classify reply ({exc}); is it a rewardplane "
            "server of a compatible version?"
        ) from exc
    return probs[0] if len(probs) == 1 else probs


def parse_reply(model: type[M], resp: httpx.Response, url: str, path: str) -> M:
    try:
        return model.model_validate(resp.json())
    except (ValueError, ValidationError) as exc:
        raise RewardClientError(f"reward server {url} sent an unreadable {path} reply: {exc}") from exc
