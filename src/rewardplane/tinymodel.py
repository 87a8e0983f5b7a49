"""Tiny reward models built from a config with random weights, for tests, examples and the local
development cluster. No downloads: the tokenizer is trained here on a corpus shipped with the package."""

from __future__ import annotations

import argparse
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


def build_tiny_reward_model(
    out_dir: str | Path,
    *,
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
    """Save a random-weight ``LlamaForSequenceClassification`` and its tokenizer to ``out_dir``.

    ``head_std``: random init gives near-zero scores; a wider head makes scores differ visibly
    between texts (``hidden_size ** -0.5`` gives scores of order 1). ``vocab_size`` defaults to the
    tokenizer's; a larger one mimics real models (the extra ids are simply never produced).
    """
    import torch
    from transformers import LlamaForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    config = _llama_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        num_labels=num_labels,
    )
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
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
    fields = _config_fields(tokenizer, **sizes)
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

    return LlamaConfig(**_config_fields(tokenizer, **sizes))


def _config_fields(
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    max_position_embeddings: int = 512,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A decoder's config fields: its sizes, ``tokenizer``'s special ids, an untied head."""
    return {
        "vocab_size": max(vocab_size or 0, len(tokenizer)),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads or max(1, num_heads // 2),
        "max_position_embeddings": max_position_embeddings,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
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
        path = build_tiny_reward_model(args.out, num_labels=args.num_labels, seed=args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
