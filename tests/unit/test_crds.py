"""The CRDs, the Helm chart and the example manifests agree with each other and with the operator."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from rewardplane.api.heartbeat import confirmation
from rewardplane.api.spec import NO_IMAGE, RewardModelSpec
from rewardplane.operator.conditions import compute_status
from rewardplane.operator.planning import ClusterView, NodeInfo, plan_reward_model, validate_spec
from rewardplane.operator.render import render_children
from rewardplane.operator.status import ProbeResult
from rewardplane.protocol import Endpoints

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
CHART = ROOT / "charts" / "rewardplane"
EXAMPLES = ROOT / "examples"
HELM_CANDIDATES = [Path.home() / ".cache" / "rewardplane" / "bin" / "helm"]


class _UniqueKeys(yaml.SafeLoader):
    """Refuses a key given twice in one mapping (YAML keeps the last one silently: a field's
    second copy would hide an edit to the first)."""


def _unique_mapping(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    twice = sorted({str(k) for k in keys if keys.count(k) > 1})
    if twice:
        raise yaml.constructor.ConstructorError(None, None, f"keys given twice: {twice}", node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_crd(name: str) -> dict[str, Any]:
    return yaml.load((CRDS / name).read_text(), Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


RM_CRD, WS_CRD = load_crd("rewardmodel.yaml"), load_crd("weightsync.yaml")
RM_SCHEMA, WS_SCHEMA = schema_of(RM_CRD), schema_of(WS_CRD)


# ------------------------------------------------------------------ a small structural-schema checker
# Enough of the API server's validation (types, enums, bounds, unknown fields) to check manifests
# and operator output in unit tests; the integration suite checks the same against the real thing.


def schema_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return []
    if schema.get("x-kubernetes-int-or-string"):
        return [] if isinstance(value, int | str) else [f"{path}: not int-or-string"]
    kind = schema.get("type")
    checks = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "integer": int,
        "number": int | float,
    }
    if (
        kind
        and not isinstance(value, checks[kind])
        or (kind in ("integer", "number") and isinstance(value, bool))
    ):
        return [f"{path}: expected {kind}, got {value!r}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if kind in ("integer", "number"):
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo is not None and (value < lo or (schema.get("exclusiveMinimum") and value == lo)):
            errors.append(f"{path}: {value} below minimum {lo}")
        if hi is not None and (value > hi or (schema.get("exclusiveMaximum") and value == hi)):
            errors.append(f"{path}: {value} above maximum {hi}")
    if kind == "string" and len(value) < schema.get("minLength", 0):
        errors.append(f"{path}: shorter than {schema['minLength']}")
    if kind == "object" and "properties" in schema:
        props = schema["properties"]
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}.{key}: required")
        for key, item in value.items():
            if key not in props:
                if not schema.get("x-kubernetes-preserve-unknown-fields"):
                    errors.append(f"{path}.{key}: unknown field (the API server would prune it)")
                continue
            errors += schema_errors(item, props[key], f"{path}.{key}")
    elif kind == "object" and "additionalProperties" in schema:
        for key, item in value.items():
            errors += schema_errors(item, schema["additionalProperties"], f"{path}.{key}")
    if kind == "array":
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    return errors


def walk(schema: dict[str, Any], path: str = ""):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


# ------------------------------------------------------------------ CRD shape


RM_SCALE = {
    "specReplicasPath": ".spec.replicas",
    "statusReplicasPath": ".status.replicas",
    "labelSelectorPath": ".status.selector",
}


@pytest.mark.parametrize(
    ("crd", "kind", "short", "columns", "subresources"),
    [
        (
            RM_CRD,
            "RewardModel",
            "rm",
            ["Ready", "Phase", "Reason", "Model", "Kind", "Version", "GPU-Frac", "Confirmed", "Age"],
            {"status": {}, "scale": RM_SCALE},
        ),
        (
            WS_CRD,
            "WeightSync",
            "ws",
            ["Model", "Version", "Handled", "Mode", "Phase", "Reason", "Duration(s)", "Age"],
            {"status": {}},
        ),
    ],
)
def test_crd_identity(
    crd: dict[str, Any], kind: str, short: str, columns: list[str], subresources: dict[str, Any]
) -> None:
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    spec = crd["spec"]
    assert spec["group"] == "rewardplane.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == kind and spec["names"]["shortNames"] == [short]
    assert crd["metadata"]["name"] == f"{spec['names']['plural']}.rewardplane.io"
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == subresources
    assert [c["name"].upper() for c in version["additionalPrinterColumns"]] == [c.upper() for c in columns]
    for column in version["additionalPrinterColumns"]:
        if column["jsonPath"].startswith((".spec", ".status")):  # the column's field exists in the schema
            parts = column["jsonPath"].strip(".").split(".")
            node = schema_of(crd)
            for part in parts:
                node = node["properties"][part]
            assert node["type"] == column["type"] or (node["type"], column["type"]) in (
                ("integer", "number"),
                ("string", "date"),  # an RFC 3339 string, shown as its age
            )


@pytest.mark.parametrize("schema", [RM_SCHEMA, WS_SCHEMA], ids=["RewardModel", "WeightSync"])
def test_every_field_is_described_and_typed(schema: dict[str, Any]) -> None:
    for path, node in walk(schema):
        if path in (".metadata",) or path.endswith(("{}", "[]")):  # kubectl explain shows the list's own
            continue
        assert node.get("description"), f"{path} has no description (kubectl explain shows nothing)"
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), (
            f"{path} has no type (not structural)"
        )
        assert "x-kubernetes-validations" not in node, "CEL is not enforced on Kubernetes 1.20"


@pytest.mark.parametrize("schema", [RM_SCHEMA, WS_SCHEMA], ids=["RewardModel", "WeightSync"])
def test_kopf_status_is_preserved(schema: dict[str, Any]) -> None:
    assert (
        schema["properties"]["status"]["properties"]["kopf"]["x-kubernetes-preserve-unknown-fields"] is True
    )


def test_rewardmodel_bounds() -> None:
    spec = RM_SCHEMA["properties"]["spec"]["properties"]
    fraction = spec["gpu"]["properties"]["memoryFraction"]
    assert (fraction["minimum"], fraction["exclusiveMinimum"], fraction["maximum"]) == (0, True, 1)
    assert spec["replicas"]["minimum"] == 0 and spec["tensorParallelSize"]["minimum"] == 1
    for port in ("policyHttpPort", "policyGroupPort", "http", "group"):
        p = spec["ports"]["properties"][port]
        assert (p["minimum"], p["maximum"]) == (1, 65535)
    assert spec["model"]["properties"]["pooling"]["enum"] == ["last", "mean", "cls"]
    assert spec["engine"]["properties"]["kind"]["enum"] == ["vllm", "hf"]
    assert spec["gpu"]["properties"]["mode"]["enum"] == ["exclusive", "shared", "none"]


def _defaults(schema: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, sub in (schema.get("properties") or {}).items():
        if "default" in sub and sub.get("type") != "object":
            out[f"{prefix}{key}"] = sub["default"]
        out.update(_defaults(sub, f"{prefix}{key}."))
    return out


def test_crd_defaults_match_the_operators_defaults() -> None:
    crd_defaults = _defaults(RM_SCHEMA["properties"]["spec"])
    parsed = RewardModelSpec.model_validate({"model": {"source": "x"}}).model_dump(by_alias=True, mode="json")
    for dotted, default in crd_defaults.items():
        value: Any = parsed
        for part in dotted.split("."):
            value = value[part]
        assert value == (list(default) if isinstance(default, list) else default), dotted


def test_schema_refuses_what_the_issue_names() -> None:
    base = {"model": {"source": "x"}}
    assert schema_errors(base, RM_SCHEMA["properties"]["spec"]) == []
    for bad in (
        {"gpu": {"memoryFraction": 1.5}},
        {"gpu": {"memoryFraction": 0}},
        {"replicas": -1},
        {"ports": {"http": 70000}},
        {"ports": {"group": 0}},
        {"gpu": {"mode": "half"}},
    ):
        assert schema_errors({**base, **bad}, RM_SCHEMA["properties"]["spec"]), bad
        assert validate_spec({**base, **bad}), f"the operator must refuse {bad} too (no CEL on 1.20)"


def test_operator_status_fits_the_status_schema() -> None:
    """kopf and our patches are pruned silently when a field is missing from the schema."""
    body = {
        "metadata": {"name": "rm", "namespace": "d", "uid": "u", "generation": 2},
        "spec": {"model": {"source": "x"}, "engine": {"kind": "hf"}, "gpu": {"mode": "none"}, "replicas": 2},
    }
    plan = plan_reward_model(body, ClusterView(nodes=(NodeInfo("n"),)), default_image="img:1")
    pods = [
        {
            "metadata": {
                "name": f"rm-{i}",
                "labels": {"rewardplane.io/replica": str(i)},
                "annotations": {"rewardplane.io/group-port": "51217", "rewardplane.io/rank-offset": "0"},
            },
            "spec": {"nodeName": "n"},
            "status": {"podIP": "127.0.0.2", "conditions": [{"type": "Ready", "status": "True"}]},
        }
        for i in range(2)
    ]
    status = compute_status(body, plan, pods, {"rm-0": ProbeResult(1, "serving")}, "2026-01-01T00:00:00Z")
    status |= confirmation({}, datetime.now(UTC), 30)  # the heartbeat the status writer adds
    assert schema_errors(status, RM_SCHEMA["properties"]["status"], "status") == []
    failed = compute_status(body, None, pods, {}, "2026-01-01T00:00:00Z", errors=["x"])
    assert schema_errors(failed, RM_SCHEMA["properties"]["status"], "status") == []
    no_image = compute_status(
        body, None, pods, {}, "2026-01-01T00:00:00Z", errors=["x"], error_reason=NO_IMAGE
    )
    assert schema_errors(no_image, RM_SCHEMA["properties"]["status"], "status") == []
    assert no_image["phase"] in RM_SCHEMA["properties"]["status"]["properties"]["phase"]["enum"]


def _schema_at(path: str) -> dict[str, Any]:
    node = RM_SCHEMA
    for part in path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_scale_subresource_reads_fields_the_operator_writes() -> None:
    """kubectl scale and an HPA read the scale subresource: its paths must be schema fields of the
    right types (the API server refuses the CRD otherwise), and the operator must fill the status
    ones: replicas counts the model's Pods, selector selects exactly them."""
    assert _schema_at(RM_SCALE["specReplicasPath"])["type"] == "integer"
    assert _schema_at(RM_SCALE["statusReplicasPath"])["type"] == "integer"
    assert _schema_at(RM_SCALE["labelSelectorPath"])["type"] == "string"
    body = {
        "metadata": {"name": "rm", "namespace": "d", "uid": "u", "generation": 1},
        "spec": {"model": {"source": "x"}, "engine": {"kind": "hf"}, "gpu": {"mode": "none"}, "replicas": 3},
    }
    plan = plan_reward_model(body, ClusterView(nodes=(NodeInfo("n"),)), default_image="img:1")
    desired, service = render_children(body, plan)
    status = compute_status(body, plan, desired, {}, "2026-01-01T00:00:00Z")
    assert status["replicas"] == 3 and status["readyReplicas"] == 0 and status["ready"] == "0/3"
    wanted = dict(term.split("=", 1) for term in status["selector"].split(","))
    for pod in desired:
        assert wanted.items() <= pod["metadata"]["labels"].items()  # every replica is selected
    assert wanted == service["spec"]["selector"]  # and what the Service routes to, nothing else
    # a refused spec still reports both: an HPA keeps reading the scale of a model it scales
    refused = compute_status(body, None, desired[:2], {}, "2026-01-01T00:00:00Z", errors=["x"])
    assert (refused["replicas"], refused["selector"]) == (2, status["selector"])


# ------------------------------------------------------------------ examples


EXAMPLE_FILES = sorted(EXAMPLES.glob("rewardmodel*.yaml"))  # the custom resources


def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLE_FILES}
    assert {
        "rewardmodel.yaml",
        "rewardmodel-exclusive-gpu.yaml",
        "rewardmodel-shared-gpu.yaml",
        "rewardmodel-multi-replica.yaml",
    } <= names


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        assert doc["apiVersion"] == "rewardplane.io/v1alpha1"
        schema = RM_SCHEMA if doc["kind"] == "RewardModel" else WS_SCHEMA
        assert schema_errors(doc, schema) == []
        if doc["kind"] == "RewardModel":
            assert validate_spec(doc["spec"], doc["metadata"]["name"]) == []


def test_trainer_rbac_example_names_the_example_models_token() -> None:
    # the Role lets the trainer read the control token of the RewardModel it pushes into
    from rewardplane.api.names import token_secret_name

    docs = {d["kind"]: d for d in yaml.safe_load_all((EXAMPLES / "trainer-rbac.yaml").read_text())}
    assert set(docs) == {"ServiceAccount", "Role", "RoleBinding"}
    model = yaml.safe_load((EXAMPLES / "rewardmodel.yaml").read_text())["metadata"]["name"]
    (secrets,) = [r for r in docs["Role"]["rules"] if r["resources"] == ["secrets"]]
    assert secrets == {
        "apiGroups": [""],
        "resources": ["secrets"],
        "verbs": ["get"],
        "resourceNames": [token_secret_name(model)],
    }
    sa = docs["ServiceAccount"]["metadata"]["name"]
    assert docs["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    assert docs["RoleBinding"]["roleRef"]["name"] == docs["Role"]["metadata"]["name"]


def test_cpu_example_matches_the_tiny_model_script() -> None:
    doc = yaml.safe_load((EXAMPLES / "rewardmodel.yaml").read_text())
    spec = doc["spec"]
    assert spec["model"]["source"] == "file:///tmp/rewardplane-tiny-rm"  # where make_tiny_model.py writes
    assert (spec["engine"]["kind"], spec["gpu"]["mode"]) == ("hf", "none")


# ------------------------------------------------------------------ Helm chart


def test_chart_crds_are_the_repository_crds() -> None:
    chart_crds = sorted(p.name for p in (CHART / "crds").iterdir())
    assert chart_crds == sorted(p.name for p in CRDS.glob("*.yaml"))
    for name in chart_crds:
        assert (CHART / "crds" / name).read_bytes() == (CRDS / name).read_bytes(), (
            f"{name} drifted from crds/"
        )


# Every API call the operator makes (its own client, kopf's watches and patches), and why. The
# chart must grant exactly these: a missing one breaks the operator, an extra one is privilege it
# never uses. Adding a call means adding it here, with its reason.
OPERATOR_USES = {
    ("rewardplane.io", "rewardmodels"): {"get", "list", "watch", "patch"},  # reconcile; kopf: finalizer
    ("rewardplane.io", "rewardmodels/status"): {"patch"},  # status writes
    ("rewardplane.io", "weightsyncs"): {"get", "list", "watch", "patch", "delete"},  # pushes; cleanup
    ("rewardplane.io", "weightsyncs/status"): {"patch"},  # push progress
    ("", "pods"): {"list", "watch", "create", "delete"},  # replicas; kopf watches readiness
    ("", "pods/log"): {"get"},  # a model download's progress (the fetch-model init container's log)
    ("", "services"): {"get", "list", "watch", "create", "patch", "delete"},  # headless; kopf index
    ("", "secrets"): {"get", "list", "watch", "create", "delete"},  # the control-plane token; index
    ("", "configmaps"): {"get", "list", "delete"},  # WeightSync manifests (written by trainers)
    ("", "nodes"): {"list", "watch"},  # placement: GPUs and reservations (kopf index)
    ("", "events"): {"create", "list"},  # transitions; a replica's FailedMount (its only trace)
    ("networking.k8s.io", "networkpolicies"): {"get", "list", "watch", "create", "patch", "delete"},  # index
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},  # kopf
    ("", "namespaces"): {"list", "watch"},  # kopf, cluster-wide
}


def chart_rbac_rules() -> list[dict[str, Any]]:
    # Template lines dropped, the rest is plain YAML.
    lines = (CHART / "templates" / "rbac.yaml").read_text().splitlines()
    text = "\n".join(line for line in lines if "{{" not in line)
    return next(d for d in yaml.safe_load_all(text) if d and d.get("kind") == "ClusterRole")["rules"]


def test_chart_rbac_grants_exactly_what_the_operator_uses() -> None:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in chart_rbac_rules():
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field} of {rule}: name what is used"
        assert not rule.get("resourceNames") or rule["resources"], rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    unused = {k: sorted(v - OPERATOR_USES.get(k, set())) for k, v in granted.items()}
    assert not {k: v for k, v in unused.items() if v}, f"granted but never used: {unused}"
    missing = {k: sorted(v - granted.get(k, set())) for k, v in OPERATOR_USES.items()}
    assert not {k: v for k, v in missing.items() if v}, f"used but not granted: {missing}"


def _helm() -> str | None:
    found = shutil.which("helm")
    return found or next((str(p) for p in HELM_CANDIDATES if p.exists()), None)


@pytest.fixture
def helm() -> str:
    binary = _helm()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("helm is missing in CI; run scripts/install-k8s-tools.sh")
        pytest.skip("helm not installed (scripts/install-k8s-tools.sh installs it)")
    return binary


def test_helm_lint(helm: str) -> None:
    result = subprocess.run([helm, "lint", str(CHART)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_helm_template_renders_the_operator(helm: str) -> None:
    result = subprocess.run(
        [helm, "template", "rp", str(CHART), "--namespace", "rewardplane-system", "--include-crds"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("CustomResourceDefinition") == 2
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service"} <= set(kinds)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/rewardplane/operator:0.1.0"
    assert "--all-namespaces" in container["args"]
    scoped = subprocess.run(
        [helm, "template", "rp", str(CHART), "--set", "operator.watchNamespace=team-a"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--namespace=team-a" in scoped.stdout


def _template(helm: str, *sets: str) -> list[dict[str, Any]]:
    args = [a for s in sets for a in ("--set", s)]
    result = subprocess.run(
        [helm, "template", "rp", str(CHART), "--namespace", "rewardplane-system", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _operator_args(docs: list[dict[str, Any]]) -> list[str]:
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_crd_names_no_image_and_the_chart_gives_the_operator_its_own(helm: str) -> None:
    """The CRD holds no default image (none exists to pull); the chart hands the operator the
    reward-server image of its appVersion, or the one its values name, or none at all."""
    engine = RM_SCHEMA["properties"]["spec"]["properties"]["engine"]["properties"]
    assert "default" not in engine["image"]
    assert RewardModelSpec.model_validate({"model": {"source": "x"}}).engine.image is None
    assert "--default-server-image=ghcr.io/rewardplane/reward-server:0.1.0" in _operator_args(_template(helm))
    local = _template(
        helm, "serverImage.repository=localhost/rewardplane/reward-server", "serverImage.tag=0.1.0-local"
    )
    assert "--default-server-image=localhost/rewardplane/reward-server:0.1.0-local" in _operator_args(local)
    none = _operator_args(_template(helm, "serverImage.repository="))
    assert not [a for a in none if a.startswith("--default-server-image")]


def test_the_chart_passes_the_model_cache_values_to_the_operator(helm: str) -> None:
    args = _operator_args(_template(helm))
    assert "--model-cache-dir=/var/lib/rewardplane/model-cache" in args
    assert "--model-cache-size=200Gi" in args
    assert "--model-cache-verify=sha256" in args
    args = _operator_args(_template(helm, "modelCache.verify=size", "modelCache.size=50Gi"))
    assert "--model-cache-verify=size" in args and "--model-cache-size=50Gi" in args


def test_the_grafana_dashboard_is_off_by_default_and_ships_in_a_configmap(helm: str) -> None:
    assert "ConfigMap" not in {d["kind"] for d in _template(helm)}
    docs = _template(helm, "dashboards.enabled=true", "dashboards.namespace=monitoring")
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert (
        cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    )
    board = (CHART / "dashboards" / "rewardplane.json").read_text()
    assert json.loads(cm["data"]["rewardplane.json"]) == json.loads(board)


def test_prometheus_monitors_are_off_by_default_and_scrape_the_metrics_ports(helm: str) -> None:
    kinds = {d["kind"] for d in _template(helm)}
    assert not kinds & {"ServiceMonitor", "PodMonitor"}
    docs = _template(
        helm,
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.interval=15s",
        "metrics.serviceMonitor.labels.release=kps",
        "metrics.podMonitor.enabled=true",
        "metrics.podMonitor.interval=10s",
        "metrics.podMonitor.labels.release=kps",
    )
    by_kind = {d["kind"]: d for d in docs}
    # the operator: its metrics Service's port (named metrics, /metrics), in the release namespace
    monitor, service = by_kind["ServiceMonitor"], by_kind["Service"]
    assert (
        monitor["apiVersion"] == "monitoring.coreos.com/v1"
        and monitor["metadata"]["labels"]["release"] == "kps"
    )
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["rewardplane-system"]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "15s")
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    # the reward servers: the replica Pods the operator renders, on their http port
    pods = by_kind["PodMonitor"]
    assert pods["metadata"]["labels"]["release"] == "kps" and pods["spec"]["namespaceSelector"] == {
        "any": True
    }
    [endpoint] = pods["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", Endpoints.METRICS, "10s")
    body = {
        "metadata": {"name": "rm", "namespace": "d", "uid": "u", "generation": 1},
        "spec": {"model": {"source": "x"}, "engine": {"kind": "hf"}, "gpu": {"mode": "none"}},
    }
    plan = plan_reward_model(body, ClusterView(nodes=(NodeInfo("n"),)), default_image="img:1")
    [pod], _ = render_children(body, plan)
    assert pods["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    scoped = {
        d["kind"]: d for d in _template(helm, "metrics.podMonitor.enabled=true", "operator.watchNamespace=rl")
    }
    assert scoped["PodMonitor"]["spec"]["namespaceSelector"] == {"matchNames": ["rl"]}


def test_a_service_monitor_without_the_metrics_service_is_refused(helm: str) -> None:
    result = subprocess.run(
        [
            helm,
            "template",
            "rp",
            str(CHART),
            "--set",
            "metrics.serviceMonitor.enabled=true",
            "--set",
            "metrics.service=false",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "metrics.service=true" in result.stderr
