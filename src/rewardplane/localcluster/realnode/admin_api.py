"""The node's API server as its admin sees it, over the standard library (no client needed while
the node comes up or goes down): is the Node Ready, may pods be made, delete every pod.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import urllib.request
from typing import Any

from rewardplane.localcluster.realnode import pki
from rewardplane.localcluster.realnode.layout import NODE_NAME, Layout

DELETE_GRACE_S = 5  # each pod's grace period when ``down`` deletes it


class AdminApi:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def call(
        self, path: str, *, method: str = "GET", body: dict[str, object] | None = None
    ) -> dict[str, Any]:
        """One request as the admin; the parsed JSON answer."""
        info = json.loads(self.layout.cluster_json.read_text())
        req = urllib.request.Request(
            info["server_url"] + path,
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
        )
        req.add_header("Authorization", f"Bearer {pki.token(self.layout, 'admin')}")
        req.add_header("Content-Type", "application/json")
        ctx = ssl.create_default_context(cafile=str(self.layout.pki / "ca.crt"))
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return json.loads(resp.read() or b"{}")

    def node_ready(self) -> bool:
        try:
            node = self.call(f"/api/v1/nodes/{NODE_NAME}")
        except Exception:
            return False
        conds = (node.get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)

    def default_sa_ready(self) -> bool:
        """Pods are refused until the controller-manager made the namespace's default
        ServiceAccount and its token Secret (1.20 mounts the Secret)."""
        try:
            sa = self.call("/api/v1/namespaces/default/serviceaccounts/default")
        except Exception:
            return False
        return bool(sa.get("secrets"))

    def delete_all_pods(self) -> None:
        """Ask for every pod's deletion (best effort per pod); the kubelet stops them."""
        for pod in self.call("/api/v1/pods").get("items") or []:
            meta = pod["metadata"]
            with contextlib.suppress(Exception):
                self.call(
                    f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                    method="DELETE",
                    body={"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": DELETE_GRACE_S},
                )
