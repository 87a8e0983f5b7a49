"""``python -m rewardplane.server --help`` documents every flag: help text, the default where one
applies, and that flags it does not know go to vLLM."""

from __future__ import annotations

import argparse

import pytest

from rewardplane.server.config import build_parser, parse_args


def test_every_flag_has_help_and_shows_its_default() -> None:
    parser = build_parser()
    flags = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(flags) > 30
    assert [a.dest for a in flags if not (a.help or "").strip()] == []
    text = " ".join(parser.format_help().split())  # as read, whatever the terminal's width
    for flag in ("--host", "--port", "--max-items-per-request", "--pooling", "--graceful-shutdown-s"):
        assert flag in text
    assert "(default: 127.0.0.1)" in text and "(default: 8001)" in text and "(default: 1024)" in text
    assert "0.0.0.0" in text  # how to be reachable from another host
    assert "goes to vLLM's engine" in text


def test_flags_are_grouped_by_concern() -> None:
    titles = [g.title for g in build_parser()._action_groups]
    assert {"model", "engine", "HTTP and limits"} <= set(titles)
    assert any(t and t.startswith("weight sync") for t in titles)


def test_unknown_flags_are_refused_on_the_transformers_engine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--max-num-seqs", "8"])
    assert "passed only to --engine vllm" in capsys.readouterr().err
    assert parse_args(["--model", "m", "--engine", "vllm", "--max-num-seqs", "8"]).extra_engine_args == [
        "--max-num-seqs",
        "8",
    ]
