"""rewardplane as the reward model of RL frameworks, each a few lines over the SDK's scoring clients.

- TRL: :class:`TRLRewardFunction` is a ``reward_funcs`` entry of ``GRPOTrainer``
  (``(prompts, completions, **kwargs) -> list[float]``), standard or conversational data.
- verl: :func:`verl_compute_score` is a ``custom_reward_function`` (async, as verl's reward loop
  prefers); the server address comes from ``reward_kwargs`` or ``REWARDPLANE_URL``.
- OpenRLHF: :func:`openrlhf_remote_url` gives the ``--reward.remote_url`` value for the servers;
  OpenRLHF's own client then posts to each server's ``/get_reward`` (a process reward model answers
  there with its steps' aggregate, the server's ``--step-aggregation``).

Process reward models: ``TRLRewardFunction(process=True)`` gives GRPO the aggregate of the
completion's steps as its scalar; :func:`verl_compute_process_score` returns the aggregate with the
step scores beside it, and :class:`VerlProcessRewardManager` gives verl dense per-token rewards
(each step's score on the response token that completes the step).

Scores are raw head outputs (``normalize=False``) unless asked otherwise: what RL training uses.
Docs: ``docs/integrations/``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rewardplane.protocol import Endpoints, Score, ScoringResult, StepAggregation, settings

from ._process_rewards import token_rewards
from .async_client import AsyncRewardClient
from .client import RewardClient

URL_ENV = settings.URL.name  # comma-separated base URLs of the reward servers
MODEL_ENV = settings.MODEL.name


def _float(score: Score, label: int | None) -> float:
    if isinstance(score, list):
        if label is None:
            raise ValueError(
                f"the reward model has {len(score)} labels but the trainer needs one float per "
                "completion: pass label=<index> to pick one"
            )
        return float(score[label])
    return float(score)


def _aggregate(result: ScoringResult) -> float:
    if isinstance(result.score, list):
        raise ValueError(
            "the process reward model answered step scores without an aggregate: pass aggregation='min' "
            "(or mean, last, product), or start the server with --step-aggregation"
        )
    return float(result.score)


def _is_chat(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(m, Mapping) for m in x)


class TRLRewardFunction:
    """A TRL reward function backed by rewardplane servers.

    ``GRPOTrainer(reward_funcs=[TRLRewardFunction(endpoints=["http://rm:8001"])], ...)``.
    Standard data (strings) is scored as ``prompt + completion``; conversational data (message
    lists) as ``prompt + completion`` messages through the model's chat template on the server.
    ``process=True`` (a process reward model): each completion's steps (split at the server's step
    separator) are scored after its prompt and the reward is their aggregate (``aggregation``, else
    the server's).
    """

    def __init__(
        self,
        client: RewardClient | None = None,
        *,
        endpoints: Sequence[str] | None = None,
        normalize: bool = False,
        label: int | None = None,
        name: str = "rewardplane",
        process: bool = False,
        aggregation: StepAggregation | str | None = None,
        **client_kwargs: Any,
    ) -> None:
        if client is None and not endpoints:
            raise ValueError("give a RewardClient or endpoints=['http://host:port', ...]")
        self.client = client or RewardClient(endpoints or [], **client_kwargs)
        self.normalize = normalize
        self.label = label
        self.process = process
        self.aggregation = aggregation
        self.__name__ = name  # TRL names the reward's logged metrics after the function

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        if self.process:
            results = self.client.score_steps(
                [str(c) for c in completions],
                prompts=[str(p) for p in prompts],
                aggregation=self.aggregation,
                normalize=self.normalize,
            )
            return [_aggregate(r) for r in results]
        if completions and _is_chat(completions[0]):
            chats = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
            scores = self.client.score_chats(chats, normalize=self.normalize)
        else:
            texts = [str(p) + str(c) for p, c in zip(prompts, completions, strict=True)]
            scores = self.client.score_batch(texts, normalize=self.normalize)
        return [_float(s, self.label) for s in scores]


_clients: dict[tuple[str, str], AsyncRewardClient] = {}
_clients_lock = threading.Lock()


def _shared_client(url: str | None, model: str | None) -> AsyncRewardClient:
    url = url or settings.URL.get()
    if not url:
        raise ValueError(
            f"no reward server address: set custom_reward_function.reward_kwargs.url or {URL_ENV} "
            "(comma-separated base URLs, e.g. http://rm-0.rm:8001)"
        )
    model = model or settings.MODEL.get()
    key = (url, model)
    with _clients_lock:  # verl calls this from many tasks and threads; one client per address
        if key not in _clients:
            _clients[key] = AsyncRewardClient(
                [u.strip() for u in url.split(",") if u.strip()], model_name=model
            )
        return _clients[key]


async def verl_compute_score(
    data_source: Any,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    *,
    url: str | None = None,
    model: str | None = None,
    normalize: bool = False,
    **kwargs: Any,
) -> dict[str, float]:
    """verl ``custom_reward_function``: the reward model's score of the response.

    verl passes only the response text; the prompt is taken from the dataset's
    ``extra_info["prompt"]`` when present — a string is prepended to the response, a list of chat
    messages gets the response appended as the assistant's turn and goes through the model's chat
    template. Returns ``{"score": float}``.
    """
    client = _shared_client(url, model)
    prompt = (extra_info or {}).get("prompt")
    if _is_chat(prompt):
        chat = [*list(prompt or []), {"role": "assistant", "content": solution_str}]
        score = (await client.score_chats([chat], normalize=normalize))[0]
    else:
        text = (prompt if isinstance(prompt, str) else "") + solution_str
        score = (await client.score_batch([text], normalize=normalize))[0]
    return {"score": _float(score, None)}


def openrlhf_remote_url(endpoints: str | Sequence[str]) -> str:
    """``--reward.remote_url`` (``--remote_rm_url`` in older OpenRLHF) for rewardplane servers.

    OpenRLHF shards each batch over the comma-separated URLs and posts ``{"query", "prompts",
    "labels"}`` to each; rewardplane answers ``{"rewards", "scores", "extra_logs"}`` there.
    """
    urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    if not urls:
        raise ValueError("no endpoints: give the reward servers' base URLs")
    out = []
    for u in urls:
        base = u.strip().rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"endpoint {u!r} is not an http(s) base URL like 'http://rm-0.rm:8001'")
        out.append(base if base.endswith(Endpoints.GET_REWARD) else base + Endpoints.GET_REWARD)
    return ",".join(out)


async def verl_compute_process_score(
    data_source: Any,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    *,
    url: str | None = None,
    model: str | None = None,
    aggregation: StepAggregation | str | None = None,
    normalize: bool = True,
    **kwargs: Any,
) -> dict[str, Any]:
    """verl ``custom_reward_function`` for a process reward model: the response's steps (split at the
    server's step separator) scored after ``extra_info["prompt"]`` (a string) in one pass. Returns
    ``{"score": aggregate, "step_scores": [...], "step_ends": [...]}`` (verl logs the extra keys);
    ``step_ends`` are the steps' end characters in the response."""
    client = _shared_client(url, model)
    prompt = (extra_info or {}).get("prompt")
    (result,) = await client.score_steps(
        [solution_str],
        prompts=[prompt if isinstance(prompt, str) else ""],
        aggregation=aggregation,
        normalize=normalize,
    )
    steps = result.steps or []
    return {
        "score": _aggregate(result),
        "step_scores": [s.score for s in steps],
        "step_ends": [s.span[1] for s in steps],
    }


def token_ends(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """Where each token of ``ids`` ends in ``tokenizer.decode(ids)`` (characters)."""
    return [len(tokenizer.decode(list(ids[: k + 1]), skip_special_tokens=True)) for k in range(len(ids))]


class VerlProcessRewardManager:
    """A verl reward manager (verl's ``AbstractRewardManager`` shape: ``__init__(tokenizer,
    num_examine, compute_score, reward_fn_key, **kwargs)``, ``__call__(data, return_dict)``) giving
    dense per-token rewards from a process reward model: each step's score on the response token
    that completes it, 0 elsewhere, so the reward tensor sums to the steps' scores.

    Each response is decoded and scored as one solution (steps split at the server's separator),
    after its decoded prompt, in one ``score_steps`` call per batch. ``reward_kwargs`` may carry
    ``url``, ``model``, ``aggregation`` and ``normalize`` (True: step probabilities).
    """

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int = 0,
        compute_score: Any = None,
        reward_fn_key: str = "data_source",
        *,
        client: RewardClient | None = None,
        url: str | None = None,
        model: str | None = None,
        aggregation: StepAggregation | str | None = None,
        normalize: bool = True,
        **kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.reward_fn_key = reward_fn_key
        url = url or settings.URL.get()
        if client is None and not url:
            raise ValueError(f"no reward server address: pass url= or set {URL_ENV}")
        self.client = client or RewardClient(
            [u.strip() for u in (url or "").split(",") if u.strip()], model_name=model or settings.MODEL.get()
        )
        self.aggregation = aggregation
        self.normalize = normalize

    def __call__(self, data: Any, return_dict: bool = False) -> Any:
        import torch

        prompts, responses = data.batch["prompts"], data.batch["responses"]
        prompt_len = prompts.shape[-1]
        mask = data.batch["attention_mask"]
        prompt_lens = mask[:, :prompt_len].sum(-1).tolist()
        response_lens = mask[:, prompt_len:].sum(-1).tolist()
        prompt_texts, texts, ends = [], [], []
        for i in range(len(responses)):
            ids = responses[i, : int(response_lens[i])].tolist()
            prompt_ids = prompts[i, prompt_len - int(prompt_lens[i]) :].tolist()  # verl left-pads prompts
            prompt_texts.append(self.tokenizer.decode(prompt_ids, skip_special_tokens=True))
            texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
            ends.append(token_ends(self.tokenizer, ids))
        results = self.client.score_steps(
            texts, prompts=prompt_texts, aggregation=self.aggregation, normalize=self.normalize
        )
        reward = torch.zeros(responses.shape, dtype=torch.float32)
        for i, (res, tok_ends) in enumerate(zip(results, ends, strict=True)):
            steps = res.steps or []
            dense = token_rewards([s.score for s in steps], [s.span[1] for s in steps], tok_ends)
            reward[i, : len(dense)] = torch.tensor(dense, dtype=torch.float32)
        if not return_dict:
            return reward
        return {"reward_tensor": reward, "reward_extra_info": {"prm_score": [r.score for r in results]}}
