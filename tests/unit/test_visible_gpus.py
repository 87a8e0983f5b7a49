"""Children of a job given some of the host's GPUs land on those GPUs, not on the host's first ones."""

from __future__ import annotations

import pytest

from rewardplane.testing.gpus import visible_gpus


def test_indices_go_through_the_jobs_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus(0) == "2"
    assert visible_gpus("1") == "3"
    assert visible_gpus("0,1") == "2,3"  # a tensor-parallel server's two devices


def test_without_a_list_every_gpu_of_the_host_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(1) == "1"
    assert visible_gpus("2,3") == "2,3"


def test_a_device_the_job_was_not_given_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match=r"device\(s\) 1 are not among .*'3' \(1 visible\)"):
        visible_gpus(1)
