"""The scoring path every route shares: the model-name check, the request limits, tokenization off
the event loop, the engine call and its metrics (each stage's time too). Routes turn their own
request shapes into texts or token ids and call ``tokenize`` / ``prompts`` and ``run``.

Limits come before work: the number of inputs and each text's size are checked before anything is
tokenized (``inputs.check_items``, ``inputs.bound_texts``), and tokenization runs on a pool of its
own, so a 10 MB input costs the event loop nothing but its parsing."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

from rewardplane.protocol import ChatCompletionRequest, ModelTask, PoolingType
from rewardplane.server.engines.engine import Completion, EngineInfo, RewardEngine
from rewardplane.server.engines.generation import sampling_options, wrong_task
from rewardplane.server.errors import BadRequest
from rewardplane.server.http.admission import Admission
from rewardplane.server.http.inputs import (
    Limits,
    apply_length_limit,
    bound_texts,
    check_items,
    check_token_ids,
    split_prompt_input,
    tokenize_texts,
)
from rewardplane.server.http.model_names import ModelNames
from rewardplane.server.metrics import ServerMetrics


class ScoringService:
    def __init__(
        self,
        engine: RewardEngine,
        limits: Limits,
        metrics: ServerMetrics,
        names: ModelNames,
        tokenizer_pool: Executor,
        admission: Admission | None = None,
    ) -> None:
        self.engine = engine
        self.admission = admission or Admission(engine.guard, required=False)
        self.limits = limits
        self.metrics = metrics
        self.names = names
        self.tokenizer_pool = tokenizer_pool

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    def check_model(self, name: str | None) -> None:
        problem = self.names.problem(name)
        if problem is not None:
            raise BadRequest(problem)

    async def tokenize(
        self, texts: list[str], *, truncate: bool, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of ``texts``: counts and byte sizes checked first, then tokenized off the loop."""
        check_items(len(texts), self.limits)
        texts = bound_texts(texts, self.limits, truncate=truncate)
        loop = asyncio.get_running_loop()
        with self.metrics.tokenize_stage.time():
            return await loop.run_in_executor(
                self.tokenizer_pool,
                lambda: tokenize_texts(self.engine.tokenizer, texts, add_special_tokens=add_special_tokens),
            )

    async def prompts(self, raw: Any, *, truncate: bool, add_special_tokens: bool = True) -> list[list[int]]:
        """vLLM's ``input`` (a string, strings, token ids, or lists of token ids) as token ids."""
        texts, ids = split_prompt_input(raw)
        if texts is not None:
            return await self.tokenize(texts, truncate=truncate, add_special_tokens=add_special_tokens)
        assert ids is not None
        check_items(len(ids), self.limits)
        check_token_ids(ids, self.info.vocab_size)
        return ids

    def require_task(self, task: ModelTask) -> None:
        """A 400 naming the right endpoints when the served model is not of ``task``."""
        if self.info.task != task:
            raise wrong_task(self.info)

    async def run(
        self, prompts: list[list[int]], pooling: PoolingType, truncate: bool
    ) -> tuple[list[list[float]], int, list[list[int]]]:
        """Raw head rows, the weights version that made all of them, and the prompts as scored."""
        self.require_task(ModelTask.SCORE)
        self.admission.check_scoring()
        check_items(len(prompts), self.limits)
        if not prompts:  # an empty batch: nothing to score, answered at the version served
            return [], self.engine.guard.version, []
        prompts = apply_length_limit(prompts, self.limits, truncate=truncate)
        with self.metrics.engine_stage.time():
            rows, version = await self.engine.score(prompts, pooling)
        self.metrics.items.inc(len(prompts))
        self.metrics.tokens.inc(sum(len(p) for p in prompts))
        return rows, version, prompts

    async def generate(self, prompt: list[int], req: ChatCompletionRequest) -> tuple[list[Completion], int]:
        """The answers to one rendered chat and the weights version that generated all of them."""
        self.require_task(ModelTask.GENERATE)
        self.admission.check_scoring()
        options = sampling_options(req, len(prompt), self.info.max_model_len)
        with self.metrics.engine_stage.time():
            answers, version = await self.engine.generate(prompt, options)
        self.metrics.items.inc(1)
        self.metrics.tokens.inc(len(prompt) + sum(a.num_tokens for a in answers))
        return answers, version
