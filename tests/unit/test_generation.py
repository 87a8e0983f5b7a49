"""Generate mode's pure parts: the server's --task flag, the sampling options of a chat request
and stop strings."""

from __future__ import annotations

import os

import pytest

from rewardplane.protocol import ChatCompletionRequest, ModelTask
from rewardplane.server.config import parse_args
from rewardplane.server.engines.generation import cut_at_stop, sampling_options
from rewardplane.server.errors import BadRequest

CHAT = [{"role": "user", "content": "hi"}]


def test_task_flag_and_head_flags_that_mean_nothing_for_a_judge(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["--model", "m"]).task is ModelTask.SCORE
    assert parse_args(["--model", "m", "--task", "generate"]).task is ModelTask.GENERATE
    for flags in (["--num-labels", "1"], ["--pooling", "mean"]):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--model", "m", "--task", "generate", *flags])
        assert exit_.value.code == 2
        assert f"{flags[0]} appl" in capsys.readouterr().err


def test_deterministic_scores_switch_on_vllms_batch_invariance(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    parse_args(["--model", "m", "--engine", "vllm"]).export_settings()
    assert "VLLM_BATCH_INVARIANT" not in os.environ
    cfg = parse_args(["--model", "m", "--engine", "vllm", "--deterministic"])
    assert cfg.deterministic
    cfg.export_settings()  # vLLM's engine core and workers inherit it
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--deterministic"])  # the transformers engine
    assert "--deterministic needs --engine vllm" in capsys.readouterr().err


def test_max_tokens_defaults_to_what_fits_and_too_much_is_refused() -> None:
    opts = sampling_options(ChatCompletionRequest(messages=CHAT), prompt_tokens=30, max_model_len=100)
    assert (opts.max_tokens, opts.temperature, opts.n, opts.stop, opts.greedy) == (70, 1.0, 1, (), False)
    opts = sampling_options(
        ChatCompletionRequest(messages=CHAT, max_completion_tokens=5, temperature=0, stop="\n", seed=1),
        prompt_tokens=30,
        max_model_len=100,
    )
    assert (opts.max_tokens, opts.greedy, opts.stop, opts.seed) == (5, True, ("\n",), 1)
    with pytest.raises(BadRequest, match="at most 70 can be generated"):
        sampling_options(
            ChatCompletionRequest(messages=CHAT, max_tokens=71), prompt_tokens=30, max_model_len=100
        )
    with pytest.raises(BadRequest, match="send a shorter chat"):
        sampling_options(ChatCompletionRequest(messages=CHAT), prompt_tokens=100, max_model_len=100)


def test_min_tokens_and_ignore_eos_reach_the_engine_and_must_fit() -> None:
    req = ChatCompletionRequest(messages=CHAT, max_tokens=10, min_tokens=4, ignore_eos=True)
    opts = sampling_options(req, prompt_tokens=30, max_model_len=100)
    assert (opts.max_tokens, opts.min_tokens, opts.ignore_eos) == (10, 4, True)
    opts = sampling_options(ChatCompletionRequest(messages=CHAT), prompt_tokens=30, max_model_len=100)
    assert (opts.min_tokens, opts.ignore_eos) == (0, False)
    with pytest.raises(ValueError, match="lower min_tokens"):
        ChatCompletionRequest(messages=CHAT, max_tokens=3, min_tokens=4)
    with pytest.raises(BadRequest, match="at most 70 can be generated; lower min_tokens"):
        sampling_options(
            ChatCompletionRequest(messages=CHAT, min_tokens=71), prompt_tokens=30, max_model_len=100
        )


def test_bad_chat_requests_are_refused_by_the_schema() -> None:
    for bad in ({"stream": True}, {"stop": [""]}, {"n": 0}, {"temperature": 3}, {"top_p": 0}):
        with pytest.raises(ValueError):
            ChatCompletionRequest(messages=CHAT, **bad)
    with pytest.raises(ValueError):
        ChatCompletionRequest(messages=[])


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("Score: 7\nBecause", ("\n",), ("Score: 7", True)),
        ("abc", ("x",), ("abc", False)),
        ("a]]b.c", (".", "]]"), ("a", True)),  # the earliest stop wins
        ("abc", (), ("abc", False)),
    ],
)
def test_stop_strings_cut_before_the_earliest(
    text: str, stops: tuple[str, ...], expected: tuple[str, bool]
) -> None:
    assert cut_at_stop(text, stops) == expected
