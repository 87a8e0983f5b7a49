"""The trainer ranks agree on who sends what once, and again whenever any rank's parts change: two
real processes in a gloo group (``TrainerRanks.plan_of``); each push's plan gets its own layout
(``ShardedLayout.of``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rewardplane.protocol import ParamMeta, RewardModelTrainingMode
from rewardplane.protocol.naming import WeightValidationError
from rewardplane.sdk.push.plan.layout import TensorPiece, local_parts, plan_senders
from rewardplane.sdk.push.ranks.operator import ranks_state
from rewardplane.sdk.push.ranks.trainer import ShardedLayout, TrainerRanks
from rewardplane.testing.servers import free_port


def _rank(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ranks = TrainerRanks(dist.new_group([0, 1], backend="gloo"))
        w = torch.arange(32.0).reshape(8, 4)
        halves = {"w": TensorPiece.even(w.chunk(2)[rank], 0, rank, 2), "b": torch.zeros(4)}
        first = ranks.plan_of(local_parts(halves)[1])
        again = ranks.plan_of(local_parts(halves)[1])
        # only rank 1 changes what it passes (a key the other rank lacks): both must refuse it
        refused = None
        try:
            ranks.plan_of(local_parts(halves if rank == 0 else {**halves, "c": torch.ones(2)})[1])
        except WeightValidationError as exc:
            refused = str(exc)
        # both ranks split differently now: a new plan on both
        rows = (0, 2) if rank == 0 else (2, 8)
        uneven = {"w": TensorPiece(w[rows[0] : rows[1]], 0, rows[0], (8, 4)), "b": torch.zeros(4)}
        fourth = ranks.plan_of(local_parts(uneven)[1])
        result = {
            "cached": again is first,
            "refused": refused,
            "first": [[p.sender, p.start, p.stop] for p in first.metas["w"].pieces],
            "fourth": [[p.sender, p.start, p.stop] for p in fourth.metas["w"].pieces],
        }
        (out / f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_a_change_on_any_rank_replans_every_rank(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(free_port(), tmp_path), nprocs=2, join=True)
    for r in (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)):
        assert r["cached"], r  # nothing changed: the plan agreed before, no exchange of parts
        assert r["refused"] is not None and "extra ['c']" in r["refused"], r
        assert r["first"] == [[0, 0, 4], [1, 4, 8]] and r["fourth"] == [[0, 0, 2], [1, 2, 8]], r


def test_a_delta_plan_made_where_an_earlier_one_was_gets_its_own_layout() -> None:
    # A delta push's plan (``PushPlan.only``) lives for one push; the next one is often allocated at
    # the same address. Each must get the layout of its own tensors, never the earlier one's.
    full = plan_senders([local_parts({"a": torch.zeros(4), "b": torch.zeros(8), "c": torch.zeros(2)})[1]])
    layout = ShardedLayout(None, (), 1 << 20)
    for keys in (["a"], ["b", "c"], ["c"], ["a", "b"]) * 3:
        _, metadata, _, _ = layout.of(
            full.only(keys), RewardModelTrainingMode.FULL, False, None, None, partial=True
        )
        assert [m.name for m in metadata] == sorted(keys), keys


def _handle_rank(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        w = torch.arange(32.0).reshape(8, 4)
        parts = local_parts({"w": TensorPiece.even(w.chunk(2)[rank], 0, rank, 2)})[1]
        # two operator pushes from the same group: what the handle keeps between them
        first = ranks_state(None, group)
        plan = first.ranks.plan_of(parts)
        layout = first.layout({"w"}, ("score",), 1 << 20)
        second = ranks_state(first, group)
        result = {
            "same_state": second is first,
            "same_plan": second.ranks.plan_of(parts) is plan,
            "same_layout": second.layout({"w"}, ("score",), 1 << 20) is layout,
            "other_bucket_size": second.layout({"w"}, ("score",), 1 << 10) is not layout,
            "other_group": ranks_state(second, dist.new_group([0, 1], backend="gloo")) is not second,
        }
        (out / f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_a_handle_keeps_the_agreed_plan_and_layout_from_one_operator_push_to_the_next(
    tmp_path: Path,
) -> None:
    mp.spawn(_handle_rank, args=(free_port(), tmp_path), nprocs=2, join=True)
    for r in (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)):
        assert r == {
            "same_state": True,
            "same_plan": True,
            "same_layout": True,
            "other_bucket_size": True,
            "other_group": True,
        }, r


def test_a_kept_layout_is_checked_against_the_served_model_on_every_push() -> None:
    # the operator's replicas can be changed to another model between two pushes of one plan
    plan = plan_senders([local_parts({"w": torch.zeros(4, 2), "b": torch.zeros(2)})[1]])
    layout = ShardedLayout({"w", "b"}, (), 1 << 20)
    fits = {
        "w": ParamMeta(name="w", dtype="float32", shape=(4, 2)),
        "b": ParamMeta(name="b", dtype="float32", shape=(2,)),
    }
    first = layout.of(plan, RewardModelTrainingMode.FULL, False, None, fits)
    assert layout.of(plan, RewardModelTrainingMode.FULL, False, None, fits) == first
    wider = {**fits, "w": ParamMeta(name="w", dtype="float32", shape=(4, 3))}
    with pytest.raises(WeightValidationError, match="do not fit the served model"):
        layout.of(plan, RewardModelTrainingMode.FULL, False, None, wider)
