"""A RewardModel's children in the cluster: the token Secret, the headless Service, the
NetworkPolicy and the Pods, brought to what the plan rendered; and, when the model goes, what
garbage collection cannot delete.

The children are read from the indexes: one the index has not seen yet is created again (answered
409, nothing changes) and one patched moments ago is patched again to the same spec.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from rewardplane.api.kube import Kube, core_path, custom_path
from rewardplane.api.names import WS_PLURAL

from . import metrics
from .cluster import NETWORK_POLICIES, SECRETS, SERVICES, ClusterReader, network_policy_path, plain
from .planning import Plan
from .render import (
    TOKEN_KEY,
    network_policy_name,
    new_token,
    render_network_policy,
    render_token_secret,
    selector,
    token_secret_name,
)
from .rollout import pod_actions

log = logging.getLogger("rewardplane.operator")


def owned_by(obj: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    uid = owner["metadata"].get("uid")
    return any(ref.get("uid") == uid for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


class Children:
    """Creates, patches and deletes one model's children through ``kube``; reads them through
    ``reader()`` (the indexes, or the API server)."""

    def __init__(self, kube: Kube, reader: Callable[[], ClusterReader]) -> None:
        self.kube = kube
        self.reader = reader

    def ensure_secret(self, rm: Mapping[str, Any]) -> None:
        ns, name = rm["metadata"]["namespace"], rm["metadata"]["name"]
        # Created once: servers read the token at start, rotating it would lock everyone out.
        if self.reader().child(SECRETS, ns, token_secret_name(name)) is None:
            self.kube.create(core_path("secrets", ns), render_token_secret(rm, new_token()))

    def token(self, ns: str, name: str) -> str:
        """The model's control-plane token."""
        secret_name = token_secret_name(name)
        secret = (  # the index lags a Secret created moments ago
            self.reader().child(SECRETS, ns, secret_name)
            or self.kube.get(core_path("secrets", ns, secret_name))
            or {}
        )
        return base64.b64decode((secret.get("data") or {}).get(TOKEN_KEY, "")).decode()

    def ensure_service(self, ns: str, service: dict[str, Any]) -> None:
        path = core_path("services", ns, service["metadata"]["name"])
        existing = self.reader().child(SERVICES, ns, service["metadata"]["name"])
        if existing is None:
            self.kube.create(core_path("services", ns), service)
            return
        # Ports follow the spec; the API server defaults other fields, so compare only what we own.
        wanted = {k: service["spec"][k] for k in ("ports", "selector")}
        if any(existing["spec"].get(k) != v for k, v in wanted.items()):
            # a merge patch merges maps: a selector key added by hand must be removed by name
            extra = {k: None for k in existing["spec"].get("selector") or {} if k not in wanted["selector"]}
            self.kube.merge_patch(path, {"spec": {**wanted, "selector": {**extra, **wanted["selector"]}}})

    def ensure_network_policy(self, rm: Mapping[str, Any], plan: Plan) -> None:
        ns, name = rm["metadata"]["namespace"], rm["metadata"]["name"]
        path = network_policy_path(ns, network_policy_name(name))
        existing = self.reader().child(NETWORK_POLICIES, ns, network_policy_name(name))
        if not plan.spec.network_policy.enabled:
            if existing is not None:
                self.kube.delete(path)
            return
        policy = render_network_policy(rm, plan)
        if existing is None:
            self.kube.create(network_policy_path(ns), policy)
        elif existing.get("spec") != policy["spec"]:
            self.kube.merge_patch(path, {"spec": policy["spec"]})

    def apply_pods(
        self, ns: str, desired: list[dict[str, Any]], pods: list[dict[str, Any]]
    ) -> list[dict[str, Any]] | None:
        """Create and delete Pods one rollout step; the model's Pods afterwards when that follows
        from what the API server answered (nothing deleted, every create accepted), else None."""
        actions = pod_actions(desired, pods, datetime.now(UTC))
        for name, why in actions.delete:
            self.delete_pod(ns, name, why)
        after: list[dict[str, Any]] | None = None if actions.delete else list(pods)
        for pod in actions.create:
            created = self.kube.create(core_path("pods", ns), pod)
            if created is None:
                after = None  # it existed already: what it is, only a read can say
                continue
            metrics.POD_ACTIONS.labels(action="create").inc()
            log.info("created pod %s/%s on node %s", ns, pod["metadata"]["name"], pod["spec"]["nodeName"])
            if after is not None:
                after.append(plain(created))
        return after

    def delete_pod(self, ns: str, name: str, why: str) -> None:
        if self.kube.delete(core_path("pods", ns, name)):
            metrics.POD_ACTIONS.labels(action="delete").inc()
            log.info("deleted pod %s/%s (%s)", ns, name, why)

    def delete_unowned(self, rm: Mapping[str, Any], *, delete_children: bool) -> None:
        """What garbage collection cannot do when a RewardModel goes (the reason for the finalizer).

        Pods, Service, token Secret and NetworkPolicy carry owner references, so the garbage
        collector deletes them. GC follows owner references only: a WeightSync names its model in
        ``spec.rewardModelRef``, and one created without an owner reference (by kubectl, or an
        SDK older than this operator) would outlive the model, as would its manifest ConfigMap;
        those are deleted here. With ``delete_children`` (a control plane without a garbage
        collector) the owned children are deleted too.
        """
        ns, name = rm["metadata"]["namespace"], rm["metadata"]["name"]
        if delete_children:
            for plural in ("pods", "services", "secrets"):
                for child in self.kube.list(core_path(plural, ns), label_selector=selector(name)):
                    self.kube.delete(core_path(plural, ns, child["metadata"]["name"]))
            self.kube.delete(network_policy_path(ns, network_policy_name(name)))
        for cm in self.kube.list(core_path("configmaps", ns), label_selector=selector(name)):
            if delete_children or not owned_by(cm, rm):
                self.kube.delete(core_path("configmaps", ns, cm["metadata"]["name"]))
        for ws in self.kube.list(custom_path(ns, plural=WS_PLURAL)):  # the model's pushes go with it
            if (ws.get("spec") or {}).get("rewardModelRef") == name and (
                delete_children or not owned_by(ws, rm)
            ):
                self.kube.delete(custom_path(ns, ws["metadata"]["name"], WS_PLURAL))
