"""Model delivery (spec.model → volumes, mounts, --model, the download step) and what a reward Pod runs with."""

from __future__ import annotations

from typing import Any

import pytest

from rewardplane.api.spec import ModelSpec
from rewardplane.operator.__main__ import parse_args
from rewardplane.operator.planning import ClusterView, NodeInfo, plan_reward_model, validate_spec
from rewardplane.operator.render import NON_ROOT_UID, TOKEN_FILE, render_pod
from rewardplane.operator.storage import (
    CACHE_MOUNT_DIR,
    MODEL_MOUNT_DIR,
    InvalidSourceError,
    ModelCache,
    delivery,
)
from rewardplane.protocol import settings
from rewardplane.protocol.model_sources import cache_key, parse_source


def model(source: str, **more: Any) -> ModelSpec:
    return ModelSpec.model_validate({"source": source, **more})


def test_pvc_source_mounts_the_claim_read_only() -> None:
    d = delivery(model("pvc://models/llama/rm-7b"))
    assert d.volume == {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    assert d.mount["mountPath"] == MODEL_MOUNT_DIR and d.mount["readOnly"]
    assert d.model_arg == f"{MODEL_MOUNT_DIR}/llama/rm-7b" and d.fetch is None
    assert delivery(model("pvc://models")).model_arg == MODEL_MOUNT_DIR


@pytest.mark.parametrize("source", ["file:///data/rm", "/data/rm", "/data/rm/"])
def test_node_directory_is_a_host_path(source: str) -> None:
    d = delivery(model(source))
    assert d.volume["hostPath"] == {"path": "/data/rm", "type": "Directory"}
    assert d.model_arg == MODEL_MOUNT_DIR and d.fetch is None


@pytest.mark.parametrize(
    ("source", "revision"),
    [
        ("hf://org/name", None),
        ("org/name", None),
        ("hf://org/name@v2", "v2"),
        ("s3://models/llama/rm-7b", None),
        ("https://models.example.com/rm-7b.tar.gz", None),
    ],
)
def test_downloaded_sources_are_fetched_into_the_node_cache_before_the_server(
    source: str, revision: str | None
) -> None:
    cache = ModelCache("/var/lib/rp-cache", 10**9)
    d = delivery(model(source), "localhost/rs:test", cache)
    key = cache_key(parse_source(source))
    # the server reads the fetched model from the cache, read-only
    assert d.model_arg == f"{CACHE_MOUNT_DIR}/{key}/model"
    assert d.volume["hostPath"] == {"path": "/var/lib/rp-cache", "type": "DirectoryOrCreate"}
    assert d.mount == {"name": "model-cache", "mountPath": CACHE_MOUNT_DIR, "readOnly": True}
    fetch = d.fetch
    assert fetch is not None and fetch["image"] == "localhost/rs:test"
    assert fetch["command"] == ["python", "-m", "rewardplane.modelfetch"]
    args = fetch["args"]
    assert args[args.index("--source") + 1] == source and args[args.index("--key") + 1] == key
    assert args[args.index("--max-cache-bytes") + 1] == str(10**9)
    assert ("--revision" in args) == (revision is not None)
    assert fetch["volumeMounts"] == [{"name": "model-cache", "mountPath": CACHE_MOUNT_DIR}]
    assert "envFrom" not in fetch


def test_without_a_cache_directory_each_pod_downloads_into_its_own_volume() -> None:
    d = delivery(model("s3://models/rm"), "img", ModelCache(""))
    assert d.volume == {"name": "model-cache", "emptyDir": {}}
    assert d.fetch is not None and "--max-cache-bytes" not in d.fetch["args"]


def _verify_arg(cache: ModelCache | None) -> str:
    """The check the fetcher is told to make: sha256 where the args leave it to its default (Pods
    rendered before the setting existed keep their spec hash, so an upgrade restarts nothing)."""
    d = delivery(model("hf://org/rm-7b"), "img", cache)
    assert d.fetch is not None
    args = d.fetch["args"]
    assert args.count("--verify") <= 1
    return str(args[args.index("--verify") + 1]) if "--verify" in args else "sha256"


def _cache_from_operator_flags(*argv: str) -> ModelCache:
    args = parse_args(list(argv))
    return ModelCache(args.model_cache_dir, args.model_cache_size, args.model_cache_verify)


def test_the_cached_model_is_checked_by_sha256_unless_the_admin_chooses_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(settings.MODEL_CACHE_VERIFY.name, raising=False)
    assert _verify_arg(None) == "sha256"
    default = delivery(model("hf://org/rm-7b"), "img", _cache_from_operator_flags()).fetch
    assert default is not None and "--verify" not in default["args"]  # the Pods of before, unchanged
    assert _verify_arg(_cache_from_operator_flags()) == "sha256"
    assert _verify_arg(ModelCache("", 0)) == "sha256"  # also into a Pod's own emptyDir
    assert _verify_arg(_cache_from_operator_flags("--model-cache-verify", "size")) == "size"
    monkeypatch.setenv(settings.MODEL_CACHE_VERIFY.name, "size")
    assert _verify_arg(_cache_from_operator_flags()) == "size"
    # the flag wins over the setting
    assert _verify_arg(_cache_from_operator_flags("--model-cache-verify", "sha256")) == "sha256"


def test_a_bad_cache_verify_is_refused_with_the_allowed_values(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(settings.MODEL_CACHE_VERIFY.name, "md5")
    with pytest.raises(settings.SettingError, match="give sha256 or size"):
        settings.MODEL_CACHE_VERIFY.get()
    with pytest.raises(SystemExit):
        parse_args([])
    err = capsys.readouterr().err
    assert "REWARDPLANE_MODEL_CACHE_VERIFY='md5'" in err and "sha256 or size" in err
    monkeypatch.delenv(settings.MODEL_CACHE_VERIFY.name)
    with pytest.raises(SystemExit):
        parse_args(["--model-cache-verify", "none"])
    err = capsys.readouterr().err
    assert "--model-cache-verify" in err and "sha256 or size" in err
    with pytest.raises(ValueError, match="sha256, size"):
        ModelCache("/var/cache/rp", 0, "crc32")


def test_credentials_reach_only_the_download_and_the_endpoint_is_passed() -> None:
    spec = {
        "model": {
            "source": "s3://models/rm",
            "sourceSecret": "s3-creds",
            "sourceEndpoint": "http://minio.storage:9000",
        },
        "engine": {"kind": "hf"},
        "gpu": {"mode": "none"},
    }
    rm = {"apiVersion": "rewardplane.io/v1alpha1", "kind": "RewardModel"}
    rm["metadata"] = {"name": "rm", "namespace": "ns", "uid": "u1"}
    rm["spec"] = spec
    plan = plan_reward_model(
        rm,
        ClusterView(nodes=(NodeInfo(name="n1", gpus=0),)),
        default_image="localhost/rs:test",
        model_cache=ModelCache("/var/cache/rp", 0),
    )
    pod = render_pod(rm, plan, plan.replicas[0])
    [fetch], [server] = pod["spec"]["initContainers"], pod["spec"]["containers"]
    assert fetch["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert "envFrom" not in server
    assert fetch["args"][fetch["args"].index("--endpoint") + 1] == "http://minio.storage:9000"
    # the fetcher writes the node cache (a root-owned hostPath) with one capability; the server
    # stays non-root and reads it read-only
    assert fetch["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}
    assert fetch["securityContext"]["readOnlyRootFilesystem"] is True
    assert server["securityContext"]["runAsUser"] == NON_ROOT_UID
    key = cache_key(parse_source("s3://models/rm"), "http://minio.storage:9000")
    assert server["args"][server["args"].index("--model") + 1] == f"{CACHE_MOUNT_DIR}/{key}/model"
    # requests may still name the model by its source
    assert "s3://models/rm" in server["args"][server["args"].index("--model-alias") + 1 :]


def test_cache_keys_differ_by_revision_and_endpoint_and_read_like_the_model() -> None:
    a = cache_key(parse_source("hf://org/rm-7b"))
    assert a.startswith("rm-7b-") and a == cache_key(parse_source("org/rm-7b"))
    assert a != cache_key(parse_source("hf://org/rm-7b@v2"))
    assert a != cache_key(parse_source("hf://org/rm-7b"), "https://hf-mirror.example")


@pytest.mark.parametrize(
    ("source", "more"),
    [
        ("pvc://", {}),
        ("pvc://c/../../etc", {}),
        ("file://relative", {}),
        ("a/b/c", {}),
        ("gs://bucket/rm", {}),
        ("s3://Bad_Bucket/rm", {}),
        ("https://models.example.com", {}),
        ("https://user:pw@models.example.com/rm.tar", {}),
        ("ftp://models/rm", {}),
        ("hf://org/name@", {}),
        ("hf://org/name@v1", {"revision": "v2"}),
        ("pvc://models/rm", {"sourceSecret": "creds"}),
        ("https://models.example.com/rm.tar", {"sourceEndpoint": "http://x"}),
        ("s3://models/rm", {"sourceEndpoint": "minio:9000"}),
    ],
)
def test_bad_sources_are_refused_with_the_forms_that_work(source: str, more: dict[str, str]) -> None:
    with pytest.raises(InvalidSourceError):
        delivery(model(source, **more))
    errors = validate_spec(
        {"model": {"source": source, **more}, "engine": {"kind": "hf"}, "gpu": {"mode": "none"}}
    )
    assert len(errors) == 1 and errors[0].startswith("spec.model.source"), errors


def _pod(source: str) -> dict[str, Any]:
    rm = {
        "apiVersion": "rewardplane.io/v1alpha1",
        "kind": "RewardModel",
        "metadata": {"name": "rm", "namespace": "ns", "uid": "u1"},
        "spec": {
            "model": {"source": source},
            "engine": {"kind": "hf"},
            "gpu": {"mode": "none"},
            "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}},
        },
    }
    plan = plan_reward_model(
        rm, ClusterView(nodes=(NodeInfo(name="n1", gpus=0),)), default_image="localhost/rs:test"
    )
    return render_pod(rm, plan, plan.replicas[0])


def test_reward_pod_runs_non_root_with_probes_token_file_and_the_model_volume() -> None:
    pod = _pod("pvc://models/rm")
    spec, [ctr] = pod["spec"], pod["spec"]["containers"]
    ctx = ctr["securityContext"]
    assert ctx["runAsUser"] == NON_ROOT_UID and ctx["runAsNonRoot"] and ctx["readOnlyRootFilesystem"]
    assert (
        spec["securityContext"]["fsGroup"] == NON_ROOT_UID and spec["automountServiceAccountToken"] is False
    )
    for probe in ("startupProbe", "livenessProbe"):
        assert ctr[probe]["httpGet"]["path"] == "/health"
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert ctr["args"][ctr["args"].index("--model") + 1] == f"{MODEL_MOUNT_DIR}/rm"
    assert ctr["args"][ctr["args"].index("--token-file") + 1] == TOKEN_FILE
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in spec[
        "volumes"
    ]
    assert ctr["resources"] == {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}
    # the server drains on SIGTERM (--graceful-shutdown-s, default 10 s) inside the grace period
    assert spec["terminationGracePeriodSeconds"] > 10
    # ...and is never PID 1 (which would ignore a SIGTERM that lands before its handler exists)
    assert spec["shareProcessNamespace"] is True
