"""Turning request inputs into token ids, with the server's limits applied."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import BadRequest


@dataclass(frozen=True)
class Limits:
    max_items: int
    max_tokens: int


def tokenize_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
    return [list(ids) for ids in encoded]


def check_items(n: int, limits: Limits) -> None:
    if n == 0:
        raise BadRequest("input is empty: send at least one text to score")
    if n > limits.max_items:
        raise BadRequest(
            f"{n} inputs in one request; this server takes at most {limits.max_items} "
            "(--max-items-per-request): split the batch (the SDK's score_batch does this)"
        )


def apply_length_limit(prompts: list[list[int]], limits: Limits, *, truncate: bool) -> list[list[int]]:
    """Reject (400, naming the item and the limit) or keep the last ``max_tokens`` tokens.

    Truncation keeps the end of the text: for a reward model the completion, at the end, matters most.
    """
    out: list[list[int]] = []
    for i, ids in enumerate(prompts):
        if not ids:
            raise BadRequest(f"input {i} is empty after tokenization: send non-empty text")
        if len(ids) > limits.max_tokens:
            if not truncate:
                raise BadRequest(
                    f"input {i} has {len(ids)} tokens; the limit is {limits.max_tokens} "
                    "(--max-model-len): shorten it or send truncate: true to keep its last tokens"
                )
            ids = ids[-limits.max_tokens :]
        out.append(ids)
    return out


def normalize_prompt_input(raw: Any, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """vLLM's ``input``: a string, a list of strings, a list of token ids, or a list of those."""
    if isinstance(raw, str):
        return tokenize_texts(tokenizer, [raw])
    # The request model (protocol.PromptInput) has already made every token id an int.
    if isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw):
        prompts = [list(raw)]
    elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        return tokenize_texts(tokenizer, list(raw))
    elif isinstance(raw, list) and all(isinstance(x, list) for x in raw):
        prompts = raw
    else:
        raise BadRequest(
            "input must be a string, a list of strings, a list of token ids, or a list of such lists"
        )
    for i, ids in enumerate(prompts):
        # min/max run in C: a Python loop per token cost ~50 ms of the event loop per million tokens
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            raise BadRequest(f"input {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return prompts
