"""The transformers engine: ``AutoModelForSequenceClassification`` (a process reward model: token
classification, ``prm_model``) on CPU or CUDA, with dynamic batching of concurrent requests
(length-sorted micro-batches under a padded-token budget)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rewardplane.protocol import ModelKind, ParamMeta, PoolingType
from rewardplane.server.config import ServerConfig
from rewardplane.server.engines.batching import plan_micro_batches
from rewardplane.server.engines.engine import Completion, EngineInfo, SamplingOptions, ServedAdapter
from rewardplane.server.engines.generation import wrong_task
from rewardplane.server.engines.prm_model import process_model_class
from rewardplane.server.engines.step_tag import check_good_label
from rewardplane.server.engines.step_tag import step_tag_id as tag_id_of
from rewardplane.server.errors import BadRequest
from rewardplane.server.locking import WeightsGuard
from rewardplane.server.metrics import RequestTimer, ServerMetrics
from rewardplane.server.threads import run_in_daemon_thread
from rewardplane.server.weight_sync.worker_extension import HFWeightSyncWorker

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    return torch.device(choice)


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[choice]


def load_checkpoint(cfg: ServerConfig, auto_cls: Any) -> tuple[torch.device, torch.dtype, Any, Any]:
    """The device, dtype, tokenizer and model (as ``auto_cls``, an ``AutoModelFor...``) of ``cfg``."""
    from transformers import AutoTokenizer

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    return device, dtype, tokenizer, load_model(auto_cls, cfg, device, dtype)


def load_model(auto_cls: Any, cfg: ServerConfig, device: torch.device, dtype: torch.dtype) -> Any:
    """The checkpoint as ``auto_cls``, in eval mode on ``device``."""
    from transformers import AutoConfig

    if cfg.load_format == "dummy":  # random weights, built directly on the device (fast for large models)
        with device:
            model = auto_cls.from_config(AutoConfig.from_pretrained(cfg.model), dtype=dtype)
    else:
        model = auto_cls.from_pretrained(cfg.model, dtype=dtype)
    model.eval().requires_grad_(False)
    return model.to(device)


@dataclass
class _Pending:
    prompts: list[list[int]]
    pooling: PoolingType  # STEP: rows at the step tags ``tags`` of each prompt
    future: asyncio.Future[tuple[list[Any], int]]
    timer: RequestTimer
    tags: list[list[int]] | None = None


class HFEngineBase:
    """What both transformers engines (scoring here, generation in ``hf_generate``) share: the
    checkpoint loaded as ``auto_cls`` (an ``AutoModelFor...``), the one thread their forwards run
    on (``thread_name``; sleep and wake run there too, so never beside a forward), the weights
    lock, sleep, wake and the weight-sync port."""

    def __init__(
        self, cfg: ServerConfig, metrics: ServerMetrics | None, auto_cls: Any, thread_name: str
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics or ServerMetrics()
        self.device, self.dtype, self.tokenizer, self.model = load_checkpoint(cfg, auto_cls)
        self.max_model_len = cfg.model_len(self.model.config)
        self.guard = WeightsGuard()
        self.base_checkpoint = cfg.model if cfg.load_format != "dummy" else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._params = dict(self.model.named_parameters())
        self._sleep_shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}

    # ---- sleep and wake --------------------------------------------------------------------
    # Level 1 moves the parameters to host memory (on a CPU device they are there already: nothing
    # is freed); level 2 discards them (each keeps an empty tensor; its shape is remembered here)
    # and a wake allocates them again on the device, uninitialised, for ``sleep.SleepService`` to
    # reload. The Parameter objects stay the same (only ``.data`` changes), so the weight-sync
    # worker's references stay valid. Buffers (rotary frequencies, ...) are small and stay put.
    def sleep_problem(self) -> str | None:
        return None

    def _device_bytes(self) -> int:
        # by type: the engine's device is "cuda", a parameter's "cuda:0"
        on_device = (p for p in self._params.values() if p.device.type == self.device.type)
        return sum(p.numel() * p.element_size() for p in on_device)

    async def sleep(self, level: int) -> int | None:
        def run() -> int:
            before = self._device_bytes()
            with torch.no_grad():
                for p in self._params.values():
                    if level == 2:
                        self._sleep_shapes[id(p)] = (p.shape, p.dtype)
                        p.data = torch.empty(0, dtype=p.dtype, device=self.device)
                    else:
                        p.data = p.data.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # hand the freed blocks back to the driver, for the actor
            return before - self._device_bytes()

        return await asyncio.get_running_loop().run_in_executor(self._pool, run)

    async def wake(self, level: int) -> None:
        def run() -> None:
            with torch.no_grad():
                for p in self._params.values():
                    if id(p) in self._sleep_shapes:
                        shape, dtype = self._sleep_shapes[id(p)]
                        p.data = torch.empty(shape, dtype=dtype, device=self.device)
                    else:
                        p.data = p.data.to(self.device)
            self._sleep_shapes.clear()

        await asyncio.get_running_loop().run_in_executor(self._pool, run)

    # ---- weight sync -----------------------------------------------------------------------
    def weight_port(self) -> HFWeightPort:
        return HFWeightPort(HFWeightSyncWorker(self.model, self.device))


class HFEngine(HFEngineBase):
    """Runs the model in a worker thread; one asyncio task forms batches from whatever is queued.

    All items of one request are scored in one round, under one hold of the weights lock, so a
    request never straddles a weight update.
    """

    def __init__(self, cfg: ServerConfig, metrics: ServerMetrics | None = None) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        process = cfg.process
        auto_cls = (
            AutoModelForSequenceClassification
            if process is None
            else process_model_class(AutoConfig.from_pretrained(cfg.model))
        )
        super().__init__(cfg, metrics, auto_cls, "rp-forward")
        model, dtype = self.model, self.dtype
        num_labels = int(model.config.num_labels)
        if cfg.num_labels is not None and cfg.num_labels != num_labels:
            raise ValueError(
                f"--num-labels {cfg.num_labels} but the checkpoint {cfg.model} has {num_labels} labels; "
                "fix the RewardModel's numLabels or the checkpoint"
            )
        if self.tokenizer.pad_token_id is None:
            # Batching needs a pad id; padding is masked, so any id works.
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.pad_id = int(self.tokenizer.pad_token_id or 0)

        # Decoder reward models (Llama, Qwen2, Mistral, ...) have a base model plus a linear `score`
        # head: pool the base model's hidden states ourselves (last/mean/cls) and run the head in
        # its own dtype (fp32 by default, like vLLM). Other heads run through the model's forward.
        self.head: torch.nn.Linear | None = getattr(model, "score", None)
        self.base = getattr(model, model.base_model_prefix, None) if self.head is not None else None
        if not isinstance(self.head, torch.nn.Linear) or self.base is None:
            self.head, self.base = None, None
        head_dtype = dtype
        if self.head is not None and cfg.head_dtype != "auto":
            head_dtype = _DTYPES[cfg.head_dtype]
            self.head.to(head_dtype)
        pooling_types = (
            (PoolingType.LAST, PoolingType.MEAN, PoolingType.CLS)
            if self.head is not None
            else (PoolingType.LAST,)
        )
        step_tag_id = None
        if process is not None:
            step_tag_id = tag_id_of(self.tokenizer, process.step_tag, cfg.model)
            check_good_label(process, num_labels, cfg.model)
            pooling_types = (PoolingType.STEP,)
            prm_head = getattr(model, "score", None) or getattr(model, "classifier", None)
            if isinstance(prm_head, torch.nn.Module) and cfg.head_dtype != "auto":
                head_dtype = _DTYPES[cfg.head_dtype]  # the head in its own dtype, as vLLM holds it
                prm_head.to(head_dtype)
        id2label = {int(k): str(v) for k, v in (getattr(model.config, "id2label", None) or {}).items()}
        self.info = EngineInfo(
            served_model_name=cfg.name,
            engine="hf",
            num_labels=num_labels,
            dtype=str(dtype).removeprefix("torch."),
            head_dtype=str(head_dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            vocab_size=int(model.config.vocab_size),
            pooling_types=pooling_types,
            id2label=id2label,
            max_lora_rank=cfg.max_lora_rank if cfg.enable_lora else 0,
            kind=ModelKind.PROCESS if process is not None else ModelKind.SEQUENCE,
            process=process,
            step_tag_id=step_tag_id,
        )
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.create_task(self._run(), name="hf-engine-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- scoring ---------------------------------------------------------------------------
    async def score(self, prompts: list[list[int]], pooling: PoolingType) -> tuple[list[list[float]], int]:
        if pooling not in self.info.pooling_types or pooling == PoolingType.STEP:
            raise BadRequest(
                f"pooling {pooling.value!r} is not available for this model; "
                f"use one of {[p.value for p in self.info.pooling_types]}"
            )
        return await self._submit(prompts, pooling, None)

    async def score_steps(
        self, prompts: list[list[int]], tags: list[list[int]], *, reuse_prefix: bool = False
    ) -> tuple[list[list[list[float]]], int]:
        # no prefix cache here: every forward computes the whole prompt
        return await self._submit(prompts, PoolingType.STEP, tags)

    async def _submit(
        self, prompts: list[list[int]], pooling: PoolingType, tags: list[list[int]] | None
    ) -> tuple[list[Any], int]:
        if not prompts:
            return [], self.guard.version
        fut: asyncio.Future[tuple[list[Any], int]] = asyncio.get_running_loop().create_future()
        with RequestTimer(self.metrics) as timer:  # finished however it ends: answered, failed, cancelled
            await self._queue.put(_Pending(prompts, pooling, fut, timer, tags))
            return await fut

    async def _run(self) -> None:
        while True:
            first = await self._queue.get()
            if self.cfg.batch_wait_ms > 0:
                await asyncio.sleep(self.cfg.batch_wait_ms / 1000)  # let concurrent requests join
            round_ = [first]
            while not self._queue.empty():
                round_.append(self._queue.get_nowait())
            round_ = [p for p in round_ if not p.future.done()]
            if not round_:
                continue
            try:
                async with self.guard.scoring() as version:
                    for p in round_:
                        p.timer.start()
                    results = await self._score_round(round_)
            except Exception as exc:  # every waiting request learns why, none hangs
                for p in round_:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, rows in zip(round_, results, strict=True):
                if not p.future.done():
                    p.future.set_result((rows, version))

    async def _score_round(self, round_: list[_Pending]) -> list[list[Any]]:
        loop = asyncio.get_running_loop()
        out: list[list[Any]] = [[[] for _ in p.prompts] for p in round_]
        by_pooling: dict[PoolingType, list[tuple[int, int, list[int], list[int]]]] = {}
        for ri, p in enumerate(round_):
            for ii, ids in enumerate(p.prompts):
                tags = p.tags[ii] if p.tags is not None else []
                by_pooling.setdefault(p.pooling, []).append((ri, ii, ids, tags))
        for pooling, items in by_pooling.items():
            plan = plan_micro_batches(
                [len(ids) for _, _, ids, _ in items],
                max_tokens=self.cfg.max_batch_tokens,
                max_items=self.cfg.max_batch_items,
            )
            for batch in plan:
                ids_list = [items[i][2] for i in batch]
                rows: list[Any]
                if pooling == PoolingType.STEP:
                    tags_list = [items[i][3] for i in batch]
                    rows = await loop.run_in_executor(self._pool, self.forward_steps, ids_list, tags_list)
                else:
                    rows = await loop.run_in_executor(self._pool, self.forward, ids_list, pooling)
                self.metrics.batch_items.observe(len(batch))
                self.metrics.batch_tokens.observe(len(batch) * max(len(x) for x in ids_list))
                for i, row in zip(batch, rows, strict=True):
                    ri, ii, _, _ = items[i]
                    out[ri][ii] = row
        return out

    def _padded(self, ids_list: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A right-padded batch: input ids, attention mask, lengths (on the device)."""
        lengths = torch.tensor([len(x) for x in ids_list], device=self.device)
        width = int(lengths.max())
        input_ids = torch.full((len(ids_list), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids_list), width), dtype=torch.long)
        for row, ids in enumerate(ids_list):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        return input_ids.to(self.device), mask.to(self.device), lengths

    @torch.inference_mode()
    def forward_steps(self, ids_list: list[list[int]], tags_list: list[list[int]]) -> list[list[list[float]]]:
        """A process reward model's raw head rows at each prompt's step tags (token classification)."""
        input_ids, mask, _ = self._padded(ids_list)
        logits = self.model(input_ids=input_ids, attention_mask=mask).logits.float().cpu()
        return [logits[row, tags].tolist() for row, tags in enumerate(tags_list)]

    @torch.inference_mode()
    def forward(
        self, ids_list: list[list[int]], pooling: PoolingType = PoolingType.LAST
    ) -> list[list[float]]:
        """Raw head outputs for token-id prompts (right-padded batch)."""
        input_ids, mask, lengths = self._padded(ids_list)
        if self.head is None or self.base is None:  # both set or neither (__init__)
            logits = self.model(input_ids=input_ids, attention_mask=mask).logits
        else:
            hidden = self.base(input_ids=input_ids, attention_mask=mask).last_hidden_state
            if pooling == PoolingType.LAST:
                pooled = hidden[torch.arange(hidden.shape[0], device=self.device), lengths - 1]
            elif pooling == PoolingType.MEAN:
                m = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * m).sum(1) / m.sum(1)
            else:  # CLS: the first token
                pooled = hidden[:, 0]
            logits = self.head(pooled.to(self.head.weight.dtype))
        return logits.float().cpu().tolist()

    async def generate(self, prompt: list[int], options: SamplingOptions) -> tuple[list[Completion], int]:
        raise wrong_task(self.info)


class HFWeightPort:
    """``WeightSyncPort`` over the worker extension hosted in this process. Each call runs on a
    daemon thread of its own: a receive or a join blocks on collectives for as long as the trainer
    takes, and must hold neither the event loop nor the thread that runs forwards."""

    def __init__(self, worker: HFWeightSyncWorker) -> None:
        self.worker = worker

    def manifest(self) -> dict[str, ParamMeta]:
        return self.worker.manifest()

    async def call_workers(self, method: str, *args: Any) -> list[Any]:
        return [await run_in_daemon_thread(getattr(self.worker, method), *args, name=f"rp-control-{method}")]

    def use_adapter(self, adapter: ServedAdapter | None) -> None:
        """Nothing to switch: the worker's forward hooks (``lora_hooks``) are the adapter."""

    async def reset_cache(self) -> None:
        """No cache: every forward recomputes from the current weights."""
