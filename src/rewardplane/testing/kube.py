"""A stand-in for the API server in the operator's unit tests: ``MemoryKube`` has the methods of
``rewardplane.api.kube.Kube`` the operator calls (get, list by label, create, JSON merge patch,
delete) over a dict of objects by REST path.

It models no validation, defaulting, resource versions or watches: tests of those run against
the real kube-apiserver (the integration suite's fixtures).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from rewardplane.api.kube import KubeError


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class MemoryKube:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self._serial = 0

    def put(self, collection: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Store ``body`` under ``collection``/name as it is (test setup)."""
        obj = copy.deepcopy(dict(body))
        meta = obj.setdefault("metadata", {})
        meta.setdefault("generation", 1)
        if "/namespaces/" in collection:
            meta.setdefault("namespace", collection.split("/namespaces/")[1].split("/")[0])
        self.objects[f"{collection}/{obj['metadata']['name']}"] = obj
        return obj

    def get(self, path: str) -> dict[str, Any] | None:
        obj = self.objects.get(path)
        return copy.deepcopy(obj) if obj is not None else None

    def list(
        self, path: str, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        """Objects in the collection ``path``; without a namespace in it, in every namespace.
        Label selectors: ``key=value`` and ``key`` (exists); field selectors: ``a.b=value``; each
        comma-separated."""
        terms = [t.split("=", 1) for t in label_selector.split(",")] if label_selector else []
        fields = [t.split("=", 1) for t in field_selector.split(",")] if field_selector else []

        def field(obj: Any, dotted: str) -> Any:
            for part in dotted.split("."):
                obj = obj.get(part) if isinstance(obj, dict) else None
            return obj

        base, _, plural = path.rpartition("/")
        out = []
        for key, obj in self.objects.items():
            parent, _, _ = key.rpartition("/")
            in_collection = parent == path or (
                "/namespaces/" not in path
                and parent.startswith(base + "/namespaces/")
                and parent.endswith("/" + plural)
                and parent.count("/") == path.count("/") + 2
            )
            labels = obj.get("metadata", {}).get("labels") or {}
            matches = all((t[0] in labels) if len(t) == 1 else labels.get(t[0]) == t[1] for t in terms)
            matches = matches and all(str(field(obj, f[0])) == f[1] for f in fields)
            if in_collection and matches:
                out.append(copy.deepcopy(obj))
        return out

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        meta = body["metadata"]
        if "name" not in meta:  # generateName, as the API server completes it
            self._serial += 1
            body = {**body, "metadata": {**meta, "name": f"{meta.get('generateName', '')}{self._serial:05d}"}}
        key = f"{path}/{body['metadata']['name']}"
        if key in self.objects:
            return None  # already exists, as Kube.create answers a 409
        return self.put(path, body)

    def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        key = path.removesuffix("/status")
        if key not in self.objects:
            raise KubeError(404, "PATCH", path, "not found")
        self.patches.append((path, copy.deepcopy(dict(body))))
        self.objects[key] = merge_patch(self.objects[key], body)
        return copy.deepcopy(self.objects[key])

    def delete(self, path: str) -> bool:
        return self.objects.pop(path, None) is not None
