"""Scoring requests and answers: ``/score``, health and model info (the vLLM shapes are in ``compat``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    WithJsonSchema,
    computed_field,
    field_validator,
)

from .modes import ModelTask, PoolingType

Score = float | list[float]

# Request fields are strict (no "1" for 1, no 1 for true): what the OpenAPI document says is what
# the server takes, so a client's type mistake is a 422 rather than a silent coercion.


class ScoringRequest(BaseModel):
    """Body of ``POST /score``. ``inputs`` travels as ``input`` (the seed's wire name); the server
    also accepts ``inputs`` (Ludic's client spells it so).

    ``normalize``: True applies the head's activation — sigmoid for one label, softmax over the
    labels for several. False returns the raw head output (what reward-model training uses).
    """

    model_config = ConfigDict(populate_by_name=True, frozen=True, extra="forbid")

    model: str = "reward-model"
    inputs: Annotated[
        list[str],
        # one string is taken as a list of one (the validator below)
        WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}),
    ] = Field(alias="input")
    pooling_type: PoolingType = PoolingType.LAST
    normalize: StrictBool = True
    n_labels: StrictInt | None = Field(
        default=None, ge=1, description="Expected number of labels; the server rejects a mismatch."
    )
    truncate: StrictBool = Field(
        default=False, description="Cut inputs longer than the server's max tokens instead of a 400."
    )
    return_hidden_states: StrictBool = False

    @field_validator("inputs", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    def wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_defaults=False)


class ScoringResult(BaseModel):
    index: int
    score: Score
    num_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class ScoringResponse(BaseModel):
    """Body of the ``/score`` reply. ``version`` is the weights version that scored every item.

    ``scores`` (the scores in input order) is sent next to ``data`` and the server repeats the
    version in ``metadata["version"]``: the shape Ludic's reward-model client reads.
    """

    model: str
    data: list[ScoringResult]
    usage: Usage = Field(default_factory=Usage)
    version: int = 0
    metadata: dict[str, Any] = Field(default_factory=dict)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def scores(self) -> list[Score]:
        return [d.score for d in sorted(self.data, key=lambda d: d.index)]


class HealthResponse(BaseModel):
    """``state``: serving, updating, broken or sleeping (then ``sleep_level`` is 1 or 2)."""

    status: str = "ok"
    type: str = "reward_model"
    version: int = 0
    state: str = "serving"
    sleep_level: int | None = None
    # False while a replica started with --require-admission waits for the operator (protocol.admission)
    admitted: bool = True


class RuntimeVersionResponse(BaseModel):
    version: int
    state: Literal["serving", "updating", "broken", "sleeping"] = "serving"
    detail: str | None = None
    sleep_level: int | None = None
    # The version a delta push may build on here: the last one a push committed, None when anything
    # else wrote the weights since (a start, a restore, a failed update). See protocol.weights.delta_refusal.
    delta_base: int | None = None
    # This server's workers join the slicing agreement of an announce that asks for it
    # (UpdateParamBatchRequest.agree_slicing); a server without the field does not.
    agrees_slicing: bool = True


class WorldSizeResponse(BaseModel):
    world_size: int


class ModelInfo(BaseModel):
    model: str
    engine: str
    num_labels: int
    dtype: str
    head_dtype: str
    max_model_len: int
    pooling_type: PoolingType
    version: int
    # 0: this server takes no LoRA adapters (adapter-only sync refused); else the largest rank it serves
    max_lora_rank: int = 0
    task: ModelTask = ModelTask.SCORE
    # The most inputs one scoring request may carry (--max-items-per-request): clients split larger
    # batches to it. None from a server that does not say.
    max_items_per_request: int | None = None


class ErrorResponse(BaseModel):
    error: str
    detail: Any = None
