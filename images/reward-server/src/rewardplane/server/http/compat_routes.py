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
    ModelKind,
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
from rewardplane.server.http.steps import Solution, require_aggregation, step_result

_STARTED = int(time.time())


def compat_router(service: ScoringService) -> APIRouter:
    """Every drop-in endpoint, at the root and under ``/v1``; one ``CompatEndpoints`` method each."""
    router = APIRouter(route_class=JSONRoute)
    endpoints = CompatEndpoints(service)

    def route(path: str, endpoint: Callable[..., Any], response_model: Any, method: str = "POST") -> None:
        for prefix in ("", Endpoints.V1_PREFIX):
            router.add_api_route(
                prefix + path,
                endpoint,
                methods=[method],
                response_model=response_model,
                responses=(OPENAI_SCORING_ERRORS if prefix else SCORING_ERRORS) if method == "POST" else None,
            )

    route(Endpoints.CHAT_COMPLETIONS, endpoints.chat_completions, ChatCompletionResponse)
    route(Endpoints.CLASSIFY, endpoints.classify, ClassifyResponse)
    route(Endpoints.POOLING, endpoints.pooling, PoolingResponse)
    route(Endpoints.EMBEDDINGS, endpoints.embeddings, EmbeddingResponse)
    route(Endpoints.MODELS, endpoints.models, ModelList, method="GET")
    route(Endpoints.TOKENIZE, endpoints.tokenize, TokenizeResponse)
    route(Endpoints.DETOKENIZE, endpoints.detokenize, DetokenizeResponse)
    route(Endpoints.GET_REWARD, endpoints.get_reward, GetRewardResponse)
    return router


def _encoded(row: list[float], encoding: str) -> list[float] | str:
    return encode_base64_floats(row) if encoding == "base64" else row


class CompatEndpoints:
    """The drop-in endpoints over one ``ScoringService``: a public method per endpoint, and the
    steps the pooling family shares (the chat template, the prompts, the pooled rows)."""

    def __init__(self, service: ScoringService) -> None:
        self.service = service
        self.info = service.info
        self.tokenizer = service.engine.tokenizer

    def _chat_text(
        self, req: PooledRequest | TokenizeRequest | ChatCompletionRequest, messages: list[Any]
    ) -> str:
        """A request's chat through the model's (or the request's) chat template."""
        return render_chat(
            self.tokenizer,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
        )

    async def _prompts_of(self, req: PooledRequest) -> tuple[list[list[int]], bool]:
        """Token ids of the request (chat rendered first) and whether over-long ones are cut."""
        special = req.special_tokens()
        keep = req.truncate_prompt_tokens
        if req.messages is not None:
            text = self._chat_text(req, req.messages)
            prompts = await self.service.tokenize(
                [text], truncate=keep is not None, add_special_tokens=special
            )
        else:
            prompts = await self.service.prompts(
                req.input, truncate=keep is not None, add_special_tokens=special
            )
        if keep is None:
            return prompts, False
        if keep > 0:  # vLLM keeps the last k tokens; -1 leaves the cut to the model's max length
            prompts = [p[-keep:] for p in prompts]
        return prompts, True

    async def _pooled(self, req: PooledRequest, response: Response) -> tuple[list[list[float]], int, Usage]:
        self.service.check_model(req.model)
        prompts, truncate = await self._prompts_of(req)
        rows, version, prompts = await self.service.run(prompts, self.info.pooling_types[0], truncate)
        if req.activation_requested():
            rows = [activation(r) for r in rows]
        response.headers[VERSION_HEADER] = str(version)
        ntok = sum(len(p) for p in prompts)
        return rows, version, Usage(prompt_tokens=ntok, total_tokens=ntok)

    async def classify(self, req: ClassifyRequest, response: Response) -> ClassifyResponse:
        self.service.require_sequence_model("/classify")
        rows, version, usage = await self._pooled(req, response)
        data = [
            ClassificationData(
                index=i,
                label=self.info.id2label.get(max(range(len(r)), key=r.__getitem__)),
                probs=r,
                num_classes=len(r),
            )
            for i, r in enumerate(rows)
        ]
        return ClassifyResponse(
            id=f"classify-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.info.served_model_name,
            data=data,
            usage=usage,
            version=version,
        )

    async def _step_pooling(self, req: PoolingRequest, response: Response) -> PoolingResponse:
        """vLLM's shape for a process reward model: the input carries its own step tags, and each
        input's data is the head's rows at them (vLLM's STEP pooling with ``step_tag_id``)."""
        self.service.check_model(req.model)
        prompts, truncate = await self._prompts_of(req)
        if truncate:
            raise BadRequest("truncate_prompt_tokens would cut step tags: send whole solutions")
        tag = self.info.step_tag_id
        solutions = [
            Solution(ids=p, tags=[i for i, t in enumerate(p) if t == tag], spans=[], token_spans=[])
            for p in prompts
        ]
        limit = self.service.limits.max_tokens
        for i, sol in enumerate(solutions):
            if len(sol.ids) > limit:
                raise BadRequest(
                    f"input {i} has {len(sol.ids)} tokens; the limit is {limit} "
                    "(--max-model-len): send fewer or shorter steps"
                )
        rows, version = await self.service.run_steps(solutions)
        if req.activation_requested():
            rows = [[activation(r) for r in solution_rows] for solution_rows in rows]
        response.headers[VERSION_HEADER] = str(version)
        ntok = sum(len(p) for p in prompts)
        return PoolingResponse(
            id=f"pool-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.info.served_model_name,
            data=[PoolingData(index=i, data=r) for i, r in enumerate(rows)],
            usage=Usage(prompt_tokens=ntok, total_tokens=ntok),
            version=version,
        )

    async def pooling(self, req: PoolingRequest, response: Response) -> PoolingResponse:
        if self.info.kind == ModelKind.PROCESS:
            return await self._step_pooling(req, response)
        rows, version, usage = await self._pooled(req, response)
        return PoolingResponse(
            id=f"pool-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.info.served_model_name,
            data=[PoolingData(index=i, data=_encoded(r, req.encoding_format)) for i, r in enumerate(rows)],
            usage=usage,
            version=version,
        )

    async def embeddings(self, req: EmbeddingRequest, response: Response) -> EmbeddingResponse:
        self.service.require_sequence_model("/embeddings")
        rows, version, usage = await self._pooled(req, response)
        return EmbeddingResponse(
            id=f"embd-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.info.served_model_name,
            data=[
                EmbeddingData(index=i, embedding=_encoded(r, req.encoding_format)) for i, r in enumerate(rows)
            ],
            usage=usage,
            version=version,
        )

    async def models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=name,
                    created=_STARTED,
                    root=self.service.names.source or None,
                    max_model_len=self.info.max_model_len,
                )
                for name in self.service.names.listed()
            ]
        )

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.service.check_model(req.model)
        text = req.prompt
        if req.messages is not None:
            text = self._chat_text(req, req.messages)
        (ids,) = await self.service.tokenize(
            [text or ""], truncate=False, add_special_tokens=req.special_tokens()
        )
        return TokenizeResponse(
            count=len(ids),
            max_model_len=self.service.limits.max_tokens,
            tokens=ids,
            token_strs=self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        )

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.service.check_model(req.model)
        check_token_ids([req.tokens], self.info.vocab_size)
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    async def get_reward(self, req: GetRewardRequest, response: Response) -> GetRewardResponse:
        self.service.check_model(req.model)
        n = len(req.query)
        check_items(n, self.service.limits)
        for name, extra in (("prompts", req.prompts), ("labels", req.labels)):
            if extra is not None and len(extra) != n:
                raise BadRequest(f"{name} has {len(extra)} items but query has {n}: send one per query")
        if self.info.kind == ModelKind.PROCESS:
            rewards, version = await self._process_rewards(req, n)
        else:
            prompts = await self.service.tokenize(
                req.query, truncate=req.truncate, add_special_tokens=req.add_special_tokens
            )
            rows, version, _ = await self.service.run(prompts, self.info.pooling_types[0], req.truncate)
            rewards = [to_score(r, normalize=False) for r in rows]
        response.headers[VERSION_HEADER] = str(version)
        return GetRewardResponse(
            rewards=rewards,
            scores=rewards,
            extra_logs={"reward_model_version": [version] * n},
            version=version,
        )

    async def _process_rewards(self, req: GetRewardRequest, n: int) -> tuple[list[float | list[float]], int]:
        """Each query a solution with separators; its reward the aggregate of its steps."""
        process = self.service.process_config("/get_reward")
        how = require_aggregation(None, process, "/get_reward")
        # OpenRLHF's query is prompt + response: with the prompts sent, only the response has steps
        heads = [
            p if isinstance(p, str) and q.startswith(p) else ""
            for q, p in zip(req.query, req.prompts or [""] * n, strict=True)
        ]
        tails = [q[len(h) :] for q, h in zip(req.query, heads, strict=True)]
        solutions = await self.service.solutions(tails, None, heads)
        step_rows, version = await self.service.run_steps(solutions)
        results = [
            step_result(i, r, s, process, how, normalize=False)
            for i, (r, s) in enumerate(zip(step_rows, solutions, strict=True))
        ]
        return [r.score for r in results], version

    async def chat_completions(
        self, req: ChatCompletionRequest, response: Response
    ) -> ChatCompletionResponse:
        self.service.check_model(req.model)
        self.service.require_task(ModelTask.GENERATE)  # before rendering: a scorer may have no template
        text = self._chat_text(req, req.messages)
        (prompt,) = await self.service.tokenize([text], truncate=False, add_special_tokens=False)
        answers, version = await self.service.generate(prompt, req)
        response.headers[VERSION_HEADER] = str(version)
        completion_tokens = sum(a.num_tokens for a in answers)
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.info.served_model_name,
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
