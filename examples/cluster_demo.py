"""The local-cluster walk-through (what `scripts/dev.sh` runs once the RewardModel is applied):
score through the SDK, push new head weights through the operator (WeightSync), score again.

    KUBECONFIG=... python examples/cluster_demo.py [--name tiny-rm] [--model /tmp/rewardplane-tiny-rm]
"""

from __future__ import annotations

import argparse
import time

import torch
from _demo import TEXTS, one_label
from transformers import AutoModelForSequenceClassification

from rewardplane.sdk import RewardModelTrainingMode, select_head
from rewardplane.sdk.cluster import RewardModelHandle


def wait_ready_saying_why(rm: RewardModelHandle, timeout_s: float) -> None:
    """wait_ready, printing what is awaited and each change of the model's status meanwhile."""
    print(
        f"waiting up to {timeout_s:.0f}s for RewardModel {rm.namespace}/{rm.name}: every replica ready "
        "and serving the model's weights version",
        flush=True,
    )
    deadline, last = time.monotonic() + timeout_s, ""
    while True:
        try:
            rm.wait_ready(timeout_s=max(0.0, min(5.0, deadline - time.monotonic())))
            return
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise
        status = rm.get().get("status") or {}
        line = f"  {status.get('phase', 'Pending')} {status.get('ready', '?')}: {status.get('message', 'no status yet')}"
        if line != last:
            print(line, flush=True)
            last = line


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default="tiny-rm")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--model", default="/tmp/rewardplane-tiny-rm")
    args = ap.parse_args()

    rm = RewardModelHandle(args.name, args.namespace)
    wait_ready_saying_why(rm, 300)
    print(f"ready: {[e.url for e in rm.get_endpoints()]}")
    client = rm.client()
    before = one_label(client.score_batch(TEXTS, normalize=False))
    print(f"scores at version {rm.get_weights_version()}: {[round(s, 4) for s in before]}")

    trainer = AutoModelForSequenceClassification.from_pretrained(args.model, dtype=torch.float32)
    with torch.no_grad():  # stand-in for a training step on the head
        trainer.score.weight.mul_(-1.0)
    version = rm.get_weights_version() + 1
    start = time.perf_counter()
    result = rm.push_weights(select_head(trainer.state_dict()), version, RewardModelTrainingMode.HEAD_ONLY)
    print(
        f"pushed version {result.version} to {result.replicas} replica(s) through the operator in "
        f"{1000 * (time.perf_counter() - start):.0f} ms"
    )
    after = one_label(rm.client().score_batch(TEXTS, normalize=False))  # the handle owns its client
    print(f"scores at version {rm.get_weights_version()}: {[round(s, 4) for s in after]}")
    if not all(abs(a + b) < 1e-3 for a, b in zip(after, before, strict=True)):
        print("the served scores do not reflect the push")
        return 1
    print("ok: the new weights serve, without a restart")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
