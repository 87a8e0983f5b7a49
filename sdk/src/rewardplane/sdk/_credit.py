"""Credit assignment with reward-model scores: rollouts → one weight per step. Pure logic, no I/O.

Scores are read from the rollouts (``RewardModelScorer`` writes them; any other source works),
so the assigner is synchronous and unit-testable with plain data.

A ``CreditAssigner`` is anything with ``compute(rollouts) -> {(rollout_id, step_index): weight}``
that returns a weight for every step of every rollout. :class:`RewardModelCreditAssigner`
combines the env reward with the RM score, then optionally hands the combined rewards to an
inner assigner, such as :class:`GroupNormalizedAssigner` (GRPO-style advantages).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict, get_args

from ._exceptions import CreditAssignmentError
from ._rollout import Rollout, RolloutStepKey, Step

if TYPE_CHECKING:
    from typing_extensions import Unpack

CombineMode = Literal["replace", "add", "multiply", "weighted", "bonus"]
ScoreLevel = Literal["sequence", "step"]
ReductionName = Literal["mean", "sum", "max", "min", "first", "last"]
Reduction = ReductionName | int | Callable[[Sequence[float]], float]
"""How a vector score (``n_labels > 1``) becomes one number: a name, a label index, or a function."""

StdScope = Literal["group", "batch"]

_REDUCTIONS: dict[str, Callable[[Sequence[float]], float]] = {
    "mean": lambda v: sum(v) / len(v),
    "sum": lambda v: float(sum(v)),
    "max": lambda v: float(max(v)),
    "min": lambda v: float(min(v)),
    "first": lambda v: float(v[0]),
    "last": lambda v: float(v[-1]),
}


class CreditAssigner(Protocol):
    """Maps rollouts to a weight for every step of every rollout."""

    def compute(self, rollouts: Sequence[Rollout]) -> dict[RolloutStepKey, float]: ...


def combine(mode: CombineMode, env: float, rm: float, *, rm_coeff: float = 1.0, alpha: float = 0.5) -> float:
    """One combined reward from the env reward and the RM score.

    ``replace`` → rm; ``add`` → env + rm; ``multiply`` → env × rm; ``weighted`` →
    α·env + (1−α)·rm; ``bonus`` → env + rm_coeff·rm.
    """
    if mode == "replace":
        return rm
    if mode == "add":
        return env + rm
    if mode == "multiply":
        return env * rm
    if mode == "weighted":
        return alpha * env + (1.0 - alpha) * rm
    if mode == "bonus":
        return env + rm_coeff * rm
    raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(get_args(CombineMode))}")


def reduce_score(value: Any, reduce: Reduction | None, *, where: str) -> float:
    """A stored score as one finite float; ``where`` names it in errors ("rollout 'r1'")."""
    if isinstance(value, bool) or not isinstance(value, int | float | list | tuple):
        raise CreditAssignmentError(
            f"{where} has a score of type {type(value).__name__} ({value!r}); expected a number or a "
            "list of numbers as the reward server returns"
        )
    if isinstance(value, list | tuple):
        if len(value) == 0:
            raise CreditAssignmentError(f"{where} has an empty score vector")
        floats = [float(v) for v in value]
        if len(floats) == 1:
            result = floats[0]
        elif reduce is None:
            raise CreditAssignmentError(
                f"{where} has a vector score of {len(floats)} labels; declare how to reduce it: "
                "reduce='mean'|'sum'|'max'|'min'|'first'|'last', a label index (reduce=0), or a "
                "function of the list"
            )
        elif isinstance(reduce, int) and not isinstance(reduce, bool):
            if not -len(floats) <= reduce < len(floats):
                raise CreditAssignmentError(
                    f"{where}: reduce={reduce} selects a label, but the score has {len(floats)} labels"
                )
            result = floats[reduce]
        elif callable(reduce):
            result = float(reduce(floats))
        else:
            result = _REDUCTIONS[str(reduce)](floats)
    else:
        result = float(value)
    if not math.isfinite(result):
        raise CreditAssignmentError(
            f"{where} has a non-finite score ({result}); refusing to train on it (check the reward "
            "model's outputs, e.g. for a diverged push)"
        )
    return result


def _check_reduction(reduce: Reduction | None) -> None:
    if reduce is None or callable(reduce) or (isinstance(reduce, int) and not isinstance(reduce, bool)):
        return
    if reduce not in _REDUCTIONS:
        raise ValueError(
            f"unknown reduce={reduce!r}: use one of {', '.join(_REDUCTIONS)}, a label index or a function"
        )


def _check_unique(rollouts: Sequence[Rollout]) -> None:
    seen: set[RolloutStepKey] = set()
    for r in rollouts:
        for s in r.steps:
            key = (r.id, s.index)
            if key in seen:
                raise CreditAssignmentError(
                    f"step {s.index} of rollout {r.id!r} appears twice; rollout ids and step indices "
                    "must be unique, since weights are keyed by (rollout id, step index)"
                )
            seen.add(key)


class RewardModelCreditAssigner:
    """Combines env rewards with reward-model scores into per-step weights.

    Args:
        mode: how env and rm combine (see :func:`combine`); ``bonus`` by default.
        rm_coeff: the RM's coefficient in ``bonus`` mode.
        alpha: the env reward's share in ``weighted`` mode (0 ≤ α ≤ 1).
        rm_score_key: where the scores are: ``rollout.meta[key]`` at sequence level,
            ``step.info[key]`` at step level.
        score_level: ``sequence`` — env is the rollout's return and every step of a rollout gets
            the rollout's value; ``step`` — env is the step's reward and each step gets its own.
        inner_assigner: given rollouts whose rewards are the combined values (at sequence level on
            the last step, 0 elsewhere, so the return is the combined value), computes the final
            weights — e.g. :class:`GroupNormalizedAssigner`. ``None``: the combined values are the
            weights.
        reduce: how a vector score (``n_labels > 1``) becomes one number; without it a vector is
            refused.

    A missing score raises :class:`CreditAssignmentError` naming the rollout (and step).
    """

    def __init__(
        self,
        mode: CombineMode = "bonus",
        rm_coeff: float = 1.0,
        alpha: float = 0.5,
        rm_score_key: str = "rm_score",
        score_level: ScoreLevel = "sequence",
        inner_assigner: CreditAssigner | None = None,
        *,
        reduce: Reduction | None = None,
    ) -> None:
        if mode not in get_args(CombineMode):
            raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(get_args(CombineMode))}")
        if score_level not in get_args(ScoreLevel):
            raise ValueError(f"score_level must be 'sequence' or 'step', got {score_level!r}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(
                f"alpha is the env reward's share in weighted mode; it must be in [0, 1], got {alpha}"
            )
        if not math.isfinite(rm_coeff):
            raise ValueError(f"rm_coeff must be finite, got {rm_coeff}")
        _check_reduction(reduce)
        self.mode: CombineMode = mode
        self.rm_coeff = float(rm_coeff)
        self.alpha = float(alpha)
        self.rm_score_key = rm_score_key
        self.score_level: ScoreLevel = score_level
        self.inner_assigner = inner_assigner
        self.reduce = reduce

    def _combine(self, env: float, rm: float) -> float:
        return combine(self.mode, env, rm, rm_coeff=self.rm_coeff, alpha=self.alpha)

    def _rm_of_rollout(self, r: Rollout) -> float:
        if self.rm_score_key not in r.meta:
            raise CreditAssignmentError(
                f"rollout {r.id!r} has no {self.rm_score_key!r} in meta; score the rollouts first "
                "(await RewardModelScorer(client).score(rollouts)) or set rm_score_key to the key "
                "your scores are stored under"
            )
        return reduce_score(r.meta[self.rm_score_key], self.reduce, where=f"rollout {r.id!r}")

    def _rm_of_step(self, r: Rollout, s: Step) -> float:
        if self.rm_score_key not in s.info:
            raise CreditAssignmentError(
                f"step {s.index} of rollout {r.id!r} has no {self.rm_score_key!r} in info; score at "
                "step level first (RewardModelScorer(client, score_level='step')) or set rm_score_key"
            )
        return reduce_score(
            s.info[self.rm_score_key], self.reduce, where=f"step {s.index} of rollout {r.id!r}"
        )

    def combined_rewards(self, rollouts: Sequence[Rollout]) -> list[Rollout]:
        """Copies of ``rollouts`` whose step rewards are the combined values (inputs untouched)."""
        out: list[Rollout] = []
        for r in rollouts:
            if self.score_level == "step":
                steps = [replace(s, reward=self._combine(s.reward, self._rm_of_step(r, s))) for s in r.steps]
            else:
                value = self._combine(r.total_reward(), self._rm_of_rollout(r))
                last = len(r.steps) - 1
                steps = [replace(s, reward=value if i == last else 0.0) for i, s in enumerate(r.steps)]
            out.append(replace(r, steps=steps))
        return out

    def compute(self, rollouts: Sequence[Rollout]) -> dict[RolloutStepKey, float]:
        """A weight for every step of every rollout, keyed by ``(rollout.id, step.index)``."""
        _check_unique(rollouts)
        combined = self.combined_rewards(rollouts)
        if self.inner_assigner is not None:
            weights = self.inner_assigner.compute(combined)
            missing = [(r.id, s.index) for r in rollouts for s in r.steps if (r.id, s.index) not in weights]
            if missing:
                raise CreditAssignmentError(
                    f"the inner assigner {type(self.inner_assigner).__name__} returned no weight for "
                    f"{len(missing)} step(s), e.g. {missing[:3]}; it must weight every step"
                )
            return weights
        if self.score_level == "step":
            return {(r.id, s.index): s.reward for r in combined for s in r.steps}
        return {(r.id, s.index): r.total_reward() for r in combined for s in r.steps}


def _group_of(r: Rollout, group_key: str | None) -> Hashable:
    if group_key is not None and group_key in r.meta:
        value = r.meta[group_key]
        return value if isinstance(value, Hashable) else repr(value)
    if not r.steps:
        raise CreditAssignmentError(
            f"rollout {r.id!r} has no steps, so it cannot be grouped by its first observation; "
            f"set meta[{group_key or 'group_key'!r}] or drop the empty rollout"
        )
    return ("prev_obs", r.steps[0].prev_obs)


class GroupNormalizedAssigner:
    """GRPO-style advantages: normalise rewards within groups of rollouts of the same prompt.

    Groups are formed by ``rollout.meta[group_key]`` when set, else by the first step's
    ``prev_obs`` (the prompt). Each value ``x`` becomes ``(x − mean) / (std + eps)``, with the mean
    over the group, and the population standard deviation over the group (``std_scope='group'``,
    GRPO) or over the whole batch (``std_scope='batch'``, ScaleRL's batch-level normalisation).
    A group of one rollout gets 0 (it has no baseline).

    ``per_step=False`` (default): ``x`` is each rollout's return and every step of the rollout gets
    its advantage. ``per_step=True``: ``x`` is each step's reward, pooled over the group's steps.
    ``group_size``: when given, every group must have exactly that many rollouts (a mismatch
    usually means rollouts were lost or the grouping key is wrong).
    """

    def __init__(
        self,
        group_size: int | None = None,
        *,
        group_key: str | None = None,
        eps: float = 1e-8,
        std_scope: StdScope = "group",
        per_step: bool = False,
    ) -> None:
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1 or None, got {group_size}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if std_scope not in get_args(StdScope):
            raise ValueError(f"std_scope must be 'group' or 'batch', got {std_scope!r}")
        self.group_size = group_size
        self.group_key = group_key
        self.eps = eps
        self.std_scope: StdScope = std_scope
        self.per_step = per_step

    def groups(self, rollouts: Sequence[Rollout]) -> dict[Hashable, list[Rollout]]:
        groups: dict[Hashable, list[Rollout]] = {}
        for r in rollouts:
            groups.setdefault(_group_of(r, self.group_key), []).append(r)
        if self.group_size is not None:
            wrong = {g: len(rs) for g, rs in groups.items() if len(rs) != self.group_size}
            if wrong:
                g, n = next(iter(wrong.items()))
                raise CreditAssignmentError(
                    f"{len(wrong)} group(s) do not have group_size={self.group_size} rollouts, e.g. "
                    f"{g!r} has {n} (rollouts {[r.id for r in groups[g]][:5]}); check that no rollout "
                    "was dropped and that group_key names the prompt"
                )
        return groups

    def compute(self, rollouts: Sequence[Rollout]) -> dict[RolloutStepKey, float]:
        groups = self.groups(rollouts)
        # (keys sharing one value, the value) per group
        items: dict[Hashable, list[tuple[list[RolloutStepKey], float]]] = {}
        for g, rs in groups.items():
            if self.per_step:
                items[g] = [([(r.id, s.index)], s.reward) for r in rs for s in r.steps]
            else:
                items[g] = [([(r.id, s.index) for s in r.steps], r.total_reward()) for r in rs]
        batch_std = statistics.pstdev([v for entries in items.values() for _, v in entries] or [0.0])
        weights: dict[RolloutStepKey, float] = {}
        for g, entries in items.items():
            values = [v for _, v in entries]
            if len(groups[g]) == 1:
                normalized = [0.0] * len(values)
            else:
                mean = statistics.fmean(values)
                std = statistics.pstdev(values) if self.std_scope == "group" else batch_std
                normalized = [(v - mean) / (std + self.eps) for v in values]
            for (keys, _), value in zip(entries, normalized, strict=True):
                for key in keys:
                    weights[key] = value
        return weights


class RMGroupOptions(TypedDict, total=False):
    """Keyword options of the reward-model group presets (defaults in brackets): ``rm_coeff``
    [1.0], ``alpha`` [0.5], ``rm_score_key`` ["rm_score"], ``score_level`` ["sequence"],
    ``group_key`` [None: consecutive runs of ``group_size``], ``reduce`` [None], ``eps`` [1e-8]."""

    rm_coeff: float
    alpha: float
    rm_score_key: str
    score_level: ScoreLevel
    group_key: str | None
    reduce: Reduction | None
    eps: float


def _rm_group_assigner(
    group_size: int | None,
    mode: CombineMode,
    std_scope: StdScope,
    *,
    rm_coeff: float = 1.0,
    alpha: float = 0.5,
    rm_score_key: str = "rm_score",
    score_level: ScoreLevel = "sequence",
    group_key: str | None = None,
    reduce: Reduction | None = None,
    eps: float = 1e-8,
) -> RewardModelCreditAssigner:
    return RewardModelCreditAssigner(
        mode,
        rm_coeff,
        alpha,
        rm_score_key,
        score_level,
        GroupNormalizedAssigner(group_size, group_key=group_key, eps=eps, std_scope=std_scope),
        reduce=reduce,
    )


def make_rm_grpo_assigner(
    group_size: int | None, mode: CombineMode = "bonus", **options: Unpack[RMGroupOptions]
) -> RewardModelCreditAssigner:
    """GRPO with a reward model: combine env and RM per ``mode``, then per group of ``group_size``
    rollouts of one prompt, ``(R − mean) / (std + eps)`` with the group's std; every step of a
    rollout gets its advantage. ``options``: see :class:`RMGroupOptions`."""
    return _rm_group_assigner(group_size, mode, "group", **options)


def make_rm_scalerl_assigner(
    group_size: int | None, mode: CombineMode = "bonus", **options: Unpack[RMGroupOptions]
) -> RewardModelCreditAssigner:
    """ScaleRL-style: like :func:`make_rm_grpo_assigner` but the group-centred returns are divided
    by the standard deviation over the whole batch (more stable when a group's rewards barely
    differ); a group whose rewards are all equal gets 0 (no signal). ``options``: see
    :class:`RMGroupOptions`."""
    return _rm_group_assigner(group_size, mode, "batch", **options)
