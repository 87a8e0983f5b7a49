"""Direct mode on one machine, no cluster: start a reward server on a tiny model, score texts with
the SDK, push new head weights into the running server over gloo, and score again.

    .venv/bin/python examples/quickstart_direct.py
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _demo import TEXTS, one_label
from transformers import AutoModelForSequenceClassification

from rewardplane.sdk import RewardClient, RewardModelTrainingMode, WeightPusher, select_head
from rewardplane.tinymodel import build_tiny_reward_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="rewardplane-quickstart-"))
    model_dir = build_tiny_reward_model(work / "tiny-rm")
    token = secrets.token_hex(16)
    port = free_port()
    env = dict(os.environ, REWARDPLANE_TOKEN=token)
    with open(work / "server.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "rewardplane.server", "--model", str(model_dir), "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        client = RewardClient(url, token=token)
        client.check_server(120)  # the server loads the model first
        pusher = WeightPusher(
            [url], group_port=free_port(), token=token, device="cpu", trainer_host="127.0.0.1"
        )
        before = one_label(client.score_batch(TEXTS, normalize=False))
        print(f"scores (version {client.get_model_version()}): {[round(s, 4) for s in before]}")

        trainer = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():  # stand-in for a training step on the reward head
            trainer.score.weight.mul_(-1.0)
        start = time.perf_counter()
        version = pusher.push(
            select_head(trainer.state_dict()), version=1, training_mode=RewardModelTrainingMode.HEAD_ONLY
        )
        print(
            f"pushed head-only weights as version {version} in {1000 * (time.perf_counter() - start):.1f} ms"
        )
        after = one_label(client.score_batch(TEXTS, normalize=False))
        print(f"scores (version {client.get_model_version()}): {[round(s, 4) for s in after]}")
        assert all(abs(a + b) < 1e-4 for a, b in zip(after, before, strict=True)), "the push did not take"
        pusher.close()
        client.close()
        print("ok: scored, pushed in memory without a restart, and scored again")
        return 0
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    raise SystemExit(main())
