"""Which matmul the linear layers run in batch-invariant mode (``--deterministic``): cuBLASLt without
split-K where vLLM itself trusts it (compute capability 9.0 and later), vLLM's Triton matmul
elsewhere or when asked; nothing changes outside the mode."""

from __future__ import annotations

import pytest

from rewardplane.protocol import settings
from rewardplane.server.engines.vllm_deterministic import linear_gemm


@pytest.mark.parametrize("major", [None, 7, 8, 9, 10, 12])
@pytest.mark.parametrize("choice", ["auto", "triton"])
def test_default_mode_keeps_vllms_linear_layers(choice: str, major: int | None) -> None:
    assert linear_gemm(False, choice, major) == "default"


@pytest.mark.parametrize(
    ("major", "expected"), [(9, "cublas"), (10, "cublas"), (12, "cublas"), (8, "triton")]
)
def test_auto_uses_cublas_from_hopper_on(major: int, expected: str) -> None:
    assert linear_gemm(True, "auto", major) == expected


def test_no_device_capability_keeps_triton() -> None:
    # not a CUDA platform (or NVML could not tell): vLLM's own batch-invariant path
    assert linear_gemm(True, "auto", None) == "triton"


@pytest.mark.parametrize("major", [8, 9, 10])
def test_triton_choice_is_honoured_everywhere(major: int) -> None:
    assert linear_gemm(True, "triton", major) == "triton"


def test_setting_rejects_unknown_gemm_with_the_choices() -> None:
    with pytest.raises(settings.SettingError, match="auto or triton"):
        settings.DETERMINISTIC_GEMM.get({settings.DETERMINISTIC_GEMM.name: "cutlass"})
    assert settings.DETERMINISTIC_GEMM.get({}) == "auto"
    assert settings.DETERMINISTIC_GEMM.get({settings.DETERMINISTIC_GEMM.name: "TRITON"}) == "triton"


def test_server_refuses_a_bad_gemm_choice_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rewardplane.server.config import parse_args

    monkeypatch.setenv(settings.DETERMINISTIC_GEMM.name, "cutlass")
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--engine", "vllm", "--deterministic"])
    assert (
        "REWARDPLANE_DETERMINISTIC_GEMM='cutlass' is not valid: give auto or triton"
        in capsys.readouterr().err
    )
    # outside --deterministic nothing reads it
    assert not parse_args(["--model", "m", "--engine", "vllm"]).deterministic
