"""Every ``REWARDPLANE_*`` environment variable, declared once: its type, default, one-line meaning
and the program that reads it.

Code never reads such a variable itself: it asks the registry (``settings.STAGING_MAX_BYTES.get()``),
which reads the environment when called (not at import, so tests and command-line flags can set it)
and turns a bad value into one ``SettingError`` that says what was wrong and what to give.
Operational settings of the server and the operator are command-line flags too, whose default
comes from here. ``docs/settings.md`` is generated from this module (``python
scripts/settings_doc.py``; ``--check`` says whether it is current) and
``tests/unit/test_settings_registry.py`` checks that the page is current, that no module reads a
``REWARDPLANE_*`` variable past the registry, and that every setting here is read somewhere.

Depends only on the standard library, so every layer may import it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")
PREFIX = "REWARDPLANE_"


class SettingError(ValueError):
    """A ``REWARDPLANE_*`` variable holds a value its setting cannot take."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: ``get()`` reads it now (unset or blank: ``default``)."""

    name: str
    kind: str  # what to give, in words ("seconds > 0", "1 or 0", ...)
    default: T
    meaning: str  # one line
    read_by: str  # the program (or script) that reads it
    parse: Callable[[str], T]
    flag: str = ""  # the command-line flag that takes precedence, where there is one
    default_text: str = ""  # the default in words, where ``default`` does not say it

    @property
    def shown_default(self) -> str:
        if self.default_text:
            return self.default_text
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value in ``environ`` (default ``os.environ``), parsed; ``SettingError`` if it is bad."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or not raw.strip():
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError:
            raise SettingError(
                f"{self.name}={raw!r} is not valid: give {self.kind}, or unset it "
                f"(default {self.shown_default}; {self.meaning})"
            ) from None

    def export(self, value: T | None, environ: MutableMapping[str, str] | None = None) -> None:
        """Write ``value`` into ``environ`` (default ``os.environ``), for a process started later
        (or a module read later) to see; None unsets it."""
        env = os.environ if environ is None else environ
        if value is None:
            env.pop(self.name, None)
        elif isinstance(value, bool):
            env[self.name] = "1" if value else "0"
        else:
            env[self.name] = str(value)


# ---- parsers: each raises ValueError for a value it cannot take --------------------------------


def _text(raw: str) -> str:
    return raw


def _flag(raw: str) -> bool:
    value = raw.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value == float("inf"):
        raise ValueError(raw)
    return value


def _whole(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(raw)
        return value

    return parse


_BYTE_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def _bytes(raw: str) -> int:
    """A size as Kubernetes writes quantities: 500Gi, 2T, 1073741824."""
    match = re.fullmatch(r"(\d+)([kMGT]i?)?", raw.strip())
    if match is None:
        raise ValueError(raw)
    return int(match[1]) * _BYTE_UNITS[match[2] or ""]


def _choice(*choices: str, upper: bool = False) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.upper() if upper else raw.lower()
        if value not in choices:
            raise ValueError(raw)
        return value

    return parse


SETTINGS: list[Setting[Any]] = []


def _register(setting: Setting[T]) -> Setting[T]:
    assert setting.name.startswith(PREFIX) and setting.name not in {s.name for s in SETTINGS}
    SETTINGS.append(setting)
    return setting


SERVER = "reward server"
SDK = "SDK, `rewardplane` CLI"

# ---- the control-plane token: server and clients alike (protocol.auth.resolve_token) -------------
TOKEN: Setting[str | None] = _register(
    Setting(
        "REWARDPLANE_TOKEN",
        "the token",
        None,
        "the weight-sync control plane's bearer token; unset (and no token file): the control plane is off",
        f"{SERVER}, {SDK}",
        _text,
        flag="server --token-file",
    )
)
TOKEN_FILE: Setting[str | None] = _register(
    Setting(
        "REWARDPLANE_TOKEN_FILE",
        "a file's path",
        None,
        "a file holding the control-plane token; wins over REWARDPLANE_TOKEN",
        f"{SERVER}, {SDK}",
        _text,
        flag="server --token-file",
    )
)

# ---- the reward server (images/reward-server) ----------------------------------------------------
STAGING_MAX_BYTES: Setting[int | None] = _register(
    Setting(
        "REWARDPLANE_STAGING_MAX_BYTES",
        "a whole number of bytes >= 0",
        None,
        "a cap on what one push may stage on this server (an atomic push's copy of the update, a sliced "
        "push's buckets in flight); unset: the device's free memory decides",
        SERVER,
        _whole(0),
        flag="--staging-max-bytes",
    )
)
VLLM_SCORE_TIMEOUT_S: Setting[float] = _register(
    Setting(
        "REWARDPLANE_VLLM_SCORE_TIMEOUT_S",
        "seconds > 0",
        600.0,
        "the vLLM engine's bound on one scoring or generation call",
        SERVER,
        _seconds,
        flag="--vllm-score-timeout-s",
    )
)
VLLM_RPC_TIMEOUT_S: Setting[float] = _register(
    Setting(
        "REWARDPLANE_VLLM_RPC_TIMEOUT_S",
        "seconds > 0",
        3600.0,
        "the vLLM engine's backstop on a long worker call (a push's receive, a restore, a snapshot)",
        SERVER,
        _seconds,
        flag="--vllm-rpc-timeout-s",
    )
)
VLLM_SLEEP_TIMEOUT_S: Setting[float] = _register(
    Setting(
        "REWARDPLANE_VLLM_SLEEP_TIMEOUT_S",
        "seconds > 0",
        600.0,
        "the vLLM engine's bound on /sleep and /wake (they copy the weights)",
        SERVER,
        _seconds,
        flag="--vllm-sleep-timeout-s",
    )
)
MAX_JOIN_TIMEOUT_S: Setting[float] = _register(
    Setting(
        "REWARDPLANE_MAX_JOIN_TIMEOUT_S",
        "seconds > 0",
        600.0,
        "the largest timeout_s a join of a trainer's group may ask for (a larger one is refused, 400)",
        SERVER,
        _seconds,
        flag="--max-join-timeout-s",
    )
)
ADAPTER_DIR: Setting[str | None] = _register(
    Setting(
        "REWARDPLANE_ADAPTER_DIR",
        "a directory's path",
        None,
        "where a server's workers write pushed LoRA adapters for vLLM's directory loader",
        SERVER,
        _text,
        flag="--adapter-dir",
        default_text="/dev/shm, else the temporary directory",
    )
)

DETERMINISTIC_GEMMS = ("auto", "triton")
DETERMINISTIC_GEMM: Setting[str] = _register(
    Setting(
        "REWARDPLANE_DETERMINISTIC_GEMM",
        "auto or triton",
        "auto",
        "which matmul the linear layers use under --deterministic (vLLM's batch-invariant mode): "
        "auto: cuBLASLt without split-K on compute capability 9.0 and later (Hopper, Blackwell), "
        "where it is batch-invariant, and vLLM's Triton persistent matmul on older GPUs; triton: "
        "vLLM's Triton matmul everywhere (slower, as vLLM ships it). Either way, where the final "
        "decoder layer runs on the pooled rows (REWARDPLANE_LAST_TOKEN_ONLY), those few rows per "
        "step and the score head run on the Triton matmul",
        "reward server (vLLM workers)",
        _choice(*DETERMINISTIC_GEMMS),
    )
)

LAST_TOKEN_ONLY: Setting[bool] = _register(
    Setting(
        "REWARDPLANE_LAST_TOKEN_ONLY",
        "1 or 0",
        True,
        "1: a Llama or Mistral reward model on vLLM with LAST pooling runs its final decoder layer's output "
        "projection, MLP and norm on each prompt's last token only (the rows the score reads; 2-4% "
        "of the work at 0.4B-7B); 0: vLLM's own model, every row",
        "reward server (vLLM workers)",
        _flag,
    )
)

SAME_GPU_GRAPHS: Setting[bool] = _register(
    Setting(
        "REWARDPLANE_SAME_GPU_GRAPHS",
        "1 or 0",
        True,
        "1: a worker receiving a same-GPU push of a layout it received before replays the bucket's "
        "copies as one CUDA graph (one launch instead of one per tensor); 0: one copy per tensor",
        "reward server (vLLM workers)",
        _flag,
    )
)

# ---- the SDK --------------------------------------------------------------------------------------
URL: Setting[str | None] = _register(
    Setting(
        "REWARDPLANE_URL",
        "comma-separated base URLs",
        None,
        "the reward servers of `verl_compute_score` when its reward_kwargs name no url",
        "SDK (`rewardplane.sdk.integrations`)",
        _text,
    )
)
MODEL: Setting[str] = _register(
    Setting(
        "REWARDPLANE_MODEL",
        "a model name",
        "reward-model",
        "the model name `verl_compute_score` sends when its reward_kwargs name none",
        "SDK (`rewardplane.sdk.integrations`)",
        _text,
    )
)

PUSH_SLICING: Setting[str] = _register(
    Setting(
        "REWARDPLANE_PUSH_SLICING",
        "auto, always or never",
        "auto",
        "data-plane pushes send each server rank only what it keeps of each tensor: `auto` where "
        "that moves at most 3/4 of a broadcast's bytes (tensor-parallel replicas), `always` wherever "
        "the ranks published it, `never`: broadcast",
        "SDK (`WeightPusher`)",
        _choice("auto", "always", "never"),
    )
)


# ---- the operator ---------------------------------------------------------------------------------
RESYNC_INTERVAL: Setting[float] = _register(
    Setting(
        "REWARDPLANE_RESYNC_INTERVAL",
        "seconds > 0",
        30.0,
        "seconds between periodic reconciles of each RewardModel besides its events",
        "operator",
        _seconds,
        flag="--resync-interval",
    )
)
LOG_LEVEL: Setting[str] = _register(
    Setting(
        "REWARDPLANE_LOG_LEVEL",
        "DEBUG, INFO, WARNING, ERROR or CRITICAL",
        "INFO",
        "the operator's log level",
        "operator",
        _choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", upper=True),
        flag="--log-level",
    )
)
SERVER_IMAGE: Setting[str | None] = _register(
    Setting(
        "REWARDPLANE_SERVER_IMAGE",
        "an image reference",
        None,
        "the reward-server image of a RewardModel without spec.engine.image (the chart sets it: "
        "serverImage); unset: such a model is Degraded with reason NoImage",
        "operator",
        _text,
        flag="--default-server-image",
    )
)
MODEL_CACHE_DIR: Setting[str] = _register(
    Setting(
        "REWARDPLANE_MODEL_CACHE_DIR",
        "an absolute path on the nodes",
        "/var/lib/rewardplane/model-cache",
        "the node directory (hostPath) where replicas keep models downloaded from s3://, https:// and "
        "hf:// sources, shared by every replica and restart on the node (the chart sets it: "
        "modelCache.hostPath); --model-cache-dir '' (the chart: an empty hostPath): each Pod downloads "
        "into its own emptyDir",
        "operator",
        _text,
        flag="--model-cache-dir",
    )
)
MODEL_CACHE_SIZE: Setting[int] = _register(
    Setting(
        "REWARDPLANE_MODEL_CACHE_SIZE",
        "bytes, as a Kubernetes quantity (200Gi)",
        200 * 2**30,
        "the size the node cache is kept under: after a download, the least recently used other "
        "models are removed (the chart sets it: modelCache.size); 0 keeps everything",
        "operator",
        _bytes,
        flag="--model-cache-size",
        default_text="200Gi",
    )
)
MODEL_CACHE_VERIFIES = ("sha256", "size")
MODEL_CACHE_VERIFY: Setting[str] = _register(
    Setting(
        "REWARDPLANE_MODEL_CACHE_VERIFY",
        "sha256 or size",
        "sha256",
        "how a replica checks a model it finds in the node cache before its server starts (the chart "
        "sets it: modelCache.verify): sha256 re-reads every byte at each start and catches a corrupted "
        "cache entry (~15 s for a 7B model); size compares file sizes only, near-instant, and trusts "
        "files written once complete",
        "operator",
        _choice(*MODEL_CACHE_VERIFIES),
        flag="--model-cache-verify",
    )
)

# ---- the local cluster and the scripts ------------------------------------------------------------
CACHE: Setting[str | None] = _register(
    Setting(
        "REWARDPLANE_CACHE",
        "a directory's path",
        None,
        "rewardplane's cache: the Kubernetes binaries in bin/, image builds",
        "local cluster, scripts/*.sh",
        _text,
        default_text="~/.cache/rewardplane",
    )
)


def cache_root() -> Path:
    """Root of rewardplane's cache: ``$REWARDPLANE_CACHE`` or ``~/.cache/rewardplane``."""
    env = CACHE.get()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rewardplane"


EXISTING_CLUSTER: Setting[bool] = _register(
    Setting(
        "REWARDPLANE_EXISTING_CLUSTER",
        "1 or 0",
        False,
        "1: the local-cluster helpers and tests use the cluster of $KUBECONFIG instead of starting one",
        "local cluster, tests",
        _flag,
    )
)
POD_NETWORK: Setting[int] = _register(
    Setting(
        "REWARDPLANE_POD_NETWORK",
        "a whole number 0..255",
        0,
        "the node agent's pods get 127.N.0.2, 127.N.0.3, ...; node agents on one host need different N",
        "local cluster (node agent)",
        _whole(0, 255),
        flag="node agent --pod-network",
    )
)
NODE_AGENT_ID: Setting[str | None] = _register(
    Setting(
        "REWARDPLANE_NODE_AGENT_ID",
        "(set by the node agent)",
        None,
        "set by the node agent on every process it starts, to find them after a crash; not for users",
        "local cluster (node agent)",
        _text,
    )
)
E2E_KEEP: Setting[bool] = _register(
    Setting(
        "REWARDPLANE_E2E_KEEP",
        "1 or 0",
        False,
        "1: tests/e2e leaves its cluster up after a failure, to look at it",
        "tests/e2e",
        _flag,
    )
)
NODE_MODE: Setting[str] = _register(
    Setting(
        "REWARDPLANE_NODE_MODE",
        "real or agent",
        "real",
        "scripts/dev.sh's node: real kubelet and containers, or the node agent (pods as host processes)",
        "scripts/dev.sh",
        _choice("real", "agent"),
    )
)
IMAGE_TAG: Setting[str | None] = _register(
    Setting(
        "REWARDPLANE_IMAGE_TAG",
        "an image tag",
        None,
        "the tag scripts/build-images.sh gives the images it builds",
        "scripts/build-images.sh",
        _text,
        default_text="the project's version + `-local`",
    )
)
NODE: Setting[bool] = _register(
    Setting(
        "REWARDPLANE_NODE",
        "1 or 0",
        True,
        "0: scripts/install-k8s-tools.sh installs only the control plane's binaries, no node's",
        "scripts/install-k8s-tools.sh",
        _flag,
    )
)
KEEP_BUILD: Setting[bool] = _register(
    Setting(
        "REWARDPLANE_KEEP_BUILD",
        "1 or 0",
        False,
        "1: scripts/install-k8s-tools.sh keeps its ~2 GB Kubernetes build tree",
        "scripts/install-k8s-tools.sh",
        _flag,
    )
)

# Names that no program reads, with what holds instead: each was a switch between two ways, and the
# faster way is the only one. A program warns when one is set (``retired_in_environment``).
RETIRED: dict[str, str] = {
    "REWARDPLANE_PER_TENSOR_WIRE": "every push travels per tensor; there are no packed buckets on the wire",
    "REWARDPLANE_FIRST_BUCKET_SHARE": "a push's first bucket holds 1/8 of the others' bytes "
    "(`protocol.weights.FIRST_BUCKET_SHARE`)",
    "REWARDPLANE_RECEIVE_LOOKAHEAD": "a server's CPU runs 4 buckets ahead of its loads "
    "(`transport.transfer.RECEIVE_LOOKAHEAD`)",
    "REWARDPLANE_DIRECT_LOAD": "the copy plan is always on: names the loader only copies are copied directly",
    "REWARDPLANE_ADAPTER_LOAD": "adapters are built in memory; vLLM's directory loader is the fallback where "
    "vLLM's internals differ",
    "REWARDPLANE_PREFIX_CACHE": "requests are salted with the weights' epoch; there is no engine-wide reset",
    "REWARDPLANE_RESET_CACHE_AT": "a streamed push advances the cache epoch once the workers are told to receive",
}


def by_name(name: str) -> Setting[Any]:
    for setting in SETTINGS:
        if setting.name == name:
            return setting
    raise KeyError(name)


def retired_in_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """Retired names set in ``environ`` (they do nothing now; a program may warn about them)."""
    env = os.environ if environ is None else environ
    return sorted(name for name in RETIRED if name in env)


def warn_retired(log: logging.Logger, environ: Mapping[str, str] | None = None) -> None:
    """One warning per retired name set in ``environ``: it does nothing now, and says what holds."""
    for name in retired_in_environment(environ):
        log.warning("%s is set but retired: %s", name, RETIRED[name])


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """``docs/settings.md``."""
    lines = [
        "# Settings",
        "",
        "<!-- Generated from core/src/rewardplane/protocol/settings.py by",
        "     `python scripts/settings_doc.py`; do not edit. -->",
        "",
        "Every `REWARDPLANE_*` environment variable, from the one registry in",
        "`rewardplane.protocol.settings`. A setting with a flag is a command-line flag first; the",
        "variable is the flag's default. A bad value stops the program with one error that names",
        "the variable and what to give.",
        "",
        "| variable | give | default | meaning | read by | flag |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        flag = f"`{s.flag}`" if s.flag else ""
        lines.append(
            f"| `{s.name}` | {_cell(s.kind)} | {_cell(s.shown_default)} | {_cell(s.meaning)} | "
            f"{_cell(s.read_by)} | {flag} |"
        )
    lines += [
        "",
        "## Retired",
        "",
        "Nothing reads these names; a server or operator that finds one set says so in its log.",
        "",
        "| variable | what holds instead |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {_cell(why)} |" for name, why in RETIRED.items()]
    return "\n".join(lines) + "\n"
