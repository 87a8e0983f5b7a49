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


def test_an_empty_text_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["score", "ux", ""]) == 1  # refused before any cluster call
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "text 1 is empty" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize(
    ("spec", "given", "want"),
    [
        ({"weightSync": {"defaultTrainingMode": "head_only"}}, None, "head_only"),
        ({"weightSync": {"defaultTrainingMode": "head_only"}}, "full", "full"),  # the flag wins
        ({}, None, "full"),
    ],
)
def test_push_takes_the_models_default_training_mode(spec, given, want) -> None:
    from rewardplane.sdk.cli import push_mode

    assert push_mode(spec, given).value == want


@pytest.mark.parametrize("command", ["status", "score", "push"])
def test_every_subcommand_describes_itself(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    description = out.split("\n\n")[1]  # argparse: usage, blank line, description
    assert len(description.split()) >= 8 and not description.startswith(("positional", "options")), out
