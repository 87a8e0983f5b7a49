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

from rewardplane.protocol import ChatCompletionRequest, ModelKind, ModelTask, PoolingType, ProcessRewardConfig
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
from rewardplane.server.http.steps import Solution, build_solution, check_length, solution_steps
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

    def require_sequence_model(self, route: str) -> None:
        """A 400 for a route that reads one head row per text, asked of a process reward model."""
        if self.info.kind == ModelKind.PROCESS:
            raise BadRequest(
                f"{route} reads one score per text, but this server runs a process reward model (kind "
                "process), which scores the steps of a solution: use POST /score (the steps as a list or "
                "as text with the step separator) or vLLM's POST /pooling (the text with the step tags)"
            )

    def process_config(self, what: str) -> ProcessRewardConfig:
        """The served PRM's configuration; a 400 for a step request to a sequence model."""
        process = self.info.process
        if self.info.kind != ModelKind.PROCESS or process is None:
            raise BadRequest(
                f"{what} are for process reward models, and this server runs a sequence reward model (kind "
                "sequence) with one score per text: drop them and send `input` texts, or send the request to "
                "a RewardModel of kind process (--model-kind process)"
            )
        return process

    async def solutions(
        self, texts: list[str], steps: list[list[str]] | None, prompts: list[str] | None, first_step: int = 0
    ) -> list[Solution]:
        """Each solution as scored (tags inserted after its steps), limits checked before any work."""
        process = self.process_config("steps")
        n = len(steps) if steps is not None else len(texts)
        check_items(n, self.limits)
        # every step and prompt counts towards the byte limit of its solution's text
        joined = [process.step_separator.join(s) for s in steps] if steps is not None else texts
        bound_texts(
            [(prompts[i] if prompts else "") + t for i, t in enumerate(joined)], self.limits, truncate=False
        )
        tag_id = self.info.step_tag_id
        assert tag_id is not None  # set by every engine serving kind process

        def build() -> list[Solution]:
            out = []
            for i, (ss, spans) in enumerate(solution_steps(texts, steps, process.step_separator)):
                sol = build_solution(
                    self.engine.tokenizer,
                    prompts[i] if prompts else "",
                    ss,
                    spans,
                    tag_id=tag_id,
                    tag=process.step_tag,
                    index=i,
                )
                check_length(sol, self.limits.max_tokens, i)
                out.append(sol.from_step(first_step, i))
            return out

        with self.metrics.tokenize_stage.time():
            return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, build)

    async def run_steps(self, solutions: list[Solution]) -> tuple[list[list[list[float]]], int]:
        """Raw head rows at each solution's step tags and the weights version that made all of them."""
        self.admission.check_scoring()
        if not solutions:
            return [], self.engine.guard.version
        with self.metrics.engine_stage.time():
            rows, version = await self.engine.score_steps(
                [s.ids for s in solutions], [s.tags for s in solutions]
            )
        self.metrics.items.inc(len(solutions))
        self.metrics.tokens.inc(sum(len(s.ids) for s in solutions))
        return rows, version

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
