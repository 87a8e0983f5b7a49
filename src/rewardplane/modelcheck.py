"""``rewardplane check-model``: what a model's config and tokenizer say about serving it, before
any weight is loaded. :func:`check` is pure (a config dict and tokenizer facts in, a report out);
:func:`main` does the reading and printing."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rewardplane.protocol.families import KNOWN_FAMILIES, POOLED_ROWS_ARCHS, vllm_layer_types
from rewardplane.tinymodel import PRM_STEP_TAG

# LoRA targets of a standard decoder: attention and MLP projections, by their module names.
ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TP_CANDIDATES = (1, 2, 4, 8)


@dataclass
class TokenizerFacts:
    """What the check needs of a tokenizer: whether one exists, its pad token, its special tokens."""

    present: bool
    pad_token: str | None = None
    special_tokens: list[str] = field(default_factory=list)


@dataclass
class Report:
    architecture: str
    family: str
    params: int
    weights_bytes: int
    kv_cache_bytes: int
    tensor_parallel_sizes: list[int]
    pooled_rows: bool
    pushes: list[str]
    lora_targets: list[str]
    prm_step_tag: bool | None
    failures: list[str]
    # what the server tells vLLM of this config (hf_overrides) so that it attends as transformers
    vllm_overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures


def count_params(cfg: dict[str, Any]) -> int:
    """Parameters of a ``*ForSequenceClassification`` decoder of this shape, exactly as transformers
    builds it: embeddings; per layer attention (with Qwen2's q/k/v biases, ``attention_bias``,
    Qwen3's q/k norms), the MLP or the experts and their router (Qwen3-MoE's dense
    ``mlp_only_layers`` and ``decoder_sparse_step``, a shared expert and its gate) and the norms
    (four in Gemma 2); the final norm and the score head."""
    h, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    family = cfg.get("model_type", "")
    bias = bool(cfg.get("attention_bias"))
    attn = h * head_dim * (heads + 2 * kv) + heads * head_dim * h
    if bias or family in ("qwen2", "qwen2_moe"):  # Qwen2: q/k/v biases; attention_bias: o_proj's too
        attn += head_dim * (heads + 2 * kv)
    attn += h if bias else 0
    if family in ("qwen3", "qwen3_moe"):
        attn += 2 * head_dim  # q_norm, k_norm
    norms = (4 if family == "gemma2" else 2) * h
    layers = int(cfg["num_hidden_layers"])
    # to_dict() keeps the labels as id2label, not num_labels
    labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 1)
    total = vocab * h + layers * (attn + norms) + h + h * labels
    return total + sum(_mlp_params(cfg, i) for i in range(layers))


def _mlp_params(cfg: dict[str, Any], layer: int) -> int:
    """One layer's MLP: dense (``intermediate_size``, ``mlp_bias``) or experts and their router."""
    h = int(cfg["hidden_size"])
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    sparse = experts and layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0
    if not sparse:
        inter = int(cfg["intermediate_size"])
        return 3 * h * inter + ((2 * inter + h) if cfg.get("mlp_bias") else 0)
    inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    # experts, router; a shared expert and its one-output gate
    return experts * 3 * h * inter + experts * h + (3 * h * shared + h if shared else 0)


def check(cfg: dict[str, Any], tokenizer: TokenizerFacts, *, dtype: str, max_model_len: int) -> Report:
    """Report on a model from its config (``PretrainedConfig.to_dict()``) and tokenizer facts."""
    failures: list[str] = []
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else ""
    family = str(cfg.get("model_type", ""))
    if family not in KNOWN_FAMILIES:
        failures.append(f"unknown family {family!r}: supported are {', '.join(sorted(KNOWN_FAMILIES))}")
    if not arch:
        failures.append("config.json names no architecture (set 'architectures')")
    elif not arch.endswith(("ForSequenceClassification", "ForRewardModel", "ForProcessRewardModel")):
        failures.append(f"{arch} has no score head: a reward model is a *ForSequenceClassification")
    if dtype not in DTYPE_BYTES:
        failures.append(f"unknown dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}")
    heads = int(cfg.get("num_attention_heads") or 0)
    kv = int(cfg.get("num_key_value_heads") or heads)
    h = int(cfg.get("hidden_size") or 0)
    if not heads or not h:
        failures.append("config.json lacks hidden_size or num_attention_heads")
        tp: list[int] = []
        params = 0
    else:
        if heads % kv:
            failures.append(f"{heads} attention heads are not divisible by {kv} key/value heads")
        if not cfg.get("head_dim") and h % heads:
            failures.append(f"hidden_size {h} is not divisible by {heads} attention heads")
        # vLLM splits heads (key/value heads, or replicates them) and the MLP's (or each expert's)
        # intermediate rows across the ranks
        widths = [int(cfg.get(k) or 0) for k in ("intermediate_size", "moe_intermediate_size")]
        tp = [
            n
            for n in TP_CANDIDATES
            if heads % n == 0 and (kv % n == 0 or n % kv == 0) and all(w % n == 0 for w in widths)
        ]
        params = count_params(cfg)
    width = DTYPE_BYTES.get(dtype, 2)
    head_dim = int(cfg.get("head_dim") or (h // heads if heads else 0))
    kv_bytes = 2 * int(cfg.get("num_hidden_layers") or 0) * kv * head_dim * max_model_len * width
    limit = cfg.get("max_position_embeddings")
    if limit and max_model_len > limit:
        failures.append(f"--max-model-len {max_model_len} exceeds max_position_embeddings {limit}")
    if family == "gemma2" and cfg.get("tie_word_embeddings") is False:
        failures.append(
            "tie_word_embeddings is false: vLLM's Gemma2 loads only tied embeddings; set it true "
            "(a reward model scores with its score head, not the LM head)"
        )
    if not tokenizer.present:
        failures.append("no tokenizer files (tokenizer.json or tokenizer_config.json) beside config.json")
    elif tokenizer.pad_token is None and cfg.get("pad_token_id") is None:
        failures.append(
            "no pad token: batches of texts cannot be padded (set pad_token_id or the tokenizer's)"
        )
    prm = arch.endswith("ForProcessRewardModel")
    step_tag = (PRM_STEP_TAG in tokenizer.special_tokens) if prm else None
    if prm and not step_tag:
        failures.append(f"a process reward model whose tokenizer lacks the step tag {PRM_STEP_TAG}")
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    layer_types = vllm_layer_types(cfg)
    return Report(
        architecture=arch,
        family=family,
        params=params,
        weights_bytes=params * width,
        kv_cache_bytes=kv_bytes,
        tensor_parallel_sizes=tp,
        pooled_rows=arch in POOLED_ROWS_ARCHS,
        pushes=["full", "lora-merged", "head-only", "adapter", "delta"],
        # experts' projections are fused on vLLM, so LoRA targets attention only there
        lora_targets=ATTENTION_TARGETS if experts else ATTENTION_TARGETS + MLP_TARGETS,
        prm_step_tag=step_tag,
        failures=failures,
        vllm_overrides={"layer_types": layer_types} if layer_types else {},
    )


def render(report: Report) -> str:
    gib = 1024**3
    lines = [
        f"architecture: {report.architecture or '-'} (family {report.family or '-'})",
        f"parameters: {report.params:,}",
        f"weights: {report.weights_bytes / gib:.2f} GiB; KV cache per sequence: {report.kv_cache_bytes / gib:.3f} GiB",
        f"tensor-parallel sizes: {', '.join(map(str, report.tensor_parallel_sizes)) or 'none'}",
        f"pooled rows fast path: {'yes' if report.pooled_rows else 'no (every row is computed)'}",
        f"pushes: {', '.join(report.pushes)}",
        f"LoRA targets: {', '.join(report.lora_targets)}",
    ]
    if report.vllm_overrides:
        lines.append(
            f"vLLM overrides: {', '.join(report.vllm_overrides)} (sliding window on every layer, as transformers)"
        )
    if report.prm_step_tag is not None:
        lines.append(f"PRM step tag {PRM_STEP_TAG}: {'present' if report.prm_step_tag else 'missing'}")
    lines += [f"FAIL: {f}" for f in report.failures] or ["OK: nothing would fail"]
    return "\n".join(lines)


def read_tokenizer(path: Path) -> TokenizerFacts:
    """Tokenizer facts from its files, without loading the tokenizer."""
    files = [path / "tokenizer.json", path / "tokenizer_config.json"]
    if not any(f.exists() for f in files):
        return TokenizerFacts(present=False)
    special: list[str] = []
    pad = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = path / name
        if f.exists():
            data = json.loads(f.read_text(encoding="utf-8"))
            pad = pad or _token(data.get("pad_token"))
            special += [t for t in map(_token, data.get("additional_special_tokens") or []) if t]
            special += [_token(v) or "" for v in (data.get("added_tokens_decoder") or {}).values()]
    return TokenizerFacts(present=True, pad_token=pad, special_tokens=special)


def _token(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rewardplane check-model",
        description="Check a model's config and tokenizer for serving, without loading weights.",
    )
    p.add_argument("model", help="a local model folder (or a hub id, read with transformers' AutoConfig)")
    p.add_argument("--dtype", default="bfloat16", help="dtype the weights will be served in")
    p.add_argument("--max-model-len", type=int, default=4096, help="longest sequence served")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(args.model).to_dict()
    except (OSError, ValueError, KeyError) as exc:
        print(f"rewardplane check-model: cannot read the config of {args.model}: {exc}", file=sys.stderr)
        return 1
    report = check(cfg, read_tokenizer(Path(args.model)), dtype=args.dtype, max_model_len=args.max_model_len)
    print(json.dumps({**asdict(report), "ok": report.ok}, indent=2) if args.json else render(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
