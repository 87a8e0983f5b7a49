"""The operator-on-GPUs test's own logic, on CPU: when it skips, and how it attributes nvidia-smi's
memory rows to the servers and judges them against their fractions."""

from __future__ import annotations

from tests.gpu.cluster_support import (
    CONTEXT_ALLOWANCE_MIB,
    Gpu,
    attribute_usage,
    cluster_skip_reason,
    device_problems,
    memory_problems,
    parse_gpus,
)

GPUS_CSV = "0, GPU-aaa, 81559\n1, GPU-bbb, 81559\n2, GPU-ccc, 81559\n"
TOTAL = {0: 81559, 1: 81559, 2: 81559}
EXPECTED = {"shared-a-0": (0, 0.3), "shared-b-0": (0, 0.4), "exclusive-c-0": (1, 0.5)}


def test_skips_name_what_is_missing_and_how_to_bring_it() -> None:
    reason = cluster_skip_reason(["kube-apiserver"], lambda m: True)
    assert reason is not None and "kube-apiserver" in reason and "gpu-cluster-bundle.sh" in reason
    reason = cluster_skip_reason([], lambda m: m != "kopf")
    assert reason is not None and "kopf" in reason and "install.sh" in reason
    assert cluster_skip_reason([], lambda m: True) is None


def test_rows_are_summed_per_pod_and_gpu_and_strangers_kept_apart() -> None:
    gpus = parse_gpus(GPUS_CSV)
    assert gpus["GPU-bbb"] == Gpu(1, "GPU-bbb", 81559)
    apps = "\n".join(
        [
            "101, GPU-aaa, 400",  # shared-a's API process
            "102, GPU-aaa, 24000",  # shared-a's engine core
            "201, GPU-aaa, 32000",
            "301, GPU-bbb, 40000",
            "999, GPU-ccc, 5000",  # the trainer: no pod
            "[N/A], GPU-aaa, 10",
            "301, GPU-bbb, [N/A]",  # unknown memory is not 0 MiB
        ]
    )
    pods = {101: "shared-a-0", 102: "shared-a-0", 201: "shared-b-0", 301: "exclusive-c-0"}
    usage, unclaimed = attribute_usage(apps, gpus, pods.get)
    assert usage == {"shared-a-0": {0: 24400}, "shared-b-0": {0: 32000}, "exclusive-c-0": {1: 40000}}
    assert unclaimed == ["999,GPU-ccc,5000", "[N/A],GPU-aaa,10", "301,GPU-bbb,[N/A]"]
    assert memory_problems(usage, EXPECTED, TOTAL) == []


def test_a_server_over_its_fraction_or_on_the_wrong_gpu_is_reported() -> None:
    limit_a = 0.3 * 81559 + CONTEXT_ALLOWANCE_MIB
    usage = {
        "shared-a-0": {0: int(limit_a) + 1},
        "shared-b-0": {1: 100},
        "exclusive-c-0": {1: 100},
        "stray-0": {2: 1},
    }
    problems = memory_problems(usage, EXPECTED, TOTAL)
    assert len(problems) == 3, problems
    assert any("shared-a-0" in p and "over 0.3 × 81559 MiB" in p for p in problems)
    assert any("shared-b-0: expected on GPU 0 only, found on GPUs [1]" in p for p in problems)
    assert any("stray-0" in p for p in problems)


def test_device_totals_bound_the_sum_of_the_fractions_when_pids_cannot_be_mapped() -> None:
    ok = {0: int(0.7 * 81559) + CONTEXT_ALLOWANCE_MIB, 1: 40000}
    assert device_problems(ok, EXPECTED, TOTAL) == []
    over = {0: int(0.7 * 81559) + 2 * CONTEXT_ALLOWANCE_MIB + 1, 1: 40000}
    (problem,) = device_problems(over, EXPECTED, TOTAL)
    assert problem.startswith("GPU 0:") and "0.3 + 0.4" in problem
