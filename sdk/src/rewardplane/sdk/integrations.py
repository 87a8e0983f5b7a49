"""rewardplane as the reward model of RL frameworks, each a few lines over the SDK's scoring clients.

- TRL: :class:`TRLRewardFunction` is a ``reward_funcs`` entry of ``GRPOTrainer``
  (``(prompts, completions, **kwargs) -> list[float]``), standard or conversational data.
- verl: :func:`verl_compute_score` is a ``custom_reward_function`` (async, as verl's reward loop
  prefers); the server address comes from ``reward_kwargs`` or ``REWARDPLANE_URL``.
- OpenRLHF: :func:`openrlhf_remote_url` gives the ``--reward.remote_url`` value for the servers;
  OpenRLHF's own client then posts to each server's ``/get_reward``.

Scores are raw head outputs (``normalize=False``) unless asked otherwise: what RL training uses.
Docs: ``docs/integrations/``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rewardplane.protocol import Endpoints, Score, settings

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


def _is_chat(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(m, Mapping) for m in x)


class TRLRewardFunction:
    """A TRL reward function backed by rewardplane servers.

    ``GRPOTrainer(reward_funcs=[TRLRewardFunction(endpoints=["http://rm:8001"])], ...)``.
    Standard data (strings) is scored as ``prompt + completion``; conversational data (message
    lists) as ``prompt + completion`` messages through the model's chat template on the server.
    """

    def __init__(
        self,
        client: RewardClient | None = None,
        *,
        endpoints: Sequence[str] | None = None,
        normalize: bool = False,
        label: int | None = None,
        name: str = "rewardplane",
        **client_kwargs: Any,
    ) -> None:
        if client is None and not endpoints:
            raise ValueError("give a RewardClient or endpoints=['http://host:port', ...]")
        self.client = client or RewardClient(endpoints or [], **client_kwargs)
        self.normalize = normalize
        self.label = label
        self.__name__ = name  # TRL names the reward's logged metrics after the function

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
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
