"""Credit assignment with RM scores: every mode and the group normalisation against values worked
out by hand."""

from __future__ import annotations

import math

import pytest

from rewardplane.sdk import (
    CreditAssignmentError,
    GroupNormalizedAssigner,
    RewardModelCreditAssigner,
    RewardplaneError,
    Rollout,
    Step,
    make_rm_grpo_assigner,
    make_rm_scalerl_assigner,
)


def rollout(rid: str, rewards: list[float], rm: object = None, prompt: str = "p", **meta: object) -> Rollout:
    steps = [
        Step(index=i, prev_obs=prompt if i == 0 else f"o{i}", action=f"a{i}", reward=r)
        for i, r in enumerate(rewards)
    ]
    m = dict(meta)
    if rm is not None:
        m["rm_score"] = rm
    return Rollout(id=rid, steps=steps, meta=m)


# env return of r1 = 1 + 2 = 3, rm = 0.5
@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("replace", 0.5),
        ("add", 3.5),
        ("multiply", 1.5),
        ("weighted", 0.25 * 3 + 0.75 * 0.5),  # alpha = 0.25
        ("bonus", 3 + 2.0 * 0.5),  # rm_coeff = 2
    ],
)
def test_every_mode_at_sequence_level_weights_every_step_with_the_rollout_value(
    mode: str, expected: float
) -> None:
    a = RewardModelCreditAssigner(mode=mode, rm_coeff=2.0, alpha=0.25)  # type: ignore[arg-type]
    w = a.compute([rollout("r1", [1.0, 2.0], rm=0.5)])
    assert w == {("r1", 0): pytest.approx(expected), ("r1", 1): pytest.approx(expected)}


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("replace", [0.5, -1.0]),
        ("add", [1.5, 1.0]),
        ("multiply", [0.5, -2.0]),
        ("weighted", [0.5 * 1 + 0.5 * 0.5, 0.5 * 2 + 0.5 * -1.0]),
        ("bonus", [1 + 0.5, 2 - 1.0]),
    ],
)
def test_every_mode_at_step_level_uses_each_steps_reward_and_score(mode: str, expected: list[float]) -> None:
    r = rollout("r", [1.0, 2.0])
    r.steps[0].info["rm_score"] = 0.5
    r.steps[1].info["rm_score"] = -1.0
    w = RewardModelCreditAssigner(mode=mode, score_level="step").compute([r])  # type: ignore[arg-type]
    assert [w[("r", 0)], w[("r", 1)]] == pytest.approx(expected)


def test_group_normalisation_by_first_observation_matches_hand_computed_values() -> None:
    # prompt A: returns (replace mode) 1, 2, 3 → mean 2, population std sqrt(2/3)
    # prompt B: 5, 5 → std 0 → (5 - 5) / (0 + eps) = 0
    # prompt C: a single rollout → 0
    rs = [
        rollout("a1", [0.0], rm=1.0, prompt="A"),
        rollout("a2", [0.0, 0.0], rm=2.0, prompt="A"),
        rollout("a3", [0.0], rm=3.0, prompt="A"),
        rollout("b1", [0.0], rm=5.0, prompt="B"),
        rollout("b2", [0.0], rm=5.0, prompt="B"),
        rollout("c1", [9.0], rm=7.0, prompt="C"),
    ]
    w = RewardModelCreditAssigner(mode="replace", inner_assigner=GroupNormalizedAssigner()).compute(rs)
    std = math.sqrt(2 / 3)
    assert w[("a1", 0)] == pytest.approx(-1 / std)
    assert w[("a2", 0)] == pytest.approx(0.0, abs=1e-9) and w[("a2", 1)] == w[("a2", 0)]
    assert w[("a3", 0)] == pytest.approx(1 / std)
    assert w[("b1", 0)] == 0.0 and w[("b2", 0)] == 0.0
    assert w[("c1", 0)] == 0.0
    assert len(w) == 7  # every step of every rollout


def test_group_key_in_meta_overrides_the_first_observation() -> None:
    # Same prompt text, but meta says two groups: x (returns 0, 2) and y (returns 10, 20, 30).
    rs = [
        rollout("x1", [0.0], rm=0.0, g="x"),
        rollout("x2", [0.0], rm=2.0, g="x"),
        rollout("y1", [0.0], rm=10.0, g="y"),
        rollout("y2", [0.0], rm=20.0, g="y"),
        rollout("y3", [0.0], rm=30.0, g="y"),
    ]
    w = make_rm_grpo_assigner(None, mode="replace", group_key="g").compute(rs)
    assert [w[("x1", 0)], w[("x2", 0)]] == pytest.approx([-1.0, 1.0])  # (0-1)/1, (2-1)/1
    s = math.sqrt(200 / 3)
    assert [w[(k, 0)] for k in ("y1", "y2", "y3")] == pytest.approx([-10 / s, 0.0, 10 / s])


def test_grpo_preset_combines_in_bonus_mode_before_normalising() -> None:
    # bonus with rm_coeff 0.5: values 1 + 0.5*2 = 2 and 0 + 0.5*0 = 0 → mean 1, std 1 → ±1
    rs = [rollout("r1", [1.0], rm=2.0), rollout("r2", [0.0], rm=0.0)]
    w = make_rm_grpo_assigner(2, rm_coeff=0.5).compute(rs)
    assert w == {("r1", 0): pytest.approx(1.0), ("r2", 0): pytest.approx(-1.0)}


def test_grpo_preset_refuses_a_group_of_the_wrong_size() -> None:
    rs = [
        rollout("r1", [1.0], rm=2.0),
        rollout("r2", [0.0], rm=0.0),
        rollout("r3", [0.0], rm=0.0, prompt="q"),
    ]
    with pytest.raises(CreditAssignmentError, match="group_size=2"):
        make_rm_grpo_assigner(2).compute(rs)


def test_scalerl_preset_divides_group_centred_values_by_the_batch_std() -> None:
    # replace: group A = (0, 2), group B = (4, 4). Centred: -1, 1, 0, 0.
    # batch std of the raw values (0, 2, 4, 4) = sqrt(mean of squared deviations from 2.5)
    rs = [
        rollout("a1", [0.0], rm=0.0, prompt="A"),
        rollout("a2", [0.0], rm=2.0, prompt="A"),
        rollout("b1", [0.0], rm=4.0, prompt="B"),
        rollout("b2", [0.0], rm=4.0, prompt="B"),
    ]
    batch_std = math.sqrt((2.5**2 + 0.5**2 + 1.5**2 + 1.5**2) / 4)
    w = make_rm_scalerl_assigner(2, mode="replace").compute(rs)
    assert [w[(k, 0)] for k in ("a1", "a2", "b1", "b2")] == pytest.approx(
        [-1 / batch_std, 1 / batch_std, 0.0, 0.0]
    )


def test_per_step_normalisation_pools_the_steps_of_a_group() -> None:
    # step rewards (replace, step level): r1 = [1, 3], r2 = [5]; pooled mean 3, std sqrt(8/3)
    r1, r2 = rollout("r1", [0.0, 0.0]), rollout("r2", [0.0])
    for r, scores in ((r1, [1.0, 3.0]), (r2, [5.0])):
        for s, v in zip(r.steps, scores, strict=True):
            s.info["rm_score"] = v
    inner = GroupNormalizedAssigner(per_step=True)
    w = RewardModelCreditAssigner("replace", score_level="step", inner_assigner=inner).compute([r1, r2])
    s = math.sqrt(8 / 3)
    assert [w[("r1", 0)], w[("r1", 1)], w[("r2", 0)]] == pytest.approx([-2 / s, 0.0, 2 / s])


def test_a_missing_score_names_the_rollout_and_step() -> None:
    with pytest.raises(CreditAssignmentError, match="rollout 'r2' has no 'rm_score'") as info:
        RewardModelCreditAssigner().compute([rollout("r1", [0.0], rm=1.0), rollout("r2", [0.0])])
    assert isinstance(info.value, RewardplaneError) and isinstance(info.value, ValueError)
    with pytest.raises(CreditAssignmentError, match="step 0 of rollout 'r1'"):
        RewardModelCreditAssigner(score_level="step").compute([rollout("r1", [0.0], rm=1.0)])


def test_vector_scores_need_a_declared_reduction() -> None:
    rs = [rollout("r1", [1.0], rm=[0.2, 0.8, 2.0])]
    with pytest.raises(CreditAssignmentError, match="vector score of 3 labels; declare how to reduce"):
        RewardModelCreditAssigner("replace").compute(rs)
    assert RewardModelCreditAssigner("replace", reduce="mean").compute(rs)[("r1", 0)] == pytest.approx(1.0)
    assert RewardModelCreditAssigner("replace", reduce=1).compute(rs)[("r1", 0)] == pytest.approx(0.8)
    assert RewardModelCreditAssigner("replace", reduce=max).compute(rs)[("r1", 0)] == pytest.approx(2.0)
    # a one-label vector is a scalar
    assert RewardModelCreditAssigner("replace").compute([rollout("r", [0.0], rm=[0.3])])[("r", 0)] == 0.3


def test_non_finite_scores_and_bad_settings_are_refused() -> None:
    with pytest.raises(CreditAssignmentError, match="non-finite"):
        RewardModelCreditAssigner().compute([rollout("r", [0.0], rm=float("nan"))])
    with pytest.raises(ValueError, match="unknown mode 'sum'"):
        RewardModelCreditAssigner(mode="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="alpha"):
        RewardModelCreditAssigner(alpha=1.5)
    with pytest.raises(ValueError, match="unknown reduce"):
        RewardModelCreditAssigner(reduce="median")  # type: ignore[arg-type]


def test_duplicate_step_keys_are_refused_and_inputs_are_not_modified() -> None:
    r = rollout("r", [1.0, 2.0], rm=0.5)
    with pytest.raises(CreditAssignmentError, match="appears twice"):
        RewardModelCreditAssigner().compute([r, r])
    RewardModelCreditAssigner(inner_assigner=GroupNormalizedAssigner()).compute([r])
    assert [s.reward for s in r.steps] == [1.0, 2.0]
