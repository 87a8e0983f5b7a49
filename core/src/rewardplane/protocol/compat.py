"""Request and answer shapes of the RL frameworks and inference servers that rewardplane stands in for.

- vLLM's pooling API (``/classify``, ``/pooling``, ``/v1/embeddings``, ``/v1/models``, ``/tokenize``,
  ``/detokenize``): what vLLM clients, the ``openai`` package and verl's reward loop send.
- OpenRLHF's remote reward model (``POST /get_reward``).
- OpenAI's chat completions (``POST /v1/chat/completions``, non-streaming), served by generative
  models (``--task generate``: an LLM judge).

rewardplane's own ``/score`` (with the Ludic spelling ``inputs``) is in ``scoring``. Unknown fields
are accepted on the vLLM shapes: vLLM clients send fields that do not change a reward model's
answer (``priority``, ``request_id``, ``user``), and refusing them would break drop-in use.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, WithJsonSchema, model_validator

from .scoring import Score, Usage

# Request fields are strict, as in ``scoring``: the OpenAPI document says what the server takes.
PromptInput = str | list[str] | list[StrictInt] | list[list[StrictInt]]
# One chat message as the model's chat template reads it (role, content, and whatever else it uses).
ChatMessage = dict[str, Any]
EncodingFormat = Literal["float", "base64"]
ItemT = TypeVar("ItemT", bound=BaseModel)


def encode_base64_floats(values: Sequence[float]) -> str:
    """vLLM's and OpenAI's ``encoding_format: base64``: little-endian float32 bytes, base64."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def decode_base64_floats(data: str) -> list[float]:
    raw = base64.b64decode(data)
    if len(raw) % 4:
        raise ValueError(f"base64 float32 data has {len(raw)} bytes, not a multiple of 4")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


class ChatOrText(BaseModel):
    """vLLM's fields of a request that takes text or one chat (``messages``, rendered through the
    model's chat template). ``add_special_tokens`` defaults as in vLLM: true for text (the
    tokenizer adds BOS), false for ``messages`` (the template writes its own)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class PooledRequest(ChatOrText):
    """Fields common to vLLM's pooling-family requests (classify, pooling, embeddings).

    Either ``input`` (text, texts, token ids) or ``messages`` (one chat). The activation is off
    unless asked for (``use_activation``; older vLLM names ``activation`` and ``softmax``): a
    reward model's raw score is what RL training uses.
    """

    input: PromptInput | None = None
    truncate_prompt_tokens: StrictInt | None = Field(
        default=None, description="Keep the last k tokens of each input; -1 = the model's max length."
    )
    use_activation: StrictBool | None = None
    activation: StrictBool | None = None  # vLLM < 0.11.2
    softmax: StrictBool | None = None  # older vLLM
    dimensions: StrictInt | None = None
    task: str | None = None  # vLLM's /pooling task; only whole-sequence outputs are served
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> PooledRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("send exactly one of 'input' (text or token ids) and 'messages' (a chat)")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty: send at least one chat message")
        t = self.truncate_prompt_tokens
        if t is not None and t != -1 and t < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 (the model's max length) or >= 1, got {t}")
        if self.dimensions is not None:
            raise ValueError("dimensions is not supported: a reward model's output is its score head")
        if self.task is not None and self.task not in ("classify", "embed", "score"):
            raise ValueError(
                f"task {self.task!r} is not served: this server returns one score vector per input "
                "(task classify, embed or score); per-token outputs are not available"
            )
        return self

    def activation_requested(self) -> bool:
        """Raw score unless the caller asks for the activation (sigmoid / softmax)."""
        for flag in (self.use_activation, self.activation, self.softmax):
            if flag is not None:
                return flag
        return False


class ClassifyRequest(PooledRequest):
    """``POST /classify`` (vLLM)."""


class PoolingRequest(PooledRequest):
    """``POST /pooling`` (vLLM)."""

    encoding_format: EncodingFormat = "float"


class EmbeddingRequest(PooledRequest):
    """``POST /v1/embeddings`` (OpenAI / vLLM / SGLang). For a reward model each input's embedding is
    its score vector (one value per label), so ``embedding[-1]`` is the score — what verl reads on
    its SGLang path."""

    encoding_format: EncodingFormat = "float"


class ClassificationData(BaseModel):
    index: int
    label: str | None = None
    probs: list[float]
    num_classes: int


class ListResponse(BaseModel, Generic[ItemT]):
    """The envelope of vLLM's pooling-family answers: one ``data`` item per input, in order."""

    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ItemT]
    usage: Usage
    version: int = 0


class ClassifyResponse(ListResponse[ClassificationData]):
    pass


class PoolingData(BaseModel):
    """``data``: one row per input; a process reward model gives one row per step tag (vLLM's STEP
    pooling)."""

    index: int
    object: str = "pooling"
    data: list[float] | list[list[float]] | str


class PoolingResponse(ListResponse[PoolingData]):
    pass


class EmbeddingData(BaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(ListResponse[EmbeddingData]):
    pass


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "rewardplane"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeRequest(ChatOrText):
    """``POST /tokenize`` (vLLM): ``prompt`` or ``messages``."""

    prompt: str | None = None
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' (text) and 'messages' (a chat)")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class GetRewardRequest(BaseModel):
    """OpenRLHF's remote reward model: ``{"query": [...], "prompts"?, "labels"?}``.

    ``query`` is the whole decoded sequence (prompt and response, special tokens included), so it is
    tokenized without adding special tokens, as OpenRLHF's own ``serve_rm`` does. ``prompts`` and
    ``labels`` are accepted and unused: a reward model scores the sequence.
    """

    model_config = ConfigDict(extra="allow")

    query: Annotated[
        list[str],
        # one string is taken as a list of one (the validator below)
        WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}),
    ]
    prompts: list[Any] | None = None
    labels: list[Any] | None = None
    model: str | None = Field(
        default=None, description="Checked like every scoring route's: a name this server answers to."
    )
    add_special_tokens: StrictBool = False
    truncate: StrictBool = Field(
        default=False, description="Cut inputs longer than the server's max tokens instead of a 400."
    )

    @model_validator(mode="before")
    @classmethod
    def _one_query_is_a_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("query"), str):
            return {**data, "query": [data["query"]]}
        return data


class GetRewardResponse(BaseModel):
    """OpenRLHF reads ``rewards`` (and ``scores``, ``extra_logs``); raw head outputs, in query order."""

    rewards: list[Score]
    scores: list[Score]
    extra_logs: dict[str, list[Any]] = Field(default_factory=dict)
    version: int = 0


# ---- chat completions (OpenAI's shape; generative models) --------------------------------------

FinishReason = Literal["stop", "length"]


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` (OpenAI / vLLM), non-streaming. The chat is rendered through the
    model's chat template with the assistant's opening (``add_generation_prompt``). ``max_tokens``
    (or OpenAI's newer ``max_completion_tokens``) defaults to what fits in the model's length.
    vLLM's ``min_tokens`` and ``ignore_eos`` (answers of a fixed length, as benchmarks and length
    controls ask for) are honoured. Unknown fields are accepted, as on the other OpenAI shapes."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=64)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        limit = self.token_limit()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(
                f"min_tokens {self.min_tokens} is more than max_tokens {limit}: lower min_tokens"
            )
        if self.stream:
            raise ValueError("stream is not supported by this server: send stream false (or leave it out)")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        if any(not s for s in self.stop_list()):
            raise ValueError("stop strings must not be empty")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    finish_reason: FinishReason | None
    logprobs: None = None


class CompletionUsage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatCompletionResponse(BaseModel):
    """OpenAI's ``ChatCompletion``, plus ``version``: the weights version that generated every choice."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage
    version: int = 0


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class OpenAIErrorResponse(BaseModel):
    """The error body under ``/v1/...``: OpenAI's shape, whose ``error.message`` the ``openai``
    package shows to its user (it shows only the status code for any other body). Everywhere else
    the server answers ``ErrorResponse``."""

    error: OpenAIError
