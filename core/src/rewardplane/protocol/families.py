"""The decoder families the reward server serves, by the ``model_type`` of their config, and the
architectures whose final layer runs on the pooled rows only on vLLM. Read by ``rewardplane
check-model`` (which must not import the server) and by the server's vLLM workers, so both say
the same."""

from __future__ import annotations

KNOWN_FAMILIES: frozenset[str] = frozenset(
    {"llama", "qwen2", "qwen3", "gemma2", "mistral", "qwen3_moe", "mixtral"}
)
# Mixture-of-experts families: their expert weights reach vLLM's loader one expert at a time.
MOE_FAMILIES: frozenset[str] = frozenset({"qwen3_moe", "mixtral"})

# Each is served on vLLM by ``rewardplane.server.engines.vllm_last_token:LastToken<architecture>``
# (vLLM serves Mistral with its Llama model).
POOLED_ROWS_ARCHS: frozenset[str] = frozenset(
    {"LlamaForSequenceClassification", "MistralForSequenceClassification"}
)


def vllm_layer_types(cfg: dict[str, object]) -> list[str] | None:
    """``layer_types`` that vLLM must be given (``hf_overrides``) to attend as transformers does, or
    ``None``. vLLM 0.24's Llama, which serves Mistral, slides its window only on the layers that
    ``layer_types`` marks ``sliding_attention``; a Mistral ``config.json`` has no ``layer_types``,
    and transformers then slides on every layer. Without this, vLLM attends over the whole prompt
    and scores of prompts longer than the window differ from transformers'."""
    layers = cfg.get("num_hidden_layers")
    if cfg.get("model_type") == "mistral" and cfg.get("sliding_window") and not cfg.get("layer_types"):
        return ["sliding_attention"] * int(layers) if isinstance(layers, int) else None
    return None
