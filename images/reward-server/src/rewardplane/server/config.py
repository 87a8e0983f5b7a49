"""Server configuration: one pydantic model, filled from the command line."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from rewardplane.protocol import (
    DEFAULT_HTTP_PORT,
    DEFAULT_STEP_SEPARATOR,
    ModelKind,
    ModelTask,
    PoolingType,
    ProcessRewardConfig,
    StepAggregation,
    settings,
)

# ServerConfig fields whose flag falls back to a setting's environment variable.
SETTING_FLAGS: dict[str, settings.Setting[Any]] = {
    "staging_max_bytes": settings.STAGING_MAX_BYTES,
    "adapter_dir": settings.ADAPTER_DIR,
    "vllm_score_timeout_s": settings.VLLM_SCORE_TIMEOUT_S,
    "vllm_rpc_timeout_s": settings.VLLM_RPC_TIMEOUT_S,
    "vllm_sleep_timeout_s": settings.VLLM_SLEEP_TIMEOUT_S,
    "max_join_timeout_s": settings.MAX_JOIN_TIMEOUT_S,
}


class ServerConfig(BaseModel):
    model: str
    engine: Literal["hf", "vllm"] = "hf"
    task: ModelTask = ModelTask.SCORE
    # A process reward model (kind process): the step tag placed after each step, the separator of a
    # solution sent as one text, the head's good label and the default aggregate of the steps.
    model_kind: ModelKind = ModelKind.SEQUENCE
    step_tag: str | None = None
    step_separator: str = DEFAULT_STEP_SEPARATOR
    good_label: int = Field(default=1, ge=0)
    step_aggregation: StepAggregation | None = None
    # vLLM: select the step rows in vLLM's STEP pooler ("step") or take every token's row and select
    # on the server ("token"), for a vLLM whose STEP pooling does not apply to the model's head.
    prm_pooling: Literal["step", "token"] = "step"
    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_HTTP_PORT, ge=1, le=65535)
    served_model_name: str | None = None
    model_aliases: list[str] = Field(default_factory=list)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    head_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(default=None, ge=1)
    max_items_per_request: int = Field(default=1024, ge=1)
    max_input_bytes: int | None = Field(default=None, ge=1)
    max_request_bytes: int = Field(default=64 << 20, ge=1024)
    graceful_shutdown_s: int = Field(default=10, ge=0)
    max_batch_tokens: int = Field(default=16384, ge=1)
    max_batch_items: int = Field(default=256, ge=1)
    batch_wait_ms: float = Field(default=2.0, ge=0)
    pooling: PoolingType = PoolingType.LAST
    num_labels: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    tensor_parallel_size: int = Field(default=1, ge=1)
    token: str | None = None
    token_file: Path | None = None
    weights_dir: Path | None = None
    load_format: Literal["auto", "dummy"] = "auto"
    enable_sleep_mode: bool = False
    # Batch-invariant scores: one text scores bit-identically whatever it is batched with (vLLM's
    # VLLM_BATCH_INVARIANT kernels; prefix caching off, since a cached prefix is computed by other
    # kernels than a whole prompt and shifts the score). Costs throughput: benchmarks/README.md.
    deterministic: bool = False
    require_admission: bool = False
    log_level: str = "info"
    extra_engine_args: list[str] = Field(default_factory=list)
    # Adapter-only weight sync (training_mode adapter): serve pushed LoRA adapters over the base.
    enable_lora: bool = False
    max_lora_rank: int = Field(default=16, ge=1)
    # Operational settings: a flag, else its environment variable (None: the environment decides;
    # docs/settings.md). ``export_settings`` hands them to the engine and its worker processes
    # through the environment they read them from (and inherit).
    staging_max_bytes: int | None = Field(default=None, ge=0)
    adapter_dir: Path | None = None
    vllm_score_timeout_s: float | None = Field(default=None, gt=0)
    vllm_rpc_timeout_s: float | None = Field(default=None, gt=0)
    vllm_sleep_timeout_s: float | None = Field(default=None, gt=0)
    max_join_timeout_s: float | None = Field(default=None, gt=0)

    def export_settings(self) -> None:
        """Write the settings given as flags into this process's environment, before the engine
        starts (vLLM's worker processes inherit it); unset ones keep the environment's value."""
        for field, setting in SETTING_FLAGS.items():
            value = getattr(self, field)
            if value is not None:
                setting.export(value)
        if self.deterministic:  # read by vLLM's engine core and workers, which inherit it
            os.environ[VLLM_BATCH_INVARIANT] = "1"

    @property
    def process(self) -> ProcessRewardConfig | None:
        """How this server marks and combines steps; None unless it serves a process reward model."""
        if self.model_kind != ModelKind.PROCESS:
            return None
        assert self.step_tag is not None  # parse_args requires it with --model-kind process
        return ProcessRewardConfig(
            step_tag=self.step_tag,
            step_separator=self.step_separator,
            good_label=self.good_label,
            aggregation=self.step_aggregation,
        )

    @property
    def name(self) -> str:
        return self.served_model_name or "reward-model"

    def model_len(self, hf_config: Any) -> int:
        """``--max-model-len``, else the checkpoint's context (4096 where its config names none)."""
        return self.max_model_len or int(getattr(hf_config, "max_position_embeddings", 0) or 4096)


VLLM_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"
"""vLLM's switch for its batch-invariant kernels (``--deterministic``)."""


def _from_env(setting: settings.Setting[Any]) -> str:
    return f"default: ${setting.name}, else {setting.shown_default}"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default after its help, where it has one to show (None: another source decides,
    which the help then names)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action) or ""


PASS_THROUGH = (
    "Any flag not listed here goes to vLLM's engine (--engine vllm only), e.g. --max-num-seqs 512 or\n"
    "--enable-chunked-prefill: vLLM's own flags, after the server's. The transformers engine refuses\n"
    "unknown flags."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rewardplane.server",
        description="Reward-model server: scoring endpoints plus an authenticated weight-sync control plane.",
        epilog=PASS_THROUGH,
        formatter_class=_HelpFormatter,
    )
    _model_args(p.add_argument_group("model"))
    _engine_args(p.add_argument_group("engine"))
    _http_args(p.add_argument_group("HTTP and limits"))
    _weight_sync_args(p.add_argument_group("weight sync (the token-protected control plane)"))
    _operational_args(p.add_argument_group("operational settings (each also an environment variable)"))
    return p


def _model_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--model", required=True, help="HF checkpoint folder (or a hub id, where the hub is reachable)"
    )
    g.add_argument(
        "--task",
        choices=[t.value for t in ModelTask],
        default=ModelTask.SCORE.value,
        help="score: a score head (the scoring endpoints); generate: a causal LM answering "
        "/v1/chat/completions (an LLM judge)",
    )
    g.add_argument(
        "--model-kind",
        choices=[k.value for k in ModelKind],
        default=ModelKind.SEQUENCE.value,
        help="sequence: one score per text; process: a process reward model scoring each step of a "
        "solution (needs --step-tag)",
    )
    g.add_argument(
        "--step-tag",
        default=None,
        help="process models: the token after each step (Qwen2.5-Math-PRM: <extra_0>)",
    )
    g.add_argument(
        "--step-separator",
        default=None,
        help="process models: what separates the steps of a solution sent as one text (default: a blank line)",
    )
    g.add_argument(
        "--good-label",
        type=int,
        default=None,
        help="process models: the head's label of a good step (default 1)",
    )
    g.add_argument(
        "--step-aggregation",
        choices=[a.value for a in StepAggregation],
        default=None,
        help="process models: how step scores become one score per solution (default none: /score answers "
        "the step scores, and one-number routes such as /get_reward are refused)",
    )
    g.add_argument(
        "--prm-pooling",
        choices=["step", "token"],
        default=None,
        help="process models on vLLM: step = vLLM's STEP pooler selects the tag rows (default); token = "
        "every token's row comes back and the server selects",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients send as `model`; the first is the one answers carry, as in vLLM "
        "(default: reward-model)",
    )
    g.add_argument(
        "--model-alias",
        dest="model_aliases",
        action="extend",
        nargs="+",
        default=None,
        help="more names this server answers to (requests may also name the --model path or id)",
    )
    g.add_argument(
        "--pooling",
        choices=[t.value for t in PoolingType if t != PoolingType.STEP],
        default=None,
        help="which token's hidden state the score head reads (default: last)",
    )
    g.add_argument("--num-labels", type=int, default=None, help="expected labels; start fails on a mismatch")
    g.add_argument(
        "--max-model-len", type=int, default=None, help="max tokens per input (default: the model's)"
    )
    g.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: random weights from the checkpoint's config (benchmarks; weights then come by push)",
    )


def _engine_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--engine", choices=["hf", "vllm"], default="hf", help="transformers (CPU/GPU) or vLLM (GPU)"
    )
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="backbone dtype; auto = bfloat16 on CUDA, float32 on CPU",
    )
    g.add_argument(
        "--head-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of the score head (float32 like vLLM's pooling models; auto = backbone dtype)",
    )
    g.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="transformers engine: auto = cuda if present",
    )
    g.add_argument(
        "--max-batch-tokens", type=int, default=16384, help="padded-token budget of one micro-batch"
    )
    g.add_argument("--max-batch-items", type=int, default=256, help="inputs in one micro-batch at most")
    g.add_argument("--batch-wait-ms", type=float, default=2.0, help="how long a batch waits for company")
    g.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="vLLM: share of the GPU it may use"
    )
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM: GPUs one replica spans")
    g.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="batch-invariant scores: a text scores bit-identically in any batch, at any position "
        "(vLLM's VLLM_BATCH_INVARIANT=1, prefix caching off; --engine vllm only; costs throughput; "
        "$REWARDPLANE_DETERMINISTIC_GEMM picks the linear layers' matmul)",
    )
    g.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        default=None,
        help="vLLM engine: make POST /sleep possible (vLLM's sleep mode). Its cost: vLLM allocates the "
        "weights and KV cache through its CuMem allocator (CUDA virtual memory), which slows start-up "
        "a little; level 1 needs host memory for a copy of the weights while asleep. The transformers "
        "engine can always sleep.",
    )
    g.add_argument("--log-level", default="info", help="debug, info, warning or error")


def _http_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: 127.0.0.1 takes connections from this machine only; 0.0.0.0 (or "
        "this machine's address) lets trainers on other hosts score and push",
    )
    g.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP port")
    g.add_argument(
        "--max-items-per-request",
        type=int,
        default=1024,
        help="inputs one scoring request may carry (more: 400); /model_info names it and the SDK "
        "splits its batches to it",
    )
    g.add_argument(
        "--max-input-bytes",
        type=int,
        default=None,
        help="largest text (UTF-8 bytes) taken before tokenizing (default: 32 bytes per token of --max-model-len)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=64 << 20,
        help="largest request body in bytes; larger ones get 413 before they are parsed",
    )
    g.add_argument(
        "--graceful-shutdown-s",
        type=int,
        default=10,
        help="on SIGTERM, how long requests in flight may finish before the server exits",
    )
    g.add_argument(
        "--require-admission",
        action="store_true",
        default=None,
        help="take traffic (GET /ready 200, scoring) only once admitted through POST /admission at the "
        "weights version served; the operator starts every replica so, which keeps a restarted container "
        "(back on its base weights) out of the Service until its version is the model's",
    )


def _weight_sync_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help=f"control-plane bearer token file (default: ${settings.TOKEN_FILE.name}, else "
        f"${settings.TOKEN.name}; without a token every push is refused)",
    )
    g.add_argument(
        "--weights-dir",
        type=Path,
        default=None,
        help="where pushed weights are persisted, so a restarted replica can be restored (default: not kept)",
    )
    g.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="accept adapter-only pushes (LoRA A/B tensors), served as a LoRA adapter over untouched base "
        "weights (RewardModel spec.lora.enabled)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="largest LoRA rank an adapter push may have (default 16; vLLM takes 1, 8, 16, 32, 64, 128, 256, "
        "320 or 512 and sizes its LoRA buffers by it)",
    )


def _operational_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--staging-max-bytes",
        type=int,
        default=None,
        help="a cap on what one atomic push may stage on this server, e.g. to bound host memory on a CPU "
        f"server ({_from_env(settings.STAGING_MAX_BYTES)}: the device's free memory decides)",
    )
    g.add_argument(
        "--adapter-dir",
        type=Path,
        default=None,
        help="where the workers write pushed LoRA adapters when vLLM loads them from a directory "
        f"({_from_env(settings.ADAPTER_DIR)})",
    )
    g.add_argument(
        "--vllm-score-timeout-s",
        type=float,
        default=None,
        help=f"vLLM engine: bound on one scoring or generation call ({_from_env(settings.VLLM_SCORE_TIMEOUT_S)})",
    )
    g.add_argument(
        "--vllm-rpc-timeout-s",
        type=float,
        default=None,
        help="vLLM engine: backstop on a long worker call, e.g. a push's receive "
        f"({_from_env(settings.VLLM_RPC_TIMEOUT_S)})",
    )
    g.add_argument(
        "--vllm-sleep-timeout-s",
        type=float,
        default=None,
        help=f"vLLM engine: bound on /sleep and /wake ({_from_env(settings.VLLM_SLEEP_TIMEOUT_S)})",
    )
    g.add_argument(
        "--max-join-timeout-s",
        type=float,
        default=None,
        help="the largest timeout_s a join of a trainer's group (POST /init_communicator) may ask for; "
        f"a join that has not formed by its timeout_s is abandoned ({_from_env(settings.MAX_JOIN_TIMEOUT_S)})",
    )


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    _check(p, args, extra)
    served = args.served_model_name or []
    args.served_model_name = served[0] if served else None
    args.model_aliases = served[1:] + (args.model_aliases or [])
    return ServerConfig(**{k: v for k, v in vars(args).items() if v is not None}, extra_engine_args=extra)


def _check(p: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    """What the flags cannot say alone: a bad setting in the environment, flags that do not go
    together. Each ends the start with the parser's usage and the fix."""
    for field, setting in SETTING_FLAGS.items():
        if getattr(args, field) is None:
            try:  # a bad value in the environment stops the start here, not a worker mid-push
                setting.get()
            except settings.SettingError as exc:
                p.error(str(exc))
    if args.deterministic and args.engine != "vllm":
        p.error(
            "--deterministic needs --engine vllm (its batch-invariant kernels); the transformers engine "
            "pads batches and its scores move with the batch"
        )
    if args.deterministic:
        try:  # read by vLLM's workers: a bad value would stop them at start, far from its cause
            settings.DETERMINISTIC_GEMM.get()
        except settings.SettingError as exc:
            p.error(str(exc))
    if extra and args.engine != "vllm":
        p.error(f"unknown arguments {extra} (extra engine arguments are passed only to --engine vllm)")
    if args.task == ModelTask.GENERATE.value:
        given = [
            f for f, v in (("--num-labels", args.num_labels), ("--pooling", args.pooling)) if v is not None
        ]
        if given:
            p.error(
                f"{' and '.join(given)} apply to score heads only; a generative model (--task generate) "
                "has none: drop them (RewardModel spec.model.numLabels / pooling)"
            )
    process_flags = [
        f"--{name.replace('_', '-')}"
        for name in ("step_tag", "step_separator", "good_label", "step_aggregation", "prm_pooling")
        if getattr(args, name) is not None
    ]
    if args.model_kind == ModelKind.PROCESS.value:
        if args.step_tag is None:
            p.error(
                "--model-kind process needs --step-tag, the token placed after each step (Qwen2.5-Math-PRM: "
                "<extra_0>; RewardModel spec.model.process.stepTag)"
            )
        if args.task != ModelTask.SCORE.value or args.pooling is not None:
            p.error("--model-kind process scores with its step tags: drop --task generate and --pooling")
    elif process_flags:
        p.error(f"{', '.join(process_flags)} apply to process reward models only: add --model-kind process")
    served = [*(args.served_model_name or []), *(args.model_aliases or [])]
    if any(not n.strip() for n in served):
        p.error("--served-model-name and --model-alias take non-empty names")
