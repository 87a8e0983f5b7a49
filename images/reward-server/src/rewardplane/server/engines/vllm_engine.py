"""The vLLM engine: a ``*ForSequenceClassification`` reward model on vLLM's pooling runner
(``AsyncLLM``, token-id prompts, raw head outputs) or, with ``--task generate``, a causal LM on
the generate runner answering chats (an LLM judge); with weight sync through the shared worker
extension (``worker_extension_cls`` + ``collective_rpc``) either way.

Written against vLLM 0.24.0 (the version the reward-server image pins). Needs a CUDA GPU.

Why the pieces look the way they do:

- Scoring holds ``guard.scoring()`` around every encode call of one request, so a request is
  scored by one weights version; vLLM batches concurrent requests itself (continuous batching),
  so there is no batching queue here, unlike the transformers engine.
- ``use_activation=False``: the endpoints apply the activation themselves when asked; a reward
  model wants the raw head output.
- The parameter manifest (pre-receive validation) uses the checkpoint's HF names, read from the
  safetensors headers: vLLM's own parameter names are fused (``qkv_proj``, ``gate_up_proj``), and
  its ``load_weights`` takes HF names and fuses/shards them itself.
- vLLM keeps the score head in fp32 for pooling models by default (``head_dtype``); we set it
  explicitly from ``--head-dtype`` (``hf_overrides``) so both engines hold the same head dtype.
- No request reuses KV blocks cached under older weights: every request carries the weights'
  cache epoch as vLLM's cache salt, and a weight change advances the epoch (``prefix_cache``).
- ``AsyncLLM`` is built in ``start()`` (inside the server's event loop: its ZMQ asyncio sockets
  and output task belong to the loop that uses them); everything the app needs before that
  (``info``, the manifest, the tokenizer) is derived from the checkpoint's config here. A warm-up
  prompt is scored before the server reports healthy.
- Batch limits: vLLM's offline (``LLM``) defaults for the card, not ``AsyncLLM``'s engine-context
  ones (2048 tokens a step made the server 0.37x of offline); chunked prefill off (vLLM 0.24's
  pooling + chunked prefill races; see ``build_engine_args``). Both yield to the user's flags.

Extra vLLM engine arguments (``cfg.extra_engine_args``, i.e. unknown command-line flags with
``--engine vllm``) are parsed with vLLM's own ``AsyncEngineArgs`` parser, so any
``vllm serve`` engine flag works (``--enforce-eager``, ``--max-num-batched-tokens``,
``--attention-backend``, ``--load-format dummy``, ...). Flags the server owns (model, dtype,
max model length, memory fraction, TP size, pooling, worker extension) must be given through the
server's own options; a conflicting value is an error, not silently overridden.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

# vLLM's own types are checked only where vllm is installed (not in CI): the `type: ignore`s for them
# below also name `unused-ignore`, which mypy reports where vllm (and so the error) is absent.
try:  # import-guarded: the vLLM engine needs the `vllm` extra and a CUDA GPU
    from vllm.config import PoolerConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError
except ImportError as _exc:  # pragma: no cover - exercised where vllm is absent (CI)
    raise ImportError(
        "the vLLM engine (--engine vllm) needs the `vllm` package and a CUDA GPU: install it on a GPU "
        "machine with `pip install 'rewardplane[vllm]'`, or use --engine hf (transformers, CPU or GPU). "
        f"Import error: {_exc}"
    ) from _exc

import torch

from rewardplane.protocol import ModelKind, ModelTask, ParamMeta, PoolingType, settings
from rewardplane.protocol.families import vllm_layer_types
from rewardplane.protocol.naming import DEFAULT_HEAD_PATTERNS, is_head_key
from rewardplane.server.config import ServerConfig
from rewardplane.server.engines.checkpoint import checkpoint_files
from rewardplane.server.engines.eager_tasks import start_now
from rewardplane.server.engines.engine import Completion, EngineInfo, SamplingOptions, ServedAdapter
from rewardplane.server.engines.generation import wrong_task
from rewardplane.server.engines.prefix_cache import CacheEpoch
from rewardplane.server.engines.step_tag import check_good_label, step_tag_id
from rewardplane.server.engines.vllm_lora import IN_MEMORY_PATH
from rewardplane.server.engines.vllm_steps import rows_at_tags
from rewardplane.server.errors import BadRequest, ServerError, Unavailable
from rewardplane.server.locking import WeightsGuard
from rewardplane.server.metrics import RequestTimer, ServerMetrics
from rewardplane.server.weight_sync.worker_calls import WorkerCalls, rpc_timeout

log = logging.getLogger(__name__)
T = TypeVar("T")

WORKER_EXTENSION = "rewardplane.server.engines.vllm_worker.RewardWeightSyncExtension"

# Bounds on waits for the engine (seconds). Scoring, long worker calls and sleep/wake are settings
# (--vllm-score-timeout-s, --vllm-rpc-timeout-s, --vllm-sleep-timeout-s; docs/settings.md), for
# very large models and slow links; these are fixed.
SHORT_RPC_TIMEOUT_S = 120.0

# safetensors header dtype codes → wire dtype names (rewardplane.protocol.DTYPE_ITEMSIZE)
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_FLOAT_WIRE = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}

# Engine arguments the server sets from its own options: name → the server option to use instead.
_OWNED_ARGS = {
    "model": "--model",
    "runner": "--task (score: the pooling runner; generate: the generate runner)",
    "worker_extension_cls": "(the reward server installs its own weight-sync extension)",
    "served_model_name": "--served-model-name",
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "tensor_parallel_size": "--tensor-parallel-size",
    "pooler_config": "--pooling",
}


def _vllm_dtype(choice: str) -> str:
    # "auto" means bf16 on CUDA, like the transformers engine (vLLM's own "auto" would follow the
    # checkpoint and could differ between the two engines).
    return "bfloat16" if choice == "auto" else choice


def _head_dtype_override(choice: str) -> str:
    # vLLM reads `head_dtype` from the HF config; "model" = the backbone dtype (our "auto").
    return "model" if choice == "auto" else choice


def parse_extra_engine_args(extra: list[str]) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` fields the user set explicitly in ``extra`` (vLLM's own parser).

    Raises ``ValueError`` (→ the CLI exits 2 with the message) on unknown or invalid flags.
    """
    if not extra:
        return {}
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m rewardplane.server --engine vllm", add_help=False)
    parser = AsyncEngineArgs.add_cli_args(parser)

    def _error(message: str) -> None:  # argparse would sys.exit(2) without a useful context
        raise ValueError(
            f"invalid extra vLLM engine argument(s) {extra}: {message}. Unknown flags with --engine vllm are "
            "passed to vLLM's engine; see `vllm serve --help` for the engine arguments"
        )

    parser.error = _error  # type: ignore[method-assign, unused-ignore]
    defaults = vars(parser.parse_args([]))
    given = vars(parser.parse_args(list(extra)))
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    return {k: v for k, v in given.items() if k in fields and v != defaults.get(k)}


def _pooler_config(cfg: ServerConfig, tag_id: int | None) -> PoolerConfig:
    """A sequence model pools by ``--pooling``. A process reward model classifies tokens: with
    ``--prm-pooling step`` vLLM's STEP pooler keeps the rows at the step tag (``step_tag_id``; vLLM
    then turns prefix caching off: its STEP pooler cannot read cached rows); with ``token`` every
    computed token's row comes back (ALL) and the server selects, which keeps prefix caching on.

    vLLM 0.24 applies STEP to ``Qwen2ForProcessRewardModel`` (its pooler is built from this config),
    but not to a model pooled by ``DispatchPooler.for_seq_cls``, whose token_classify pooler is
    fixed to ALL (fixed after 0.24: vllm-project/vllm#55307); ``rows_at_tags`` refuses a row count
    that is not one per tag, naming ``--prm-pooling token``."""
    if cfg.model_kind != ModelKind.PROCESS:
        return PoolerConfig(pooling_type=cfg.pooling.value.upper())  # type: ignore[arg-type, unused-ignore]
    if cfg.prm_pooling == "step":
        return PoolerConfig(pooling_type="STEP", step_tag_id=tag_id)  # type: ignore[arg-type, unused-ignore]
    return PoolerConfig(pooling_type="ALL")  # type: ignore[arg-type, unused-ignore]


def build_engine_args(
    cfg: ServerConfig,
    max_model_len: int,
    step_tag_id: int | None = None,
    hf_config: dict[str, Any] | None = None,
) -> AsyncEngineArgs:
    """``AsyncEngineArgs`` from the server's options plus the user's extra vLLM flags;
    ``hf_config``: the model's config (``to_dict()``), for what vLLM must be told of it."""
    generate = cfg.task == ModelTask.GENERATE
    base: dict[str, Any] = {
        "model": cfg.model,
        "runner": "generate" if generate else "pooling",
        "worker_extension_cls": WORKER_EXTENSION,
        "served_model_name": cfg.name,
        "dtype": _vllm_dtype(cfg.dtype),
        "max_model_len": max_model_len,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        # Nothing here calls do_log_stats(); collecting unused stats only costs time per step.
        "disable_log_stats": True,
    }
    if getattr(cfg, "enable_sleep_mode", False):
        # vLLM then allocates weights and KV cache through its CuMem allocator (see ServerConfig)
        base["enable_sleep_mode"] = True
    if not generate:
        base["pooler_config"] = _pooler_config(cfg, step_tag_id)
    owned = dict(_OWNED_ARGS)
    if getattr(cfg, "deterministic", False):
        base["enable_prefix_caching"] = False
        owned["enable_prefix_caching"] = "--deterministic (it turns prefix caching off)"
    load_format = getattr(cfg, "load_format", None)  # the server may own --load-format (e.g. dummy)
    if load_format not in (None, "", "auto"):
        base["load_format"] = load_format
        owned["load_format"] = "--load-format"
    if getattr(cfg, "enable_lora", False):
        # Adapter-only sync: pushed adapters are served through vLLM's LoRA support (pooling models
        # included in 0.24). One adapter at a time: each push replaces the previous one.
        base.update(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=1, max_cpu_loras=1)
        owned.update(
            enable_lora="--enable-lora",
            max_lora_rank="--max-lora-rank",
            max_loras="--enable-lora",
            max_cpu_loras="--enable-lora",
        )
    user = parse_extra_engine_args(list(cfg.extra_engine_args))
    for key, value in user.items():
        if key in owned and value != base.get(key):
            raise ValueError(
                f"vLLM engine argument {key!r} is set by the reward server; use {owned[key]} instead of passing "
                f"it as an extra engine argument"
            )
    for key in ("pipeline_parallel_size", "data_parallel_size"):
        if int(user.get(key, 1) or 1) != 1:
            raise ValueError(
                f"{key} must be 1 with the reward server: weight sync ranks one worker per tensor-parallel "
                "shard; run several replicas instead of data parallelism"
            )
    # vLLM picks its batch limits by usage context; AsyncLLM's (ENGINE_CONTEXT) falls back to 2048
    # tokens / 128 sequences a step, which starves a scoring server (prefill only, no decode latency to
    # protect): measured 0.37x of offline on a 0.4B model. Take the offline (LLM class) limits for this
    # hardware unless the user set them.
    tokens, seqs = _throughput_batch_limits(cfg.tensor_parallel_size, max_model_len)
    base.setdefault("max_num_batched_tokens", tokens)
    base.setdefault("max_num_seqs", seqs)
    # Chunked prefill is off unless asked for (--enable-chunked-prefill): in vLLM 0.24 a pooling
    # model's prompt split across steps can race with async scheduling (vllm-project/vllm#48901:
    # wrong scores under torch.compile; #48214, #47971: crashes and silent stalls), and one of
    # exactly max_model_len tokens never gets its last token scheduled (#55427). Our scoring
    # server, and `vllm serve` with its defaults, stalled under load with chunked prefill on
    # (benchmarks/README.md). A reward must be right; whole prompts per step cost little for
    # prompts up to max_model_len.
    # (Generation keeps vLLM's default: the race is in the pooling path, and decoding wants it.)
    if not generate:
        base["enable_chunked_prefill"] = False
    overrides = user.pop("hf_overrides", None) or {}
    if not isinstance(overrides, dict):
        raise ValueError("--hf-overrides must be a JSON object with the reward server")
    overrides = dict(overrides)
    if not generate:  # the score head's dtype; a causal LM's lm_head runs in the model dtype
        overrides.setdefault("head_dtype", _head_dtype_override(cfg.head_dtype))
    layer_types = vllm_layer_types(hf_config or {})
    if layer_types is not None:  # Mistral's sliding window, on every layer as in transformers
        overrides.setdefault("layer_types", layer_types)
    return AsyncEngineArgs(**{**base, **user, "hf_overrides": overrides})


def _throughput_batch_limits(world_size: int, max_model_len: int) -> tuple[int, int]:
    """vLLM's own defaults for offline (``LLM``) use on this hardware: (max_num_batched_tokens,
    max_num_seqs); at least one full-length prompt per step (pooling runs without chunked prefill)."""
    from vllm.usage.usage_lib import UsageContext

    tokens, seqs = AsyncEngineArgs.get_batch_defaults(world_size)
    t = int(tokens.get(UsageContext.LLM_CLASS, 8192))
    return max(t, max_model_len), min(int(seqs.get(UsageContext.LLM_CLASS, 256)), max(t, max_model_len))


def read_manifest(
    model: str,
    config: Any,
    *,
    dtype: str,
    head_dtype: str,
    task: ModelTask = ModelTask.SCORE,
) -> dict[str, ParamMeta]:
    """HF parameter names and shapes of the checkpoint, with the dtypes the server holds them in.

    Read from the safetensors headers (no tensor is loaded). Without safetensors files (e.g.
    ``--load-format dummy`` on a config-only folder, or ``.bin`` checkpoints) the names come from
    the transformers model built on the meta device.
    """

    def served_dtype(name: str, stored: str) -> str:
        if stored not in _FLOAT_WIRE:
            return stored
        return head_dtype if is_head_key(name, DEFAULT_HEAD_PATTERNS) else dtype

    manifest: dict[str, ParamMeta] = {}
    files = checkpoint_files(Path(model)) if Path(model).is_dir() else []
    if files:
        from safetensors import safe_open

        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    sl = f.get_slice(name)
                    stored = _ST_DTYPES.get(str(sl.get_dtype()).upper())
                    if stored is None:
                        log.warning(
                            "parameter %s has dtype %s, which cannot be pushed; left out of the manifest",
                            name,
                            sl.get_dtype(),
                        )
                        continue
                    manifest[name] = ParamMeta(
                        name=name,
                        dtype=served_dtype(name, stored),
                        shape=tuple(int(d) for d in sl.get_shape()),
                    )
        return manifest
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto_cls = AutoModelForCausalLM if task == ModelTask.GENERATE else AutoModelForSequenceClassification
    with torch.device("meta"):
        meta = auto_cls.from_config(config)
    for name, p in meta.state_dict().items():
        stored = str(p.dtype).removeprefix("torch.")
        manifest[name] = ParamMeta(name=name, dtype=served_dtype(name, stored), shape=tuple(p.shape))
    return manifest


class VLLMEngine:
    """``RewardEngine`` on vLLM's pooling runner (``AsyncLLM``), or its generate runner for
    ``--task generate``."""

    def __init__(self, cfg: ServerConfig, metrics: ServerMetrics | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        if cfg.device == "cpu":
            raise ValueError("--engine vllm runs on CUDA GPUs; use --engine hf for --device cpu")
        if cfg.pooling == PoolingType.STEP:
            raise ValueError("--pooling step is not served; use last, mean or cls")
        self.cfg = cfg
        self.metrics = metrics or ServerMetrics()
        self.cache_epoch = CacheEpoch()
        config = AutoConfig.from_pretrained(cfg.model)
        self.task = cfg.task
        generate = cfg.task == ModelTask.GENERATE
        num_labels = 0 if generate else int(getattr(config, "num_labels", 1))
        if not generate and cfg.num_labels is not None and cfg.num_labels != num_labels:
            raise ValueError(
                f"--num-labels {cfg.num_labels} but the checkpoint {cfg.model} has {num_labels} labels; "
                "fix the RewardModel's numLabels or the checkpoint"
            )
        archs = list(getattr(config, "architectures", None) or [])
        if generate and any(a.endswith("ForSequenceClassification") for a in archs):
            raise ValueError(
                f"--task generate needs a causal LM, but {cfg.model} is {archs}: serve it with --task score, "
                "or point --model at a *ForCausalLM checkpoint"
            )
        process = cfg.process
        if process is not None and "Qwen2ForProcessRewardModel" not in archs:
            log.warning(
                "architectures %s are not Qwen2ForProcessRewardModel; vLLM serves process reward models of "
                "that class (a Qwen2 backbone and a two-layer token-classification head)",
                archs,
            )
        elif not generate and archs and not any(a.endswith("ForSequenceClassification") for a in archs):
            log.warning(
                "architectures %s are not *ForSequenceClassification; vLLM will convert the model "
                "to a classifier (--convert classify) and the head may be untrained",
                archs,
            )
        # The same tokenizer as the transformers engine, so /score tokenizes texts identically.
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        max_len = cfg.model_len(config)
        self.step_tag_id = (
            None if process is None else step_tag_id(self.tokenizer, process.step_tag, cfg.model)
        )
        if process is not None:
            check_good_label(process, num_labels, cfg.model)
        self.engine_args = build_engine_args(cfg, max_len, self.step_tag_id, config.to_dict())
        dtype = _vllm_dtype(cfg.dtype)
        # What vLLM will hold: the hf_overrides head_dtype (ours, or the user's --hf-overrides).
        override = (self.engine_args.hf_overrides or {}).get("head_dtype")  # type: ignore[union-attr, unused-ignore]
        head_dtype = (
            dtype if generate or override in (None, "model") else str(override).removeprefix("torch.")
        )
        id2label = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
        self.info = EngineInfo(
            served_model_name=cfg.name,
            engine="vllm",
            num_labels=num_labels,
            dtype=dtype,
            head_dtype=head_dtype,
            max_model_len=max_len,
            vocab_size=int(config.vocab_size),
            # vLLM fixes the pooling method at start
            pooling_types=(PoolingType.STEP,) if process is not None else (cfg.pooling,),
            id2label={} if generate else id2label,
            world_size=cfg.tensor_parallel_size,
            max_lora_rank=cfg.max_lora_rank if cfg.enable_lora else 0,
            task=cfg.task,
            kind=ModelKind.PROCESS if process is not None else ModelKind.SEQUENCE,
            process=process,
            step_tag_id=self.step_tag_id,
        )
        self.manifest = read_manifest(cfg.model, config, dtype=dtype, head_dtype=head_dtype, task=cfg.task)
        if not self.manifest:
            raise ValueError(f"no parameters found in {cfg.model}: expected *.safetensors files or a config")
        self.guard = WeightsGuard()
        self.llm: AsyncLLM | None = None
        # The pushed LoRA adapter every scoring request names (adapter-only sync); None: base alone.
        self.lora_request: Any = None
        self.base_checkpoint = cfg.model if cfg.load_format != "dummy" and Path(cfg.model).is_dir() else None

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self.llm is not None:
            return
        log.info("starting vLLM %s", self.engine_args)
        try:
            # Blocks the loop while vLLM loads and compiles (minutes); nothing is served yet.
            self.llm = AsyncLLM.from_engine_args(self.engine_args)
        except Exception as exc:
            raise RuntimeError(
                f"vLLM failed to start {self.cfg.model} ({type(exc).__name__}: {exc}); it needs a CUDA GPU with "
                f"{self.cfg.gpu_memory_utilization:.0%} of its memory free (--gpu-memory-utilization) — see the "
                "log above for vLLM's own reason"
            ) from exc
        # One tiny request before the server reports healthy: the first inference compiles a few
        # Triton kernels (vLLM logs "JIT compilation during inference"), a stall the first real
        # requests would otherwise pay. A failure here means the engine cannot score: fail the start.
        warmup_ids = [min(1, self.info.vocab_size - 1)] * 16
        try:
            if self.task == ModelTask.GENERATE:
                warmup: Awaitable[Any] = self._generate(
                    self.llm, "rp-warmup", warmup_ids, SamplingOptions(max_tokens=2, temperature=0.0)
                )
            elif self.step_tag_id is not None:
                warmup = self._encode_steps(self.llm, "rp-warmup", [*warmup_ids, self.step_tag_id], [16])
            else:
                warmup = self._encode(self.llm, "rp-warmup", warmup_ids)
            await asyncio.wait_for(warmup, SHORT_RPC_TIMEOUT_S)
        except Exception as exc:
            raise RuntimeError(
                f"vLLM started but could not answer a warm-up prompt: {type(exc).__name__}: {exc}"
            ) from exc
        mc = self.llm.model_config
        if self.task == ModelTask.GENERATE:
            return
        served_head = str(mc.head_dtype).removeprefix("torch.")
        if served_head != self.info.head_dtype or int(mc.max_model_len) != self.info.max_model_len:
            log.warning(
                "vLLM holds head dtype %s / max_model_len %d; the server announced %s / %d",
                served_head,
                mc.max_model_len,
                self.info.head_dtype,
                self.info.max_model_len,
            )

    async def stop(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)

    def _require_llm(self) -> AsyncLLM:
        if self.llm is None:
            raise Unavailable(
                "the vLLM engine is not started yet (or was stopped); retry once /health answers"
            )
        if self.llm.errored:
            raise Unavailable(f"the vLLM engine died ({self.llm.dead_error}); restart this replica")
        return self.llm

    # ---- scoring ---------------------------------------------------------------------------
    async def score(self, prompts: list[list[int]], pooling: PoolingType) -> tuple[list[list[float]], int]:
        if self.task != ModelTask.SCORE:
            raise wrong_task(self.info)
        if pooling not in self.info.pooling_types:
            raise BadRequest(
                f"pooling {pooling.value!r} is not available on this server (vLLM fixes it at start); "
                f"use {self.info.pooling_types[0].value!r} or restart the server with --pooling {pooling.value}"
            )
        if not prompts:
            return [], self.guard.version
        base_id = uuid.uuid4().hex

        def work(llm: AsyncLLM) -> Awaitable[list[list[float]]]:
            return asyncio.gather(
                *start_now(self._encode(llm, f"rp-{base_id}-{i}", ids) for i, ids in enumerate(prompts))
            )

        rows, version = await self._guarded(work, f"scoring {len(prompts)} input(s)")
        return list(rows), version

    async def score_steps(
        self, prompts: list[list[int]], tags: list[list[int]], *, reuse_prefix: bool = False
    ) -> tuple[list[list[list[float]]], int]:
        if self.step_tag_id is None:
            raise BadRequest(
                "this server runs a sequence reward model: step scores need --model-kind process"
            )
        if not prompts:
            return [], self.guard.version
        base_id = uuid.uuid4().hex

        def work(llm: AsyncLLM) -> Awaitable[list[list[list[float]]]]:
            return asyncio.gather(
                *start_now(
                    self._encode_steps(llm, f"rp-{base_id}-{i}", ids, t, reuse_prefix=reuse_prefix)
                    for i, (ids, t) in enumerate(zip(prompts, tags, strict=True))
                )
            )

        rows, version = await self._guarded(work, f"scoring the steps of {len(prompts)} solution(s)")
        return list(rows), version

    async def generate(self, prompt: list[int], options: SamplingOptions) -> tuple[list[Completion], int]:
        if self.task != ModelTask.GENERATE:
            raise wrong_task(self.info)
        request_id = f"rp-gen-{uuid.uuid4().hex}"
        return await self._guarded(
            lambda llm: self._generate(llm, request_id, prompt, options), "answering a chat"
        )

    async def _guarded(self, work: Callable[[AsyncLLM], Awaitable[T]], what: str) -> tuple[T, int]:
        """``work`` under the weights lock (one weights version for all of it), bounded in time, with
        vLLM's errors turned into answers."""
        llm = self._require_llm()
        timeout = settings.VLLM_SCORE_TIMEOUT_S.get()
        with RequestTimer(self.metrics) as timer:
            async with self.guard.scoring() as version:
                timer.start()
                try:
                    result = await asyncio.wait_for(work(llm), timeout)
                except TimeoutError as exc:  # wait_for cancelled the requests; vLLM aborts them
                    raise Unavailable(
                        f"{what} took longer than {timeout:.0f}s (--vllm-score-timeout-s, "
                        f"{settings.VLLM_SCORE_TIMEOUT_S.name}); the replica is overloaded — retry or send less"
                    ) from exc
                except EngineDeadError as exc:
                    raise Unavailable(f"the vLLM engine died ({exc}); restart this replica") from exc
                except ValueError as exc:  # vLLM's request validation (length, token ids, ...)
                    raise BadRequest(f"vLLM rejected the input: {exc}") from exc
                except ServerError:
                    raise
                except Exception as exc:
                    raise ServerError(f"vLLM failed {what}: {type(exc).__name__}: {exc}") from exc
        return result, version

    async def _generate(
        self, llm: AsyncLLM, request_id: str, ids: list[int], options: SamplingOptions
    ) -> list[Completion]:
        params = SamplingParams(
            n=1 if options.greedy else options.n,  # vLLM refuses greedy with n > 1: repeat instead
            temperature=options.temperature,
            top_p=options.top_p,
            seed=options.seed,
            stop=list(options.stop) or None,
            max_tokens=options.max_tokens,
            min_tokens=options.min_tokens,
            ignore_eos=options.ignore_eos,
            output_kind=RequestOutputKind.FINAL_ONLY,  # one output at the end, every choice in it
        )
        final = None
        async for out in llm.generate(_token_prompt(ids, self.cache_epoch.salt()), params, request_id):
            final = out
        if final is None or not final.outputs:
            raise ServerError(f"vLLM returned no output for request {request_id}")
        answers = [
            Completion(
                text=o.text,
                num_tokens=len(o.token_ids),
                finish_reason="length" if o.finish_reason == "length" else "stop",
            )
            for o in sorted(final.outputs, key=lambda o: o.index)
        ]
        return answers * options.n if options.greedy else answers

    async def _pooled(
        self, llm: AsyncLLM, request_id: str, ids: list[int], params: PoolingParams
    ) -> torch.Tensor:
        """vLLM's pooled output of one token-id prompt, on the CPU in fp32."""
        final = None
        async for out in llm.encode(
            _token_prompt(ids, self.cache_epoch.salt()), params, request_id, lora_request=self.lora_request
        ):
            final = out
        if final is None:
            raise ServerError(f"vLLM returned no output for request {request_id}")
        return final.outputs.data.float().cpu()

    async def _encode(self, llm: AsyncLLM, request_id: str, ids: list[int]) -> list[float]:
        # A fresh PoolingParams per request: vLLM fills defaults into it during validation.
        params = PoolingParams(task="classify", use_activation=False)
        data = await self._pooled(llm, request_id, ids, params)
        return [float(v) for v in data.reshape(-1).tolist()]

    async def _encode_steps(
        self, llm: AsyncLLM, request_id: str, ids: list[int], tags: list[int], *, reuse_prefix: bool = False
    ) -> list[list[float]]:
        """The raw head rows at ``tags`` (token classification). With ``--prm-pooling token`` and
        ``reuse_prefix``, the prompt may start from cached KV blocks: vLLM then returns rows only for
        the tokens it computed (the prompt's tail); when a wanted tag lies in the cached part, the
        prompt is scored again without reading the cache."""
        step_pooler = self.cfg.prm_pooling == "step"
        read_cache = reuse_prefix and not step_pooler  # vLLM's STEP pooler cannot read cached rows
        params = PoolingParams(
            task="token_classify", use_activation=False, skip_reading_prefix_cache=not read_cache
        )
        data = await self._pooled(llm, request_id, ids, params)
        assert self.step_tag_id is not None  # score_steps checked
        rows = rows_at_tags(data.tolist(), ids, tags, tag_id=self.step_tag_id, selected=step_pooler)
        if rows is None:  # a wanted tag was in the cached prefix: compute the whole prompt
            return await self._encode_steps(llm, f"{request_id}-full", ids, tags)
        return rows

    # ---- sleep and wake (vLLM's sleep mode) ----------------------------------------------------
    def sleep_problem(self) -> str | None:
        if not self.engine_args.enable_sleep_mode:
            return (
                "this vLLM server was started without sleep mode: restart it with --enable-sleep-mode "
                "(RewardModel spec.engine.extraArgs: [--enable-sleep-mode]), which vLLM needs to release its GPU memory"
            )
        return None

    async def _free_bytes(self) -> int | None:
        """Free GPU memory summed over the workers' devices (None when a worker cannot tell)."""
        try:
            free = await WorkerCalls(self.weight_port()).cuda_free_bytes()
        except Exception:
            log.warning("could not read the workers' free GPU memory", exc_info=True)
            return None
        known = [f for f in free if f is not None]
        return sum(known) if len(known) == len(free) else None

    async def sleep(self, level: int) -> int | None:
        llm = self._require_llm()
        before = await self._free_bytes()
        # Called under the exclusive weights lock: none of our requests runs, so vLLM's default
        # pause mode (abort what runs) aborts nothing.
        await asyncio.wait_for(llm.sleep(level), settings.VLLM_SLEEP_TIMEOUT_S.get())  # copies the weights
        after = await self._free_bytes()
        return after - before if before is not None and after is not None else None

    async def wake(self, level: int) -> None:
        llm = self._require_llm()
        # All tags at once (weights, KV cache): vLLM resumes scheduling once everything is back.
        await asyncio.wait_for(llm.wake_up(), settings.VLLM_SLEEP_TIMEOUT_S.get())

    # ---- weight sync -----------------------------------------------------------------------
    def weight_port(self) -> VLLMWeightPort:
        return VLLMWeightPort(self)


class VLLMWeightPort:
    """``WeightSyncPort`` over vLLM: ``collective_rpc`` into the worker extension of every GPU
    worker, and vLLM's prefix cache. Scoring and these calls meet only in vLLM's engine process."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine

    def manifest(self) -> dict[str, ParamMeta]:
        return self.engine.manifest

    async def call_workers(self, method: str, *args: Any) -> list[Any]:
        llm = self.engine._require_llm()
        timeout = rpc_timeout(method, args, SHORT_RPC_TIMEOUT_S)
        try:
            results = await asyncio.wait_for(llm.collective_rpc(method, args=tuple(args)), timeout)
        except TimeoutError as exc:
            raise RuntimeError(
                f"worker call {method} did not finish within {timeout:.0f}s (--vllm-rpc-timeout-s, "
                f"{settings.VLLM_RPC_TIMEOUT_S.name})"
            ) from exc
        return list(results)

    def use_adapter(self, adapter: ServedAdapter | None) -> None:
        from vllm.lora.request import LoRARequest

        self.engine.lora_request = (
            None
            if adapter is None
            else LoRARequest(
                lora_name=adapter.name,
                lora_int_id=adapter.adapter_id,
                lora_path=adapter.path or IN_MEMORY_PATH,
            )
        )

    async def reset_cache(self) -> None:
        self.engine.cache_epoch.weights_changed()  # salted: new requests miss the old blocks


def _token_prompt(ids: list[int], cache_salt: str | None) -> Any:
    """A token-id prompt in the form vLLM 0.24 takes without re-processing (``tokens_input``)."""
    try:
        from vllm.inputs import tokens_input
    except ImportError:  # older layouts: the (deprecated there) raw prompt dict still works
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(ids))
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        return prompt
    return tokens_input(list(ids), cache_salt=cache_salt)
