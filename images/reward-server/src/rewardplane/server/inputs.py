"""Turning request inputs into token ids, with the server's limits applied."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import BadRequest


@dataclass(frozen=True)
class Limits:
    max_items: int
    max_tokens: int


def tokenize_texts(tokenizer: Any, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=add_special_tokens, truncation=False)["input_ids"]
    return [list(ids) for ids in encoded]


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """One chat as text, through the model's chat template (or the request's own template)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise BadRequest(
            "this model's tokenizer has no chat template, so 'messages' cannot be rendered: send the "
            "rendered text as 'input', or pass a 'chat_template'"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **(chat_template_kwargs or {}),
        )
    except Exception as exc:  # jinja2 and transformers raise many types; all mean "bad messages"
        raise BadRequest(f"the chat template could not render these messages: {exc}") from exc
    return str(text)


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


def normalize_prompt_input(
    raw: Any, tokenizer: Any, vocab_size: int, *, add_special_tokens: bool = True
) -> list[list[int]]:
    """vLLM's ``input``: a string, a list of strings, a list of token ids, or a list of those.

    ``add_special_tokens`` applies to text only: token ids are scored as sent."""
    if isinstance(raw, str):
        return tokenize_texts(tokenizer, [raw], add_special_tokens=add_special_tokens)
    # The request model (protocol.PromptInput) has already made every token id an int.
    if isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw):
        prompts = [list(raw)]
    elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        return tokenize_texts(tokenizer, list(raw), add_special_tokens=add_special_tokens)
    elif isinstance(raw, list) and all(isinstance(x, list) for x in raw):
        prompts = raw
    else:
        raise BadRequest(
            "input must be a string, a list of strings, a list of token ids, or a list of such lists"
        )
    check_token_ids(prompts, vocab_size)
    return prompts


def check_token_ids(prompts: list[list[int]], vocab_size: int) -> None:
    for i, ids in enumerate(prompts):
        # min/max run in C: a Python loop per token cost ~50 ms of the event loop per million tokens
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            raise BadRequest(f"input {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
