"""Tiny reward models built from a config with random weights, for tests, examples and the local
development cluster. No downloads: the tokenizer is trained here on a corpus shipped with the package."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path("/tmp/rewardplane-tiny-rm")


def corpus_lines() -> list[str]:
    # beside this module (importlib.resources cannot read from a namespace package like `rewardplane`)
    text = (Path(__file__).parent / "data" / "corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def train_tokenizer(vocab_size: int = 512):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@dataclass(frozen=True)
class Family:
    """A served decoder family: its transformers classes (``<prefix>Config``,
    ``<prefix>ForSequenceClassification``) and the config fields that make a tiny one of its shape
    (``extra``, from the resolved sizes)."""

    prefix: str
    extra: Callable[[dict[str, Any]], dict[str, Any]] = lambda sizes: {}

    @property
    def config_class(self) -> str:
        return f"{self.prefix}Config"

    @property
    def model_class(self) -> str:
        return f"{self.prefix}ForSequenceClassification"


# Short enough that the test texts cross it: a sliding window that no text reaches tests nothing.
TINY_SLIDING_WINDOW = 16


def _head_dim(sizes: dict[str, Any]) -> int:
    return int(sizes["hidden_size"]) // int(sizes["num_attention_heads"])


def _gemma2(sizes: dict[str, Any]) -> dict[str, Any]:
    # Gemma 2's own soft-caps and query scale; its defaults (head_dim 256) assume a 9B shape
    return {
        "head_dim": _head_dim(sizes),
        "query_pre_attn_scalar": _head_dim(sizes),
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": TINY_SLIDING_WINDOW,  # every other layer, from layer_types' default
        "tie_word_embeddings": True,  # as every Gemma 2; vLLM's Gemma2 refuses an untied one
    }


def _qwen3_moe(sizes: dict[str, Any]) -> dict[str, Any]:
    return {
        "head_dim": _head_dim(sizes),
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": max(1, int(sizes["intermediate_size"]) // 2),
        "norm_topk_prob": True,
    }


# model_type -> family. Qwen3 and Qwen3-MoE default to head_dim 128, so it is set from the sizes.
FAMILIES: dict[str, Family] = {
    "llama": Family("Llama"),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3", lambda sizes: {"head_dim": _head_dim(sizes)}),
    "gemma2": Family("Gemma2", _gemma2),
    "mistral": Family("Mistral", lambda sizes: {"sliding_window": TINY_SLIDING_WINDOW}),
    "qwen3_moe": Family("Qwen3Moe", _qwen3_moe),
    "mixtral": Family("Mixtral", lambda sizes: {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def family_config(
    family: str, *, num_labels: int = 1, special_ids: dict[str, int | None] | None = None, **sizes: Any
) -> Any:  # -> transformers.PretrainedConfig
    """The config of a tiny ``family`` reward model (``FAMILIES``): ``sizes`` as for
    :func:`build_tiny_reward_model`; ``special_ids``: pad/bos/eos token ids."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    fields = _config_fields(special_ids or {}, **sizes)
    # num_labels and architectures: PretrainedConfig arguments that the typed __init__ omits
    fields |= {"num_labels": num_labels, "architectures": [spec.model_class], **spec.extra(fields)}
    return getattr(transformers, spec.config_class)(**fields)


def build_tiny_reward_model(
    out_dir: str | Path,
    *,
    family: str = "llama",
    num_labels: int = 1,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    head_std: float = 1.0,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """Save a random-weight ``<Family>ForSequenceClassification`` and its tokenizer to ``out_dir``;
    ``family``: a key of ``FAMILIES`` (``llama``, ``qwen2``, ``qwen3``, ``gemma2``, ``mistral``,
    ``qwen3_moe``, ``mixtral``).

    ``head_std``: random init gives near-zero scores; a wider head makes scores differ visibly
    between texts (``hidden_size ** -0.5`` gives scores of order 1). ``vocab_size`` defaults to the
    tokenizer's; a larger one mimics real models (the extra ids are simply never produced).
    """
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    config = family_config(
        family,
        num_labels=num_labels,
        special_ids=_special_ids(tokenizer),
        vocab_size=max(vocab_size or 0, len(tokenizer)),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        intermediate_size=intermediate_size,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family].model_class)(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, head_std)
    return _save(model, tokenizer, out, dtype)


PRM_STEP_TAG = "<extra_0>"  # Qwen2.5-Math-PRM's step tag


def build_tiny_process_reward_model(
    out_dir: str | Path, *, head_std: float = 1.0, dtype: str = "float32", seed: int = 0, **sizes: Any
) -> Path:
    """Save a random-weight process reward model of the Qwen2.5-Math-PRM shape and its tokenizer
    (with the step tag ``<extra_0>`` as a special token) to ``out_dir``: a Qwen2 backbone and the
    two-layer head giving two logits per token (``Qwen2ForProcessRewardModel``), which the
    transformers engine and vLLM's class of that name both load. ``sizes``: as for
    :func:`build_tiny_reward_model` (``hidden_size``, ``num_layers``, ``num_heads``, ...).
    ``head_std``: the head's init in units of ``hidden_size ** -0.5`` (1: step log-odds of order 1,
    which differ between steps)."""
    import torch
    from transformers import Qwen2Config

    from rewardplane.server.engines.prm_model import Qwen2ForProcessRewardModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [PRM_STEP_TAG]})
    # num_labels and architectures: PretrainedConfig arguments that the typed __init__ omits
    fields = _tokenizer_fields(tokenizer, sizes)
    config = Qwen2Config(**{**fields, "num_labels": 2, "architectures": ["Qwen2ForProcessRewardModel"]})
    hidden_size = int(fields["hidden_size"])
    torch.manual_seed(seed)
    model = Qwen2ForProcessRewardModel(config)
    with torch.no_grad():
        for layer in model.score:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.normal_(0.0, head_std * hidden_size**-0.5)
                layer.bias.normal_(0.0, 0.1)
    return _save(model, tokenizer, out, dtype)


# A plain chat template for the tiny causal LM: each turn as ``<s>role\ncontent</s>``, and the
# assistant's opening when a generation prompt is asked for (what a judge request renders).
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def _save(model: Any, tokenizer: Any, out: Path, dtype: str) -> Path:
    import torch

    model.to(getattr(torch, dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # safetensors writes its file owner-only (0600); a server in a container runs as another user
    # (65532) and reads the model through a volume, so make every file world-readable.
    for f in out.iterdir():
        f.chmod(0o644)
    return out


def build_tiny_causal_lm(
    out_dir: str | Path, *, dtype: str = "float32", seed: int = 0, **config: Any
) -> Path:
    """Save a random-weight ``LlamaForCausalLM`` (a generative judge for tests) and its tokenizer,
    with a chat template, to ``out_dir``. Its answers are random text; its greedy answer is
    deterministic. ``config``: sizes as for :func:`build_tiny_reward_model` (``hidden_size``,
    ``num_layers``, ``num_heads``, ``num_kv_heads``, ``max_position_embeddings``, ...)."""
    import torch
    from transformers import LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    return _save(LlamaForCausalLM(_llama_config(tokenizer, **config)), tokenizer, out, dtype)


def _llama_config(tokenizer: Any, **sizes: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_tokenizer_fields(tokenizer, sizes))


def _tokenizer_fields(tokenizer: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """Config fields for a model of ``tokenizer``: every id it produces is in the vocabulary."""
    vocab = max(sizes.get("vocab_size") or 0, len(tokenizer))
    return _config_fields(_special_ids(tokenizer), **{**sizes, "vocab_size": vocab})


def _special_ids(tokenizer: Any) -> dict[str, int | None]:
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def _config_fields(
    special_ids: dict[str, int | None],
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    max_position_embeddings: int = 512,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    **extra: Any,
) -> dict[str, Any]:
    """A decoder's config fields: its sizes, the tokenizer's special ids, an untied head."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads or max(1, num_heads // 2),
        "max_position_embeddings": max_position_embeddings,
        **special_ids,
        "tie_word_embeddings": False,
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rewardplane tiny-model",
        description="Build a tiny random-weight reward model (no downloads) and print its folder.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=DEFAULT_DIR, help="the folder to write the checkpoint into")
    p.add_argument("--num-labels", type=int, default=1, help="outputs of the score head")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--family", choices=list(FAMILIES), default="llama", help="the decoder family of the reward model"
    )
    p.add_argument(
        "--causal-lm", action="store_true", help="a tiny causal LM with a chat template (a generative judge)"
    )
    p.add_argument(
        "--process",
        action="store_true",
        help=f"a tiny process reward model (Qwen2.5-Math-PRM shape, step tag {PRM_STEP_TAG})",
    )
    args = p.parse_args(argv)
    if args.causal_lm:
        path = build_tiny_causal_lm(args.out, seed=args.seed)
    elif args.process:
        path = build_tiny_process_reward_model(args.out, seed=args.seed)
    else:
        path = build_tiny_reward_model(
            args.out, family=args.family, num_labels=args.num_labels, seed=args.seed
        )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
