"""The transformers engine for generative models (task ``generate``: an LLM judge):
``AutoModelForCausalLM.generate`` on CPU or CUDA, one request at a time, with the same weight sync
as the scoring engine (``HFWeightPort``). Serves CPU deployments and CI; vLLM is the fast path."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from rewardplane.protocol import ModelTask, PoolingType
from rewardplane.protocol.compat import FinishReason
from rewardplane.server.config import ServerConfig
from rewardplane.server.engines.engine import Completion, EngineInfo, SamplingOptions
from rewardplane.server.engines.generation import cut_at_stop, wrong_task
from rewardplane.server.engines.hf_engine import HFEngineBase
from rewardplane.server.metrics import RequestTimer, ServerMetrics

log = logging.getLogger(__name__)


class HFGenerativeEngine(HFEngineBase):
    """``RewardEngine`` of task ``generate`` on transformers. Generation holds the weights lock
    (``guard.scoring()``) for the whole request, so every choice of one answer comes from one
    weights version; it runs on a thread of its own (one request at a time)."""

    def __init__(self, cfg: ServerConfig, metrics: ServerMetrics | None = None) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(cfg, metrics, AutoModelForCausalLM, "rp-generate")
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.pad_id = int(
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        )
        name = str(self.dtype).removeprefix("torch.")
        self.info = EngineInfo(
            served_model_name=cfg.name,
            engine="hf",
            num_labels=0,
            dtype=name,
            head_dtype=name,
            max_model_len=self.max_model_len,
            vocab_size=int(self.model.config.vocab_size),
            pooling_types=(PoolingType.LAST,),
            task=ModelTask.GENERATE,
        )

    async def start(self) -> None:
        """Nothing to start: the model is loaded."""

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def score(self, prompts: list[list[int]], pooling: PoolingType) -> tuple[list[list[float]], int]:
        raise wrong_task(self.info)

    async def score_steps(
        self, prompts: list[list[int]], tags: list[list[int]], *, reuse_prefix: bool = False
    ) -> tuple[list[list[list[float]]], int]:
        raise wrong_task(self.info)

    async def generate(self, prompt: list[int], options: SamplingOptions) -> tuple[list[Completion], int]:
        loop = asyncio.get_running_loop()
        with RequestTimer(self.metrics) as timer:
            async with self.guard.scoring() as version:
                timer.start()
                out = await loop.run_in_executor(self._pool, self.generate_sync, prompt, options)
        return out, version

    @torch.inference_mode()
    def generate_sync(self, prompt: list[int], options: SamplingOptions) -> list[Completion]:
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {
            "attention_mask": torch.ones_like(ids),
            "max_new_tokens": options.max_tokens,
            # transformers cannot go on past an end of sequence: ignore_eos forbids it instead (the
            # same length, and an end-of-sequence token never appears in the answer)
            "min_new_tokens": options.max_tokens if options.ignore_eos else options.min_tokens,
            "pad_token_id": self.pad_id,
            "eos_token_id": self.eos_ids,
        }
        if options.greedy:
            # Greedy answers are all the same (as in vLLM): generate one and repeat it.
            kwargs.update(do_sample=False, num_return_sequences=1, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(
                do_sample=True,
                num_return_sequences=options.n,
                temperature=options.temperature,
                top_p=options.top_p,
                top_k=0,  # OpenAI's sampling has no top-k cut
            )
            if options.seed is not None:
                torch.manual_seed(options.seed)  # only this thread generates
        rows = self.model.generate(ids, **kwargs)[:, len(prompt) :].tolist()
        answers = [self._completion(row, options) for row in rows]
        return answers * options.n if options.greedy else answers

    def _completion(self, row: list[int], options: SamplingOptions) -> Completion:
        ended = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
        tokens = row if ended is None else row[: ended + 1]
        text = self.tokenizer.decode(tokens if ended is None else tokens[:-1], skip_special_tokens=True)
        text, stopped = cut_at_stop(text, options.stop)
        finish: FinishReason = "stop" if ended is not None or stopped else "length"
        return Completion(text=text, num_tokens=len(tokens), finish_reason=finish)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids:
        raise ValueError("the model has no end-of-sequence token (generation_config or tokenizer eos_token)")
    return [int(i) for i in ids]
