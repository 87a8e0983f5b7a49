"""What the reward-model examples share: a preference set made here, the Bradley–Terry loss, a
local reward server, and held-out evaluation through that server.

The preference set: a prompt, a preferred answer that ends politely and a rejected one that
ends rudely, with the closers drawn from word lists; the held-out pairs use other prompts. A
reward model that learns the preference scores held-out preferred answers above rejected ones.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerBase

from rewardplane.sdk import RewardClient, WeightPusher
from rewardplane.testing.servers import ServerHandle, free_port, start_server
from rewardplane.tinymodel import build_tiny_reward_model

GOOD = ["Happy to help!", "Thank you for asking.", "Hope this is clear.", "Glad to explain."]
BAD = ["whatever lol", "figure it out yourself", "no idea, stop asking", "not my problem"]
TOPICS = [
    "the sea",
    "gradient descent",
    "Paris",
    "Kubernetes",
    "a poem",
    "the moon",
    "tea",
    "rust",
    "maps",
    "jazz",
]


@dataclass(frozen=True)
class Pair:
    prompt: str
    chosen: str
    rejected: str


def preference_pairs(n: int, seed: int, topics: Sequence[str]) -> list[Pair]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        topic = rng.choice(topics)
        body = f"Here is something about {topic}."
        pairs.append(
            Pair(f"Tell me about {topic}.", f"{body} {rng.choice(GOOD)}", f"{body} {rng.choice(BAD)}")
        )
    return pairs


def text(prompt: str, answer: str) -> str:
    return f"{prompt}\n{answer}"


def split_sets(quick: bool) -> tuple[list[Pair], list[Pair]]:
    """Training pairs on the first topics, held-out pairs on the others."""
    train = preference_pairs(48 if quick else 256, seed=0, topics=TOPICS[:7])
    held_out = preference_pairs(24 if quick else 64, seed=1, topics=TOPICS[7:])
    return train, held_out


def bradley_terry_loss(
    model: torch.nn.Module, tok: PreTrainedTokenizerBase, batch: Sequence[Pair]
) -> torch.Tensor:
    """−log σ(r(chosen) − r(rejected)), averaged over the batch."""
    texts = [text(p.prompt, p.chosen) for p in batch] + [text(p.prompt, p.rejected) for p in batch]
    enc = tok(texts, return_tensors="pt", padding=True)
    rewards = model(**enc).logits[:, 0]
    chosen, rejected = rewards[: len(batch)], rewards[len(batch) :]
    return -F.logsigmoid(chosen - rejected).mean()


def train(
    model: torch.nn.Module,
    tok: PreTrainedTokenizerBase,
    pairs: Sequence[Pair],
    *,
    steps: int,
    lr: float,
    batch_size: int = 16,
    seed: int = 0,
) -> list[float]:
    """``steps`` Adam steps of the Bradley–Terry loss; returns the loss of each step."""
    return optimize(
        model,
        lambda rng: bradley_terry_loss(model, tok, rng.sample(list(pairs), min(batch_size, len(pairs)))),
        lambda losses: len(losses) < steps,
        lr=lr,
        seed=seed,
    )


def optimize(
    model: torch.nn.Module,
    loss_of: Callable[[random.Random], torch.Tensor],
    more: Callable[[list[float]], bool],
    *,
    lr: float,
    seed: int = 0,
) -> list[float]:
    """Adam steps on the trainable parameters, each on ``loss_of`` a batch drawn with the seeded
    generator, while ``more`` (the losses so far) holds; returns the loss of each step."""
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    rng = random.Random(seed)
    losses: list[float] = []
    model.train()
    while more(losses):
        loss = loss_of(rng)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def preference_accuracy(client: RewardClient, pairs: Sequence[Pair]) -> tuple[float, float]:
    """Through the server: the share of pairs whose preferred answer scores higher, and the mean
    margin (raw head outputs)."""
    chosen = client.score_batch([text(p.prompt, p.chosen) for p in pairs], normalize=False)
    rejected = client.score_batch([text(p.prompt, p.rejected) for p in pairs], normalize=False)
    margins = [float(c) - float(r) for c, r in zip(chosen, rejected, strict=True)]  # type: ignore[arg-type]
    return sum(m > 0 for m in margins) / len(margins), sum(margins) / len(margins)


@dataclass
class Setup:
    model_dir: Path
    server: ServerHandle
    client: RewardClient
    pusher: WeightPusher
    tokenizer: PreTrainedTokenizerBase

    def load_model(self, head_only: bool = False) -> torch.nn.Module:
        """The served base model, to train (``head_only``: only the score head trains)."""
        model = AutoModelForSequenceClassification.from_pretrained(self.model_dir, dtype=torch.float32)
        if head_only:
            for name, p in model.named_parameters():
                p.requires_grad = name.startswith("score.")
        return model


@contextmanager
def local_server(
    work: Path | None = None, model_dir: Path | None = None, **server_opts: object
) -> Iterator[Setup]:
    """A tiny base model (``model_dir``, else a tiny reward model built here), a reward server on
    loopback serving it (``server_opts`` become its flags), a scoring client and a weight pusher
    (gloo on CPU). Everything is stopped on exit."""
    work = work or Path(tempfile.mkdtemp(prefix="rewardplane-rm-example-"))
    # seed 1: the untrained model happens to prefer the rejected answers (16% right on the held-out set)
    model_dir = model_dir or build_tiny_reward_model(work / "base-rm", seed=1, head_std=0.05)
    token = secrets.token_hex(16)
    server = start_server(model_dir, work, token=token, startup_timeout_s=120, **server_opts)
    client = RewardClient(server.url, token=token)
    pusher = WeightPusher(
        [server.url],
        group_port=free_port(),
        token=token,
        device="cpu",
        trainer_host="127.0.0.1",
        timeout_s=120,
    )
    try:
        yield Setup(model_dir, server, client, pusher, AutoTokenizer.from_pretrained(model_dir))
    finally:
        pusher.close()
        client.close()
        server.stop()


def arguments(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer pairs and steps (what CI runs)")
    return p.parse_args()


@dataclass
class PreferenceRun:
    """One example's run: its options, the training and held-out pairs, the local server, and the
    held-out result before training (``report`` measures it again)."""

    args: argparse.Namespace
    train_pairs: list[Pair]
    held_out: list[Pair]
    setup: Setup
    before: tuple[float, float]

    def report(self, name: str, **extra: object) -> None:
        """The held-out result after training, against ``before`` (``report``)."""
        report(name, self.before, preference_accuracy(self.setup.client, self.held_out), **extra)


@contextmanager
def preference_run(description: str) -> Iterator[PreferenceRun]:
    """What every preference example does around its training: parse the options, make the pairs,
    start the local server and score the held-out pairs through it."""
    args = arguments(description)
    train_pairs, held_out = split_sets(args.quick)
    with local_server() as setup:
        yield PreferenceRun(args, train_pairs, held_out, setup, preference_accuracy(setup.client, held_out))


def report(name: str, before: tuple[float, float], after: tuple[float, float], **extra: object) -> None:
    """Print the held-out result and fail unless training moved it the right way."""
    print(f"held-out preferred > rejected: before {before[0]:.0%} (mean margin {before[1]:+.3f})")
    print(f"held-out preferred > rejected: after  {after[0]:.0%} (mean margin {after[1]:+.3f})")
    result = {
        "example": name,
        "before": before[0],
        "after": after[0],
        "margin_before": before[1],
        "margin_after": after[1],
    }
    print("RESULT " + json.dumps({**result, **extra}))
    assert after[1] > before[1] and after[0] >= 0.9, (
        "training did not make the server prefer the preferred answers"
    )
