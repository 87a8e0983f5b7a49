"""``rewardplane dev up|down|status``: the local development cluster as background processes.

Two kinds of node (``--node``):

- ``real`` (the default): a real single-node Kubernetes (:mod:`.realnode`: control plane,
  containerd, CNI, kubelet, kube-proxy) running the images that ``scripts/build-images.sh`` built;
  ``up`` also installs the operator from the Helm chart, in-cluster, as a user would.
- ``agent``: etcd + kube-apiserver (:class:`LocalControlPlane`), the node agent (one Node
  ``local-node`` whose pods run as host processes) and the operator as a host process. This is
  for the GPU machine, which has GPUs but no NVIDIA container runtime.

``up`` writes pid files and logs under the state dir, prints ``export KUBECONFIG=...`` and
returns. ``down`` stops everything in reverse order; ``status`` says what runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rewardplane.api.kube import Kube, KubeError
from rewardplane.localcluster import realnode
from rewardplane.localcluster.binaries import BinaryNotFoundError, cache_dir, find_binary
from rewardplane.localcluster.controlplane import ControlPlaneError, LocalControlPlane, _http_ok
from rewardplane.localcluster.diagnose import describe_namespace
from rewardplane.localcluster.realnode import RealNode, RealNodeError

# stop order for `down`: dependants first, the store last
COMPONENTS = ("operator", "nodeagent", "kube-apiserver", "etcd")
STOP_GRACE_S = {"operator": 15.0, "nodeagent": 45.0, "kube-apiserver": 10.0, "etcd": 10.0}
# src/rewardplane/localcluster/dev.py → the repository root
REPO_CRDS = Path(__file__).resolve().parents[3] / "crds"
REPO_CHART = Path(__file__).resolve().parents[3] / "charts" / "rewardplane"
OPERATOR_RELEASE = "rewardplane"
OPERATOR_NAMESPACE = "rewardplane-system"
OPERATOR_IMAGE = "localhost/rewardplane/operator"
SERVER_IMAGE = "localhost/rewardplane/reward-server"  # scripts/build-images.sh's name for it


def default_state_dir(node: str = "agent") -> Path:
    return realnode.default_state_dir() if node == "real" else cache_dir() / "dev"


def local_image_tag() -> str:
    """The tag scripts/build-images.sh gave the images it built (written next to them)."""
    tag_file = realnode.images_dir() / "TAG"
    try:
        return tag_file.read_text().strip()
    except OSError:
        raise RealNodeError(
            f"no locally built images ({tag_file} missing); build them first: bash scripts/build-images.sh"
        ) from None


def agent_server_image() -> str:
    """The reward-server image the agent-mode operator names for a RewardModel without
    ``spec.engine.image``: the one scripts/build-images.sh built here, or, before any build, the
    name it would give it. The node agent runs the server as a host process, so the image itself
    is never pulled; the name only keeps such a model from being Degraded (NoImage)."""
    try:
        tag = local_image_tag()
    except RealNodeError:
        tag = f"{importlib.metadata.version('rewardplane')}-local"
    return f"{SERVER_IMAGE}:{tag}"


def helm_install_operator(
    kubeconfig: Path,
    *,
    release: str = OPERATOR_RELEASE,
    namespace: str = OPERATOR_NAMESPACE,
    values: dict[str, str] | None = None,
    timeout_s: int = 300,
    log_path: Path | None = None,
) -> None:
    """``helm upgrade --install`` the chart with the locally built operator image, and the locally
    built reward-server image as the operator's default for RewardModels without
    ``spec.engine.image``; returns once the operator's Deployment is available (helm --wait).
    Raises RealNodeError with helm's output."""
    tag = local_image_tag()
    sets = {
        "image.repository": OPERATOR_IMAGE,
        "image.tag": tag,
        # the image exists only on this node: never try a registry
        "image.pullPolicy": "Never",
        # imported into the node's containerd: IfNotPresent (the RewardModel's default) finds it
        "serverImage.repository": SERVER_IMAGE,
        "serverImage.tag": tag,
        **(values or {}),
    }
    cmd = [
        str(find_binary("helm")),
        "--kubeconfig",
        str(kubeconfig),
        "upgrade",
        "--install",
        release,
        str(REPO_CHART),
        "--namespace",
        namespace,
        "--create-namespace",
        "--wait",
        f"--timeout={timeout_s}s",
    ]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 60)
    if log_path is not None:
        with open(log_path, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        # helm only says "not ready"; the pods' states, events and logs say why
        pods = describe_namespace(kubeconfig, namespace)
        if log_path is not None:
            with open(log_path, "a") as f:
                f.write(pods + "\n")
        raise RealNodeError(
            f"helm install of the operator failed: {done.stderr.strip() or done.stdout.strip()}\n{pods}"
        )


# -- pid files --------------------------------------------------------------------------------------
def _pid_file(state: Path, name: str) -> Path:
    return state / "pids" / f"{name}.pid"


def _write_pid(state: Path, name: str, pid: int) -> None:
    path = _pid_file(state, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid}\n")


def _alive_pid(state: Path, name: str) -> int | None:
    """The component's pid when it still runs (guards against a recycled pid: the process must
    still be a leader of its own process group, as every component is started)."""
    try:
        pid = int(_pid_file(state, name).read_text().strip())
        os.kill(pid, 0)
        if os.getpgid(pid) != pid:
            return None
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":  # a zombie does not run
            return None
        return pid
    except (OSError, ValueError, IndexError):
        return None


def _stop(state: Path, name: str) -> bool:
    pid = _alive_pid(state, name)
    _pid_file(state, name).unlink(missing_ok=True)
    if pid is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S[name]
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return True


def operator_command(kubeconfig: Path, *options: str) -> list[str]:
    """The operator's command line against a local control plane, with further ``options``: it
    deletes children itself (no controller-manager here, so no garbage collector)."""
    return [
        sys.executable,
        "-m",
        "rewardplane.operator",
        "--kubeconfig",
        str(kubeconfig),
        "--delete-children",
        *options,
    ]


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        return subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )


# -- commands ----------------------------------------------------------------------------------------
def cmd_up(state: Path, *, gpus: int, timeout_s: float) -> int:
    kubeconfig = state / "kubeconfig"
    if _alive_pid(state, "kube-apiserver"):
        print(
            f"dev cluster already running (state {state}); `rewardplane dev down` stops it", file=sys.stderr
        )
        print(f"export KUBECONFIG={kubeconfig}")
        return 0
    for name in COMPONENTS:  # half-started leftovers from an earlier failed `up`
        _stop(state, name)
    state.mkdir(parents=True, exist_ok=True)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)

    cp = LocalControlPlane(state / "controlplane")
    try:
        cp.start(timeout_s=timeout_s)
    except (BinaryNotFoundError, ControlPlaneError) as exc:
        print(f"rewardplane dev up: {exc}", file=sys.stderr)
        return 1
    # The processes outlive this command: record them for `down` instead of stopping them.
    assert cp._etcd is not None and cp._apiserver is not None
    _write_pid(state, "etcd", cp._etcd.pid)
    _write_pid(state, "kube-apiserver", cp._apiserver.pid)
    kubeconfig.write_bytes(cp.kubeconfig.read_bytes())
    kubeconfig.chmod(0o600)
    (state / "cluster.json").write_text(
        json.dumps({"server_url": cp.server_url, "kubeconfig": str(kubeconfig)}, indent=2)
    )

    kube = Kube.from_environment(str(kubeconfig))
    try:
        warnings = apply_crds(kube)
    finally:
        kube.close()

    agent = _spawn(
        [
            sys.executable,
            "-m",
            "rewardplane.localcluster.nodeagent",
            "--kubeconfig",
            str(kubeconfig),
            "--node-name",
            "local-node",
            "--gpus",
            str(gpus),
            "--state-dir",
            str(state / "node"),
        ],
        logs / "nodeagent.log",
    )
    _write_pid(state, "nodeagent", agent.pid)

    if (
        importlib.util.find_spec("rewardplane.operator") is not None
        and importlib.util.find_spec("rewardplane.operator.__main__") is not None
    ):
        op = _spawn(
            operator_command(kubeconfig, "--default-server-image", agent_server_image()),
            logs / "operator.log",
        )
        _write_pid(state, "operator", op.pid)
    else:
        warnings.append(
            "the operator (python -m rewardplane.operator) is not installed; "
            "control plane and node agent run without it"
        )
    time.sleep(1.0)
    for name in ("nodeagent", "operator"):
        if _pid_file(state, name).exists() and _alive_pid(state, name) is None:
            warnings.append(f"{name} exited right after start; see {logs / (name + '.log')}")
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    # Only the export goes to stdout, so `eval "$(rewardplane dev up)"` works.
    print(f"dev cluster up: {cp.server_url} (logs in {logs})", file=sys.stderr)
    print(f"export KUBECONFIG={kubeconfig}")
    return 0


CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def apply_crds(kube: Kube, crds: Path = REPO_CRDS, timeout_s: float = 30.0) -> list[str]:
    """Create (or replace) the repo's CRDs through the API and wait until they are Established;
    returns warnings. No kubectl: the GPU machine has none."""
    import yaml

    files = sorted(crds.glob("*.yaml")) + sorted(crds.glob("*.yml")) if crds.is_dir() else []
    if not files:
        return [f"no CRDs applied: {crds} has no YAML files"]
    names = []
    try:
        for path in files:
            crd = yaml.safe_load(path.read_text())
            name = crd["metadata"]["name"]
            names.append(name)
            if kube.create(CRD_PATH, crd) is None:  # the CRD exists already: replace it
                existing = kube.get(f"{CRD_PATH}/{name}") or {}
                crd["metadata"]["resourceVersion"] = existing.get("metadata", {}).get("resourceVersion")
                kube._call("PUT", f"{CRD_PATH}/{name}", json=crd)
    except (KubeError, OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        return [f"applying the CRDs from {crds} failed: {exc}"]

    def established(name: str) -> bool:
        conds = ((kube.get(f"{CRD_PATH}/{name}") or {}).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Established" and c.get("status") == "True" for c in conds)

    deadline = time.monotonic() + timeout_s
    while not all(established(n) for n in names):
        if time.monotonic() > deadline:
            return [f"CRDs not Established after {timeout_s:.0f}s: {', '.join(names)}"]
        time.sleep(0.3)
    return []


def cmd_down(state: Path) -> int:
    stopped = [name for name in COMPONENTS if _stop(state, name)]
    print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
    return 0


def cmd_status(state: Path) -> int:
    running = {name: _alive_pid(state, name) for name in COMPONENTS}
    info = {}
    with contextlib.suppress(OSError, ValueError):
        info = json.loads((state / "cluster.json").read_text())
    for name, pid in running.items():
        print(f"{name:15} {'running (pid ' + str(pid) + ')' if pid else 'not running'}")
    if running["kube-apiserver"] and info.get("server_url"):
        ready = _http_ok(f"{info['server_url']}/healthz")
        print(f"{'api server':15} {info['server_url']} {'healthy' if ready else 'NOT healthy'}")
        print(f"export KUBECONFIG={info.get('kubeconfig')}")
    return 0 if running["kube-apiserver"] else 1


def cmd_up_real(state: Path, *, timeout_s: float) -> int:
    node = RealNode(state)
    try:
        kubeconfig = node.up(timeout_s=timeout_s)
        # downloaded models stay with the dev cluster's state, not in the machine's /var/lib
        helm_install_operator(
            kubeconfig,
            values={"modelCache.hostPath": str(state / "model-cache")},
            log_path=node.layout.logs / "helm.log",
        )
    except (BinaryNotFoundError, ControlPlaneError) as exc:
        print(f"rewardplane dev up --node real: {exc}", file=sys.stderr)
        return 1
    print(
        f"real node up (logs in {node.layout.logs}); operator installed by helm in {OPERATOR_NAMESPACE}",
        file=sys.stderr,
    )
    print(f"export KUBECONFIG={kubeconfig}")
    return 0


def cmd_down_real(state: Path, *, purge: bool) -> int:
    left = RealNode(state).down(purge=purge)
    if left:
        print("down left behind:\n  " + "\n  ".join(left), file=sys.stderr)
        return 1
    print("real node stopped; nothing left behind")
    return 0


def cmd_status_real(state: Path) -> int:
    node = RealNode(state)
    for name, pid in node.status().items():
        print(f"{name:24} {'running (pid ' + str(pid) + ')' if pid else 'not running'}")
    if node.running():
        print(f"export KUBECONFIG={node.kubeconfig}")
    return 0 if node.running() else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rewardplane dev", description="the local development cluster")
    p.add_argument("action", choices=("up", "down", "status"))
    p.add_argument(
        "--node",
        choices=("real", "agent"),
        default="real",
        help="real: kubelet + containerd running the built images (default); agent: the node "
        "agent runs pods as host processes (for a GPU machine without a container runtime)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="pid files, logs, kubeconfig, cluster data "
        "(default ~/.cache/rewardplane/realnode, or .../dev for --node agent)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="--node agent: nvidia.com/gpu the node advertises (pretend capacity)",
    )
    p.add_argument("--purge", action="store_true", help="--node real, down: also delete images and PKI")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the cluster (default 60 for agent, 240 for real)",
    )
    args = p.parse_args(argv)
    state = (args.state_dir or default_state_dir(args.node)).expanduser().resolve()
    if args.node == "real":
        if args.action == "up":
            return cmd_up_real(state, timeout_s=args.timeout or 240.0)
        if args.action == "down":
            return cmd_down_real(state, purge=args.purge)
        return cmd_status_real(state)
    args.timeout = args.timeout or 60.0
    if args.action == "up":
        return cmd_up(state, gpus=args.gpus, timeout_s=args.timeout)
    if args.action == "down":
        return cmd_down(state)
    return cmd_status(state)


if __name__ == "__main__":
    sys.exit(main())
