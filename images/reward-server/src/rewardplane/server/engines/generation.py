"""Pure steps of answering a chat (task ``generate``): the sampling options of a request, and where
a stop string cuts a generated text. The engines run the model; these decide the rest."""

from __future__ import annotations

from rewardplane.protocol import ChatCompletionRequest, ModelTask
from rewardplane.server.engines.engine import EngineInfo, SamplingOptions
from rewardplane.server.errors import BadRequest


def sampling_options(req: ChatCompletionRequest, prompt_tokens: int, max_model_len: int) -> SamplingOptions:
    """The request's sampling fields, with ``max_tokens`` resolved as vLLM does: what is left of the
    model's length after the prompt when unset; a 400 when prompt plus answer cannot fit."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise BadRequest(
            f"the rendered chat is {prompt_tokens} tokens; this model takes at most {max_model_len} "
            "(prompt and answer together): send a shorter chat"
        )
    asked = req.token_limit()
    if req.min_tokens > room:
        raise BadRequest(
            f"min_tokens {req.min_tokens} does not fit: the chat is {prompt_tokens} tokens and the model "
            f"takes {max_model_len} in all, so at most {room} can be generated; lower min_tokens"
        )
    if asked is not None and asked > room:
        raise BadRequest(
            f"max_tokens {asked} does not fit: the chat is {prompt_tokens} tokens and the model takes "
            f"{max_model_len} in all, so at most {room} can be generated; lower max_tokens"
        )
    return SamplingOptions(
        max_tokens=asked if asked is not None else room,
        temperature=float(req.temperature),
        top_p=float(req.top_p),
        n=req.n,
        seed=req.seed,
        stop=tuple(req.stop_list()),
        min_tokens=min(req.min_tokens, asked if asked is not None else room),
        ignore_eos=req.ignore_eos,
    )


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string (not included, as in OpenAI's API), and whether one
    was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def wrong_task(info: EngineInfo) -> BadRequest:
    """The 400 for a scoring request to a generative model, or a chat completion to a scorer."""
    if info.task == ModelTask.GENERATE:
        return BadRequest(
            "this server runs a generative model (task generate, an LLM judge): the scoring endpoints "
            "(/score, /classify, /pooling, /embeddings, /get_reward) need a score head. Ask it with "
            "POST /v1/chat/completions, or serve a *ForSequenceClassification model with --task score"
        )
    return BadRequest(
        "this server runs a reward model with a score head (task score): /v1/chat/completions needs a "
        "generative model. Score with /score or /classify, or serve a causal LM with --task generate "
        "(RewardModel spec.model.task: generate)"
    )
