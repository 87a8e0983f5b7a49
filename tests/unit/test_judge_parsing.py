"""Reading scores out of a judge's answers: the default parser's forms and its refusals (pure)."""

from __future__ import annotations

import pytest

from rewardplane.sdk import parse_score


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("7", 7.0),
        ("  0.75 \n", 0.75),
        ("-2", -2.0),
        ("8.", 8.0),
        ("**8**", 8.0),
        ("7/10", 7.0),
        ("[[8]]", 8.0),
        ("[[ 8.5 ]]", 8.5),
        ("[[3/5]]", 3.0),
        ("The answer is helpful and correct. Rating: [[9]]", 9.0),
        ("Score: 7/10", 7.0),
        ("score = 4", 4.0),
        ("My score is 4 out of 5.", 4.0),
        ("Final grade: **9**", 9.0),
        ("Reward: -1.5", -1.5),
        ("First I gave it Score: 3, but on reflection Score: 6", 6.0),  # the last one wins
        ("[[2]] at first; then [[5]]", 5.0),
        ("[[5]] beats a keyword: Score: 1", 5.0),
        ("The response misses the question entirely.\n3", 3.0),  # the last line
        ("The response is fine.\n\n  6/10  \n", 6.0),
        ("RATING: 10", 10.0),
    ],
)
def test_common_forms_give_the_score(answer: str, score: float) -> None:
    assert parse_score(answer) == score


@pytest.mark.parametrize(
    "answer",
    [
        "",
        "   ",
        "The response is good.",
        "I would give it about seven.",
        "There are 3 mistakes in the 2 paragraphs, overall decent",  # numbers, but no score form
        "[[eight]]",
        "Score: high",
        "7 apples",
        "nan",
        "inf",
    ],
)
def test_answers_without_a_score_are_unparseable(answer: str) -> None:
    assert parse_score(answer) is None
