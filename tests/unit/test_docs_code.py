"""The code the docs show names only what exists: every Python block of README.md and docs/
(imports, names, keywords, attributes) and the calls, keywords, dotted names and file paths of
the prose (tests/fixtures/doc_snippets.py). The blocks that can run, run against a real server in
tests/integration/test_docs_run.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.doc_snippets import doc_files, problems, runnable_blocks


def test_every_snippet_and_code_span_of_the_docs_names_what_exists() -> None:
    found = problems(doc_files())
    assert not found, "\n".join(found)


# Each mistake the docs once made, in a page of its own: the check must name it.
MISTAKES = {
    "a keyword the pusher does not take": (
        "Atomic updates (`atomic_updates=True`) stage every bucket.",
        "takes the keyword atomic_updates",
    ),
    "a name used without its import": (
        "```python\nfrom rewardplane.sdk import AsyncRewardClient\n\n"
        "async with AsyncRewardClient(url) as client:\n"
        "    response, info = await client.score(ScoringRequest(inputs=texts))\n```\n",
        "ScoringRequest is used but never imported",
    ),
    "a positional name that is not the parameter": (
        "`RewardModelHandle(name, namespace).push_weights(params, version, mode)` returns",
        "takes no parameter mode",
    ),
    "a keyword of a call in a block": (
        "```python\nfrom rewardplane.sdk import RewardModelHandle\n\n"
        'RewardModelHandle("rm").push_weights(model.state_dict(), version=1, mode="full")\n```\n',
        "takes no keyword mode",
    ),
    "an attribute of a class the SDK does not export": (
        "and `RewardModelPublisher.last_stats` the trainer's",
        "RewardModelPublisher is not exported by rewardplane.sdk",
    ),
    "a path that does not exist": ("(`sdk/rewardplane/sdk/delta.py`)", "no such file in the repository"),
    "a dotted name that does not resolve": (
        "the hint names `rewardplane.protocol.naming.select_heads`",
        "no such module or name",
    ),
    "an attribute of an instance": (
        "```python\nfrom rewardplane.sdk import RewardModelHandle\n\n"
        'rm = RewardModelHandle("scorer", "default")\nrm.endpoints\n```\n',
        "RewardModelHandle has no attribute endpoints",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_check_names_each_kind_of_mistake(mistake: str, tmp_path: Path) -> None:
    text, expected = MISTAKES[mistake]
    page = tmp_path / "sdk.md"
    page.write_text(text + "\n")
    found = problems([page])
    assert len(found) == 1 and expected in found[0], found


def test_the_readme_quick_start_is_among_the_blocks_that_run() -> None:
    readme = [b for b in runnable_blocks(doc_files()) if b.doc.name == "README.md"]
    assert any("WeightPusher(" in b.code and "RewardClient(" in b.code for b in readme), readme
