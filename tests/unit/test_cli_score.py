"""`rewardplane score` normalises as the RewardModel says unless a flag says otherwise."""

from __future__ import annotations

import pytest

from rewardplane.sdk.cli import main, score_normalize


@pytest.mark.parametrize(
    ("spec_normalize", "raw", "normalize", "want"),
    [
        (True, False, False, True),  # the model's own setting
        (False, False, False, False),
        (None, False, False, False),  # unset in the spec: the CRD default (false)
        (True, True, False, False),  # --raw wins
        (False, False, True, True),  # --normalize wins
    ],
)
def test_score_follows_the_spec_unless_told(spec_normalize, raw, normalize, want) -> None:
    spec = {"model": {"source": "/m"} | ({} if spec_normalize is None else {"normalize": spec_normalize})}
    assert score_normalize(spec, raw, normalize) is want


def test_raw_and_normalize_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["score", "rm", "hello", "--raw", "--normalize"])
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
