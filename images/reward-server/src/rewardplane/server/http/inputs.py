"""Turning request inputs into token ids, with the server's limits applied.

Everything cheap is checked before anything expensive: the number of inputs and each text's size
in bytes come before tokenization (a 10 MB text once took the event loop 3.3 s and 1.8 GB to be
told it was too long), token ids are checked before scoring. Tokenization itself runs off the
event loop (``app``'s tokenizer pool). All functions here are pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rewardplane.server.errors import BadRequest

# A token covers a few bytes of text (English ~4, CJK ~6, long runs of whitespace or symbols in
# code more): 32 bytes per token of --max-model-len leaves room for any real text.
BYTES_PER_TOKEN = 32


@dataclass(frozen=True)
class Limits:
    max_items: int
    max_tokens: int
    max_input_bytes: int


def limits_for(max_items: int, max_tokens: int, max_input_bytes: int | None = None) -> Limits:
    return Limits(max_items, max_tokens, max_input_bytes or BYTES_PER_TOKEN * max_tokens)


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
    """An empty batch is fine (answered with no results: clients that split a batch over several
    servers send one); more than the limit is a 400."""
    if n > limits.max_items:
        raise BadRequest(
            f"{n} inputs in one request; this server takes at most {limits.max_items} "
            "(--max-items-per-request, also in GET /model_info): split the batch (the SDK's clients split "
            "to this limit, which they read from /model_info)"
        )


def _utf8_size(text: str, limit: int) -> str | None:
    """None if ``text`` fits in ``limit`` UTF-8 bytes, else its size in words, found without
    encoding a text that is obviously too long (encoding 10 MB costs the event loop ~10 ms)."""
    if len(text) > limit:  # every character is at least one byte
        return f"{len(text)} characters (at least as many bytes)"
    if 4 * len(text) <= limit:  # and at most four
        return None
    size = len(text.encode("utf-8", "surrogatepass"))
    return f"{size} bytes" if size > limit else None


def bound_texts(texts: list[str], limits: Limits, *, truncate: bool) -> list[str]:
    """Refuse (400, naming the input and the limit) a text over ``max_input_bytes`` before it is
    tokenized; with ``truncate`` keep its last ``max_input_bytes`` characters instead — more than
    ``max_tokens`` tokens for any real text, so truncating the tokens afterwards keeps the same end."""
    out = texts
    for i, text in enumerate(texts):
        size = _utf8_size(text, limits.max_input_bytes)
        if size is None:
            continue
        if not truncate:
            raise BadRequest(
                f"input {i} is {size}; this server takes at most {limits.max_input_bytes} bytes per input "
                f"(--max-input-bytes; {limits.max_tokens} tokens fit in far less): shorten it or send "
                "truncate: true to keep its end"
            )
        if out is texts:
            out = list(texts)
        out[i] = text[-limits.max_input_bytes :]
    return out


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


def split_prompt_input(raw: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    """vLLM's ``input`` — a string, a list of strings, a list of token ids, or a list of those —
    as (texts, None) or (None, token-id prompts). Nothing is tokenized here."""
    if isinstance(raw, str):
        return [raw], None
    # The request model (protocol.PromptInput) has already made every token id an int.
    if isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw):
        return None, [list(raw)]
    if isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        return list(raw), None
    if isinstance(raw, list) and all(isinstance(x, list) for x in raw):
        return None, raw
    raise BadRequest(
        "input must be a string, a list of strings, a list of token ids, or a list of such lists"
    )


def check_token_ids(prompts: list[list[int]], vocab_size: int) -> None:
    for i, ids in enumerate(prompts):
        # min/max run in C: a Python loop per token cost ~50 ms of the event loop per million tokens
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            raise BadRequest(f"input {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
