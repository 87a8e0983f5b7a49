"""Drop-in routes: the request shapes of vLLM's pooling API (``/classify``, ``/pooling``,
``/embeddings``, ``/models``, ``/tokenize``, ``/detokenize``), OpenRLHF's remote reward model
(``/get_reward``) and, for generative models (task ``generate``), OpenAI's
``/chat/completions``, each at the root and under ``/v1`` so that a client whose base URL ends in
``/v1`` (the ``openai`` package) works too.

Every route scores through the shared ``ScoringService`` (same limits, batching, weights version
and metrics as ``/score``). Where we differ from vLLM on purpose: the head's activation is off
unless the request asks for it (a reward model's raw score is what RL training uses).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Response

from rewardplane.protocol import (
    VERSION_HEADER,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClassificationData,
    ClassifyRequest,
    ClassifyResponse,
    CompletionUsage,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    Endpoints,
    GetRewardRequest,
    GetRewardResponse,
    ModelCard,
    ModelList,
    ModelTask,
    PooledRequest,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
    encode_base64_floats,
)
from rewardplane.server.errors import BadRequest
from rewardplane.server.http.inputs import check_items, check_token_ids, render_chat
from rewardplane.server.http.json_route import JSONRoute
from rewardplane.server.http.routes import OPENAI_SCORING_ERRORS, SCORING_ERRORS
from rewardplane.server.http.scoring import activation, to_score
from rewardplane.server.http.service import ScoringService

_STARTED = int(time.time())


def compat_router(service: ScoringService) -> APIRouter:
    router = APIRouter(route_class=JSONRoute)
    info = service.info
    tokenizer = service.engine.tokenizer

    def route(path: str, endpoint: Callable[..., Any], response_model: Any, method: str = "POST") -> None:
        for prefix in ("", Endpoints.V1_PREFIX):
            router.add_api_route(
                prefix + path,
                endpoint,
                methods=[method],
                response_model=response_model,
                responses=(OPENAI_SCORING_ERRORS if prefix else SCORING_ERRORS) if method == "POST" else None,
            )

    def chat_text(req: PooledRequest | TokenizeRequest | ChatCompletionRequest, messages: list[Any]) -> str:
        """A request's chat through the model's (or the request's) chat template."""
        return render_chat(
            tokenizer,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
        )

    async def prompts_of(req: PooledRequest) -> tuple[list[list[int]], bool]:
        """Token ids of the request (chat rendered first) and whether over-long ones are cut."""
        special = req.special_tokens()
        keep = req.truncate_prompt_tokens
        if req.messages is not None:
            text = chat_text(req, req.messages)
            prompts = await service.tokenize([text], truncate=keep is not None, add_special_tokens=special)
        else:
            prompts = await service.prompts(req.input, truncate=keep is not None, add_special_tokens=special)
        if keep is None:
            return prompts, False
        if keep > 0:  # vLLM keeps the last k tokens; -1 leaves the cut to the model's max length
            prompts = [p[-keep:] for p in prompts]
        return prompts, True

    async def pooled(req: PooledRequest, response: Response) -> tuple[list[list[float]], int, Usage]:
        service.check_model(req.model)
        prompts, truncate = await prompts_of(req)
        rows, version, prompts = await service.run(prompts, info.pooling_types[0], truncate)
        if req.activation_requested():
            rows = [activation(r) for r in rows]
        response.headers[VERSION_HEADER] = str(version)
        ntok = sum(len(p) for p in prompts)
        return rows, version, Usage(prompt_tokens=ntok, total_tokens=ntok)

    async def classify(req: ClassifyRequest, response: Response) -> ClassifyResponse:
        rows, version, usage = await pooled(req, response)
        data = [
            ClassificationData(
                index=i,
                label=info.id2label.get(max(range(len(r)), key=r.__getitem__)),
                probs=r,
                num_classes=len(r),
            )
            for i, r in enumerate(rows)
        ]
        return ClassifyResponse(
            id=f"classify-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=info.served_model_name,
            data=data,
            usage=usage,
            version=version,
        )

    def encoded(row: list[float], encoding: str) -> list[float] | str:
        return encode_base64_floats(row) if encoding == "base64" else row

    async def pooling(req: PoolingRequest, response: Response) -> PoolingResponse:
        rows, version, usage = await pooled(req, response)
        return PoolingResponse(
            id=f"pool-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=info.served_model_name,
            data=[PoolingData(index=i, data=encoded(r, req.encoding_format)) for i, r in enumerate(rows)],
            usage=usage,
            version=version,
        )

    async def embeddings(req: EmbeddingRequest, response: Response) -> EmbeddingResponse:
        rows, version, usage = await pooled(req, response)
        return EmbeddingResponse(
            id=f"embd-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=info.served_model_name,
            data=[
                EmbeddingData(index=i, embedding=encoded(r, req.encoding_format)) for i, r in enumerate(rows)
            ],
            usage=usage,
            version=version,
        )

    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=name,
                    created=_STARTED,
                    root=service.names.source or None,
                    max_model_len=info.max_model_len,
                )
                for name in service.names.listed()
            ]
        )

    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        service.check_model(req.model)
        text = req.prompt
        if req.messages is not None:
            text = chat_text(req, req.messages)
        (ids,) = await service.tokenize([text or ""], truncate=False, add_special_tokens=req.special_tokens())
        return TokenizeResponse(
            count=len(ids),
            max_model_len=service.limits.max_tokens,
            tokens=ids,
            token_strs=tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        )

    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        service.check_model(req.model)
        check_token_ids([req.tokens], info.vocab_size)
        return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))

    async def get_reward(req: GetRewardRequest, response: Response) -> GetRewardResponse:
        service.check_model(req.model)
        n = len(req.query)
        check_items(n, service.limits)
        for name, extra in (("prompts", req.prompts), ("labels", req.labels)):
            if extra is not None and len(extra) != n:
                raise BadRequest(f"{name} has {len(extra)} items but query has {n}: send one per query")
        prompts = await service.tokenize(
            req.query, truncate=req.truncate, add_special_tokens=req.add_special_tokens
        )
        rows, version, _ = await service.run(prompts, info.pooling_types[0], req.truncate)
        response.headers[VERSION_HEADER] = str(version)
        rewards = [to_score(r, normalize=False) for r in rows]
        return GetRewardResponse(
            rewards=rewards,
            scores=rewards,
            extra_logs={"reward_model_version": [version] * n},
            version=version,
        )

    async def chat_completions(req: ChatCompletionRequest, response: Response) -> ChatCompletionResponse:
        service.check_model(req.model)
        service.require_task(ModelTask.GENERATE)  # before rendering: a scorer may have no template
        text = chat_text(req, req.messages)
        (prompt,) = await service.tokenize([text], truncate=False, add_special_tokens=False)
        answers, version = await service.generate(prompt, req)
        response.headers[VERSION_HEADER] = str(version)
        completion_tokens = sum(a.num_tokens for a in answers)
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=info.served_model_name,
            choices=[
                ChatCompletionChoice(
                    index=i,
                    message=ChatCompletionMessage(content=a.text),
                    finish_reason=a.finish_reason,
                )
                for i, a in enumerate(answers)
            ],
            usage=CompletionUsage(
                prompt_tokens=len(prompt),
                completion_tokens=completion_tokens,
                total_tokens=len(prompt) + completion_tokens,
            ),
            version=version,
        )

    route(Endpoints.CHAT_COMPLETIONS, chat_completions, ChatCompletionResponse)
    route(Endpoints.CLASSIFY, classify, ClassifyResponse)
    route(Endpoints.POOLING, pooling, PoolingResponse)
    route(Endpoints.EMBEDDINGS, embeddings, EmbeddingResponse)
    route(Endpoints.MODELS, models, ModelList, method="GET")
    route(Endpoints.TOKENIZE, tokenize, TokenizeResponse)
    route(Endpoints.DETOKENIZE, detokenize, DetokenizeResponse)
    route(Endpoints.GET_REWARD, get_reward, GetRewardResponse)
    return router
