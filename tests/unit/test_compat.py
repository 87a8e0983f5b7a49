"""Pure parts of the drop-in compatibility: accepted model names, the vLLM request fields, base64
encoding, the server's name flags, the operator's alias rendering and the SDK recipes."""

from __future__ import annotations

import base64
import re
import struct

import pytest
from pydantic import ValidationError

from rewardplane.operator.planning import ClusterView, plan_reward_model, validate_spec
from rewardplane.operator.render import server_args
from rewardplane.protocol import (
    ClassifyRequest,
    GetRewardRequest,
    PoolingRequest,
    ScoringRequest,
    ScoringResponse,
    ScoringResult,
    TokenizeRequest,
    decode_base64_floats,
    encode_base64_floats,
)
from rewardplane.sdk.integrations import TRLRewardFunction, _float, openrlhf_remote_url
from rewardplane.server.config import parse_args
from rewardplane.server.http.model_names import ModelNames
from tests.unit.test_planning import NODES, cpu_rm

NAMES = ModelNames.of("tiny-rm", "/models/skywork/", ["Skywork/Skywork-Reward"])


@pytest.mark.parametrize(
    "name",
    [None, "", "tiny-rm", "reward-model", "/models/skywork", "/models/skywork/", "Skywork/Skywork-Reward"],
)
def test_accepted_names(name: str | None) -> None:
    assert NAMES.problem(name) is None


@pytest.mark.parametrize("name", ["/models/other", "skywork", "Tiny-RM", "gpt-4o"])
def test_other_names_are_refused_naming_what_is_served(name: str) -> None:
    problem = NAMES.problem(name)
    assert problem is not None
    assert repr(name) in problem and "tiny-rm" in problem and "/models/skywork/" in problem
    assert "spec.model.aliases" in problem and "--model-alias" in problem


@pytest.mark.parametrize("source", ["models/rm", "./models/rm", "models/rm/"])
@pytest.mark.parametrize("name", ["models/rm", "./models/rm", "./models/rm/", "models/rm/", ".//models/rm"])
def test_a_relative_path_names_the_same_model_with_or_without_dot_slash(source: str, name: str) -> None:
    assert ModelNames.of("rm", source).problem(name) is None
    assert ModelNames.of("rm", source).problem("./models/other") is not None


def test_listed_names_are_served_name_then_aliases() -> None:
    assert ModelNames.of("a", "/p", ["b", "a", "", "b"]).listed() == ["a", "b"]


def test_served_model_name_takes_several_names_like_vllm() -> None:
    cfg = parse_args(["--model", "/m", "--served-model-name", "main", "other", "--model-alias", "x", "y"])
    assert cfg.served_model_name == "main" and cfg.model_aliases == ["other", "x", "y"]
    assert parse_args(["--model", "/m"]).model_aliases == []
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m", "--model-alias", " "])


def test_operator_renders_aliases_and_the_crd_field_parses() -> None:
    body = cpu_rm(model={"source": "/models/tiny", "aliases": ["/ckpt/rm", "hub/rm"]})
    assert validate_spec(body["spec"]) == []
    plan = plan_reward_model(body, ClusterView(nodes=NODES))
    args = server_args(plan, plan.replicas[0])
    i = args.index("--model-alias")
    # the server loads a mounted path (/mnt/models), so the node path it came from is an alias too
    assert args[i : i + 4] == ["--model-alias", "/ckpt/rm", "hub/rm", "/models/tiny"]
    plain = server_args(*_plan_without_aliases())
    assert plain[plain.index("--model-alias") :][:2] == ["--model-alias", "org/tiny"]
    errors = validate_spec(cpu_rm(engine={"kind": "hf", "extraArgs": ["--model-alias", "x"]})["spec"])
    assert len(errors) == 1 and "spec.model.aliases" in errors[0]


def _plan_without_aliases():  # noqa: ANN202
    # a hub id reaches the server as a downloaded directory: the id is its only alias
    plan = plan_reward_model(cpu_rm(model={"source": "org/tiny"}), ClusterView(nodes=NODES))
    return plan, plan.replicas[0]


def test_activation_flags_in_vllm_order_and_raw_by_default() -> None:
    assert ClassifyRequest(input="x").activation_requested() is False
    assert ClassifyRequest(input="x", softmax=True).activation_requested() is True
    assert ClassifyRequest(input="x", activation=True).activation_requested() is True
    assert ClassifyRequest(input="x", use_activation=False, softmax=True).activation_requested() is False


def test_special_tokens_default_like_vllm() -> None:
    assert PoolingRequest(input="x").special_tokens() is True
    assert PoolingRequest(messages=[{"role": "user", "content": "x"}]).special_tokens() is False
    assert PoolingRequest(input="x", add_special_tokens=False).special_tokens() is False
    assert TokenizeRequest(prompt="x").special_tokens() is True


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "exactly one of 'input'"),
        ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one of 'input'"),
        ({"messages": []}, "messages is empty"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "-1 (the model's max length) or >= 1"),
        ({"input": "x", "truncate_prompt_tokens": -2}, "-1 (the model's max length) or >= 1"),
        ({"input": "x", "dimensions": 8}, "dimensions is not supported"),
        ({"input": "x", "encoding_format": "bf16"}, "encoding_format"),
        ({"input": "x", "task": "token_classify"}, "per-token outputs are not available"),
    ],
)
def test_bad_vllm_requests_are_refused_with_a_reason(body: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(needle)):
        PoolingRequest.model_validate(body)


def test_truncate_minus_one_and_unknown_fields_are_accepted() -> None:
    req = PoolingRequest.model_validate({"input": "x", "truncate_prompt_tokens": -1, "priority": 3})
    assert req.truncate_prompt_tokens == -1


def test_base64_is_little_endian_float32_like_openai() -> None:
    values = [1.5, -2.25, 3.0e-3]
    encoded = encode_base64_floats(values)
    assert base64.b64decode(encoded) == struct.pack("<3f", *values)
    assert decode_base64_floats(encoded) == pytest.approx(values, rel=1e-6)
    with pytest.raises(ValueError, match="multiple of 4"):
        decode_base64_floats(base64.b64encode(b"abc").decode())


def test_ludic_spelling_and_scores_next_to_data() -> None:
    assert ScoringRequest.model_validate({"inputs": ["a", "b"]}).inputs == ["a", "b"]
    resp = ScoringResponse(
        model="m", data=[ScoringResult(index=1, score=2.0), ScoringResult(index=0, score=1.0)]
    )
    assert resp.model_dump()["scores"] == [1.0, 2.0]
    assert ScoringResponse.model_validate(resp.model_dump()).scores == [1.0, 2.0]


def test_get_reward_accepts_one_query_string() -> None:
    assert GetRewardRequest.model_validate({"query": "x"}).query == ["x"]


def test_openrlhf_remote_url_recipe() -> None:
    assert openrlhf_remote_url("http://rm-0.rm:8001/") == "http://rm-0.rm:8001/get_reward"
    assert (
        openrlhf_remote_url(["http://a:1", "http://b:2/get_reward"])
        == "http://a:1/get_reward,http://b:2/get_reward"
    )
    with pytest.raises(ValueError, match="http"):
        openrlhf_remote_url("rm-0:8001")
    with pytest.raises(ValueError, match="no endpoints"):
        openrlhf_remote_url([])


def test_trl_function_needs_a_server_and_one_float_per_completion() -> None:
    with pytest.raises(ValueError, match="endpoints"):
        TRLRewardFunction()
    assert _float([0.1, 0.7], 1) == 0.7
    with pytest.raises(ValueError, match="label=<index>"):
        _float([0.1, 0.7], None)


def test_a_local_checkpoint_is_accepted_by_its_absolute_path(tmp_path, monkeypatch):
    from rewardplane.server.cli import local_spellings
    from rewardplane.server.http.model_names import ModelNames

    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    names = ModelNames.of("rm", "./ckpt", (), local_spellings("./ckpt"))
    assert names.problem(str(tmp_path / "ckpt")) is None and names.problem("./ckpt/") is None
    assert names.listed() == ["rm"]  # accepted, not listed in /v1/models
    assert local_spellings("org/hub-id") == []
