"""The operator on real GPUs (issue #13, item 5): the local cluster in agent mode (etcd,
kube-apiserver, the node agent running pods as processes, the operator), three vLLM RewardModels
placed by the operator, and pushes through WeightSyncs from a trainer on another GPU.

Layout with G GPUs (G >= 3): the node advertises GPUs 0..G-2, the trainer (this process) uses
GPU G-1. ``shared-a`` (memoryFraction 0.3) and ``shared-b`` (0.4) pin GPU 0 (``gpu.mode:
shared``); ``exclusive-c`` (0.5) gets a whole GPU from the node agent (GPU 1). Checks:

- every server Ready; the two shared ones on GPU 0, the exclusive one alone on GPU 1;
- ``nvidia-smi``: each server process within its fraction × the device's memory (plus the CUDA
  context, which vLLM's fraction does not cover: ``cluster_support.CONTEXT_ALLOWANCE_MIB``);
- a full push through a WeightSync into each model (``RewardModelHandle.push_weights``, NCCL from
  ``cuda:G-1``): the served scores equal the trainer's; memory still within the fractions.

Needs the cluster bundle (kube-apiserver, etcd, kopf, kubernetes; ``docs/gpu.md``) and vLLM. Env:
``RP_VLLM_SERVER_ARGS`` (extra server flags, default ``--enforce-eager``: faster start-up),
``RP_VLLM_STARTUP_S`` (each model's start-up bound, default 600).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rewardplane.api.kube import Kube, core_path, custom_path
from tests.gpu.cluster_support import (
    attribute_usage,
    device_problems,
    log_tails,
    memory_problems,
    nvidia_smi,
    parse_csv,
    parse_gpus,
    pod_of_pid,
    pod_pids,
    proc_env,
    skip_reason_here,
)
from tests.gpu.vllm_support import (
    STARTUP_S,
    TEXTS,
    Trainer,
    assert_close,
    check_after_push,
    device_count,
    fill_prefix_cache,
    load_trainer_model,
    reference_scores,
    served,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.gpus(3), pytest.mark.timeout(900)]
# 900 s: run it through scripts/gpu-bg.sh (a device call is limited to 10 minutes); each model's wait is
# bounded by 240 s so a stuck start fails with the status and the pods' logs, inside this timeout

NS = "default"
NODE = "local-node"  # the node `rewardplane dev up --node agent` registers
SHARED = {"shared-a": 0.3, "shared-b": 0.4}
EXCLUSIVE = ("exclusive-c", 0.5)
SHARED_GPU = 0
UP_S = 120.0
DOWN_S = 120.0
PUSH_S = 300.0
SERVER_ARGS = shlex.split(os.environ.get("RP_VLLM_SERVER_ARGS", "--enforce-eager"))


@dataclass
class Cluster:
    state: Path
    env: dict[str, str]
    kube: Kube
    kubeconfig: Path

    @property
    def agent_id(self) -> str:
        # AgentConfig.agent_id of the agent `dev up` starts (node name @ its state dir)
        return f"{NODE}@{(self.state / 'node').resolve()}"

    def diagnostics(self) -> str:
        logs = [self.state / "logs" / "operator.log", self.state / "logs" / "nodeagent.log"]
        logs += sorted((self.state / "node" / "pods").glob("*/*.log"))
        return log_tails(logs)


def _dev(action: str, state: Path, env: dict[str, str], *extra: str, timeout_s: float) -> str:
    cmd = [sys.executable, "-m", "rewardplane", "dev", action, "--node", "agent", "--state-dir", str(state)]
    done = subprocess.run([*cmd, *extra], env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(
            f"`rewardplane dev {action}` failed ({done.returncode}):\n{done.stdout}{done.stderr}"
        )
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = skip_reason_here()
    if reason:
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("dev-cluster")
    env = {
        **os.environ,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # GPU indices as nvidia-smi numbers them
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)  # pods get theirs from the node agent / their spec
    node_gpus = device_count() - 1  # the last GPU is the trainer's
    kubeconfig = state / "kubeconfig"
    try:
        out = _dev("up", state, env, "--gpus", str(node_gpus), "--timeout", str(UP_S), timeout_s=UP_S + 60)
        assert f"export KUBECONFIG={kubeconfig}" in out, out
        kube = Kube.from_environment(str(kubeconfig))
    except BaseException:
        _dev("down", state, env, timeout_s=DOWN_S)  # whatever part of it did start
        raise
    c = Cluster(state, env, kube, kubeconfig)
    try:
        _wait(f"the node {NODE} Ready", lambda: _node_ready(kube), UP_S, c.diagnostics)
        yield c
    finally:
        try:
            for name in [*SHARED, EXCLUSIVE[0]]:
                kube.delete(custom_path(NS, name))
            _wait("the RewardModels deleted", lambda: not kube.list(custom_path(NS)), 30, c.diagnostics)
        finally:
            kube.close()
            _dev("down", state, env, timeout_s=DOWN_S)
            left = pod_pids(c.agent_id)
            for pids in left.values():  # never leave a server holding a GPU
                for pid in pids:
                    try:
                        os.kill(pid, 9)
                    except OSError:
                        pass
            assert not left, f"`dev down` left server processes running: {left}"


def _wait(what: str, ready: Any, timeout_s: float, diagnostics: Any) -> Any:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = ready()
        if last:
            return last
        time.sleep(1.0)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})\n{diagnostics()}")


def _node_ready(kube: Kube) -> bool:
    node = kube.get(core_path("nodes", None, NODE)) or {}
    conds = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _reward_model(name: str, model_dir: Path, gpu: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "rewardplane.io/v1alpha1",
        "kind": "RewardModel",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"source": str(model_dir), "dtype": "bfloat16", "maxLength": 1024},
            "engine": {"kind": "vllm", "extraArgs": SERVER_ARGS},
            "gpu": gpu,
        },
    }


def _pods(kube: Kube, name: str) -> list[dict[str, Any]]:
    return kube.list(core_path("pods", NS), label_selector=f"rewardplane.io/model={name}")


def _seen_by_agent(kube: Kube, name: str) -> bool:
    """The node agent has planned the model's pod (pinned its GPU): it reports a container status."""
    return any((p.get("status") or {}).get("containerStatuses") for p in _pods(kube, name))


def _wait_ready(c: Cluster, name: str) -> str:
    from rewardplane.sdk.cluster import RewardModelHandle

    handle = RewardModelHandle(name, NS, kubeconfig=str(c.kubeconfig))
    try:
        try:
            # bounded well inside the test's timeout, so that a stuck start fails with the status
            # message and the pods' logs (the first GPU run hit pytest's timeout and printed neither)
            handle.wait_ready(min(STARTUP_S, 240.0))
        except TimeoutError as exc:
            pytest.fail(f"{name} not Ready: {exc}\n{c.diagnostics()}")
        urls = handle.get_urls()
        assert len(urls) == 1, urls
        return urls[0]
    finally:
        handle.close()


def _check_memory(c: Cluster, expected: dict[str, tuple[int, float]], when: str) -> None:
    gpus = parse_gpus(nvidia_smi("--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"))
    total = {g.index: g.total_mib for g in gpus.values()}
    # where the node agent put each server: its processes' own CUDA_VISIBLE_DEVICES
    pids = pod_pids(c.agent_id)
    for pod, (gpu, _) in expected.items():
        assert pids.get(pod), (
            f"[{when}] no process of pod {pod} found (have {sorted(pids)})\n{c.diagnostics()}"
        )
        visible = {proc_env(pid).get("CUDA_VISIBLE_DEVICES") for pid in pids[pod]} - {None}
        assert visible == {str(gpu)}, f"[{when}] {pod}: CUDA_VISIBLE_DEVICES {visible}, expected {gpu}"
    apps = nvidia_smi("--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits")
    usage, unclaimed = attribute_usage(apps, gpus, pod_of_pid(c.agent_id))
    print(f"\n[{when}] MiB per server and GPU: {usage}; device totals {total}; rows of no pod: {unclaimed}")
    if usage:
        problems = memory_problems(usage, expected, total)
    else:
        used_rows = nvidia_smi("--query-gpu=index,memory.used", "--format=csv,noheader,nounits")
        used = {int(r[0]): int(r[1]) for r in parse_csv(used_rows)}
        print(f"[{when}] nvidia-smi's pids are not this namespace's: devices' totals checked instead: {used}")
        problems = device_problems(used, expected, total)
    assert not problems, f"[{when}] " + "\n".join(problems)


def test_operator_places_vllm_servers_by_fraction_and_pushes_land(
    cluster: Cluster, tiny_seqcls_1label: Path
) -> None:
    import torch
    from transformers import AutoTokenizer

    from rewardplane.sdk.cluster import RewardModelHandle

    c, kube = cluster, cluster.kube
    model_dir = tiny_seqcls_1label
    for name, fraction in SHARED.items():
        gpu = {"mode": "shared", "node": NODE, "deviceIds": [SHARED_GPU], "memoryFraction": fraction}
        kube.create(custom_path(NS), _reward_model(name, model_dir, gpu))
    # the exclusive model only once the agent knows which GPU the shared ones pin
    _wait(
        "the node agent to take the shared pods",
        lambda: all(_seen_by_agent(kube, n) for n in SHARED),
        60,
        c.diagnostics,
    )
    name_c, fraction_c = EXCLUSIVE
    kube.create(
        custom_path(NS), _reward_model(name_c, model_dir, {"mode": "exclusive", "memoryFraction": fraction_c})
    )

    urls = {name: _wait_ready(c, name) for name in [*SHARED, name_c]}
    print(f"\nready: {urls}")
    exclusive_gpu = 1  # the node's only free device once GPU 0 is pinned (the agent prefers low ids)
    expected = {f"{n}-0": (SHARED_GPU, f) for n, f in SHARED.items()}
    expected[f"{name_c}-0"] = (exclusive_gpu, fraction_c)
    _check_memory(c, expected, "after start-up")

    device = torch.device("cuda", device_count() - 1)
    model = load_trainer_model(model_dir, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # before any push every server serves the checkpoint on disk
    want = reference_scores(model, tokenizer, TEXTS, device)
    for name, url in urls.items():
        got, version = served(url)
        assert version == 0
        assert_close(got, want, f"{name} before any push")

    torch.manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + 0.1 * torch.randn_like(p))
    for version, (name, url) in enumerate(urls.items(), start=1):
        before = fill_prefix_cache(url)
        handle = RewardModelHandle(name, NS, kubeconfig=str(c.kubeconfig))
        try:
            result = handle.push_weights(
                model.state_dict(), version, "full", trainer_host="127.0.0.1", timeout_s=PUSH_S, device=device
            )
        except Exception as exc:
            pytest.fail(f"push into {name} failed: {exc!r}\n{c.diagnostics()}")
        finally:
            handle.close()
        assert result.replicas == 1 and result.world_size == 2, result
        ws = kube.get(custom_path(NS, name, "weightsyncs")) or {}
        assert (ws.get("status") or {}).get("phase") == "Completed", ws.get("status")
        check_after_push(
            Trainer(model, tokenizer, None, device, url), version, before, f"{name} via WeightSync"
        )
    _check_memory(c, expected, "after the pushes")
