"""The push's one options object: both front doors build a ``PushOptions`` from the keywords their
users call, and the push package never imports the cluster handle that calls it (not even for
type checking, which the import contracts do not read), so the old import circle stays gone."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from rewardplane.protocol import RewardModelTrainingMode
from rewardplane.protocol.naming import DEFAULT_HEAD_PATTERNS
from rewardplane.sdk import RewardModelHandle, WeightPusher
from rewardplane.sdk.push.options import PushOptions
from rewardplane.sdk.push.wire.operator import OperatorPush

PUSH = Path(__file__).resolve().parents[2] / "sdk/src/rewardplane/sdk/push"


def test_the_pusher_builds_its_options_from_its_keywords() -> None:
    pusher = WeightPusher(
        ["http://127.0.0.1:9"],
        group_port=29999,
        token="secret",
        device="cpu",
        bucket_bytes=1 << 16,
        atomic=True,
        head_name_patterns=["score"],
        data_plane=False,
        delta=True,
        timeout_s=5.0,
    )
    try:
        opts = pusher.options
        assert (opts.bucket_bytes, opts.atomic, opts.data_plane, opts.delta, opts.timeout_s) == (
            1 << 16,
            True,
            False,
            True,
            5.0,
        )
        assert opts.device == torch.device("cpu") and pusher.device == torch.device("cpu")
        assert opts.head_patterns == ("score",)
        one = opts.for_push(keep_lora=True, adapter=None)
        assert one.keep_lora and one.delta  # a push's delta defaults to the pusher's
        assert not opts.for_push(keep_lora=False, adapter=None, delta=False).delta
        assert not opts.keep_lora  # frozen: the pusher's own options are untouched
    finally:
        pusher.control.close()


def test_the_handle_builds_the_same_options_once_for_the_operator_push(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[PushOptions] = []

    def push(self: OperatorPush, metadata: Any, tensors: Any, **kw: Any) -> str:
        seen.append(kw["options"])
        return "pushed"

    handle = RewardModelHandle("rm", "ns", kube=object())  # type: ignore[arg-type]
    monkeypatch.setattr(handle, "prepare", lambda *a, **kw: ([], {"w": torch.zeros(1)}))
    monkeypatch.setattr(OperatorPush, "push", push)
    monkeypatch.setattr(OperatorPush, "__init__", lambda self, handle: None)
    result = handle.push_weights(
        {"w": torch.zeros(1)},
        3,
        RewardModelTrainingMode.HEAD_ONLY,
        trainer_host="10.0.0.1",
        timeout_s=7.0,
        bucket_bytes=1 << 12,
        keep_lora=True,
        progress=False,
    )
    assert result == "pushed" and len(seen) == 1
    opts = seen[0]
    assert (opts.trainer_host, opts.timeout_s, opts.bucket_bytes, opts.keep_lora, opts.progress) == (
        "10.0.0.1",
        7.0,
        1 << 12,
        True,
        False,
    )
    assert opts.head_patterns == DEFAULT_HEAD_PATTERNS


def test_no_push_module_imports_the_cluster_handle() -> None:
    offenders = []
    for path in sorted(PUSH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.endswith(".cluster") or n == "cluster" for n in names):
                offenders.append(f"{path.relative_to(PUSH)}:{node.lineno}")
    assert not offenders, offenders
