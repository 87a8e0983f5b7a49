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
    model_validator,
)

from .modes import ModelTask, PoolingType
from .steps import ModelKind, ProcessRewardConfig, StepAggregation, StepScore

Score = float | list[float]

# Request fields are strict (no "1" for 1, no 1 for true): what the OpenAPI document says is what
# the server takes, so a client's type mistake is a 422 rather than a silent coercion.


class ScoringRequest(BaseModel):
    """Body of ``POST /score``. ``inputs`` travels as ``input`` (the seed's wire name); the server
    also accepts ``inputs`` (Ludic's client spells it so).

    ``normalize``: True applies the head's activation — sigmoid for one label, softmax over the
    labels for several. False returns the raw head output (what reward-model training uses).

    A process reward model (``ModelInfo.kind`` process) takes solutions: ``input`` texts with the
    server's step separator, or ``steps`` (each solution a list of steps), with ``prompts`` (the text
    before each solution's first step, e.g. the question) optional. Each answer carries its steps'
    scores (``ScoringResult.steps``) and, as ``score``, their aggregate (``aggregation``, else the
    server's); with neither, ``score`` is the list of step scores. A step's score is the probability
    of the good label, or its log-odds with ``normalize`` false. ``first_step`` k scores steps k...
    only (the aggregate is theirs), the earlier steps read as context.
    """

    model_config = ConfigDict(populate_by_name=True, frozen=True, extra="forbid")

    model: str = "reward-model"
    inputs: Annotated[
        list[str],
        # one string is taken as a list of one (the validator below)
        WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}),
    ] = Field(default_factory=list, alias="input")
    steps: list[list[str]] | None = Field(
        default=None, description="Process reward models: each solution as its list of steps."
    )
    prompts: list[str] | None = Field(
        default=None, description="Process reward models: the text before each solution's first step."
    )
    aggregation: StepAggregation | None = Field(
        default=None, description="Process reward models: how step scores become `score`."
    )
    first_step: StrictInt = Field(
        default=0,
        ge=0,
        description="Process reward models: score the steps from this index on; the earlier ones are "
        "context (a server with prefix caching reuses their KV cache: incremental scoring).",
    )
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

    @model_validator(mode="after")
    def _steps_or_texts(self) -> ScoringRequest:
        if self.steps is not None and self.inputs:
            raise ValueError(
                "send a solution either as `input` texts with separators or as `steps`, not both"
            )
        n = len(self.steps) if self.steps is not None else len(self.inputs)
        if self.prompts is not None and len(self.prompts) != n:
            raise ValueError(
                f"prompts has {len(self.prompts)} items for {n} solutions: send one per solution"
            )
        return self

    def items(self) -> int:
        """How many texts or solutions the request scores."""
        return len(self.steps) if self.steps is not None else len(self.inputs)

    def wire_rows(self, start: int, stop: int) -> dict[str, Any]:
        """The wire body of items ``start..stop`` alone (a client splits a batch over servers)."""
        body = self.wire()
        for key in ("input", "steps", "prompts"):
            if body.get(key) is not None:
                body[key] = body[key][start:stop]
        return body

    def wire(self) -> dict[str, Any]:
        body = self.model_dump(mode="json", by_alias=True, exclude_defaults=False)
        # the process-model fields only when used: a server that predates them forbids unknown fields
        for key, unused in _PROCESS_FIELDS.items():
            if body[key] == unused:
                del body[key]
        return body


_PROCESS_FIELDS: dict[str, Any] = {"steps": None, "prompts": None, "aggregation": None, "first_step": 0}


class ScoringResult(BaseModel):
    index: int
    score: Score
    num_tokens: int = 0
    # process reward models: each step's score, spans and token offsets (None from a sequence model)
    steps: list[StepScore] | None = None


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
    kind: ModelKind = ModelKind.SEQUENCE
    # how a process reward model marks and combines steps (None for a sequence model)
    process: ProcessRewardConfig | None = None


class ErrorResponse(BaseModel):
    error: str
    detail: Any = None
