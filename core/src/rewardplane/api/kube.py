"""A small dict-in, dict-out Kubernetes REST client for the handlers.

Credentials come from the ``kubernetes`` package's config loaders (kubeconfig or in-cluster), the
requests go through httpx with explicit timeouts. Plain JSON dicts keep the handlers and the pure
planning code speaking the same shapes as the manifests, whatever the generated client's version.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from typing import Any

import httpx

from .names import core_path, custom_path

__all__ = ["Kube", "KubeError", "core_path", "custom_path"]

# Every call is short: a slow API server must not stall a reconcile forever.
REQUEST_TIMEOUT = httpx.Timeout(15.0, connect=5.0)
MERGE_PATCH = "application/merge-patch+json"


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path} failed with HTTP {status}: {message}")
        self.status = status


class Kube:
    """Thread-safe (one httpx.Client) access to the API server."""

    def __init__(self, configuration: Any) -> None:
        self._cfg = configuration
        verify: ssl.SSLContext | bool = False
        if configuration.verify_ssl:
            verify = (
                ssl.create_default_context(cafile=configuration.ssl_ca_cert)
                if configuration.ssl_ca_cert
                else True
            )
        if configuration.cert_file and isinstance(verify, ssl.SSLContext):
            verify.load_cert_chain(configuration.cert_file, configuration.key_file)
        elif configuration.cert_file:
            verify = ssl.create_default_context()
            verify.load_cert_chain(configuration.cert_file, configuration.key_file)
        self._http = httpx.Client(base_url=configuration.host, verify=verify, timeout=REQUEST_TIMEOUT)

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None) -> Kube:
        """Load credentials: an explicit kubeconfig, else in-cluster, else $KUBECONFIG / ~/.kube/config."""
        try:
            from kubernetes import client, config  # the loaders only; requests go through httpx
        except ImportError as exc:
            raise ImportError(
                "reaching the Kubernetes API (RewardModelHandle, cluster-mode pushes, the operator) needs the "
                "`kubernetes` package for its credential loaders: pip install 'rewardplane[cluster]' "
                f"({exc})"
            ) from exc

        cfg = client.Configuration()
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=cfg)
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg, persist_config=False)
        return cls(cfg)

    @property
    def configuration(self) -> Any:
        """The ``kubernetes`` package's Configuration these credentials came from (for the parts
        that use that package's own client: the operator's leader election)."""
        return self._cfg

    def connection_details(self) -> dict[str, Any]:
        """The same credentials for kopf's own client (``kopf.ConnectionInfo(**details)``)."""
        if self._cfg.refresh_api_key_hook is not None:
            self._cfg.refresh_api_key_hook(self._cfg)
        auth = self._authorization() or ""
        scheme, _, token = auth.partition(" ")
        return {
            "server": self._cfg.host,
            "ca_path": self._cfg.ssl_ca_cert or None,
            "insecure": not self._cfg.verify_ssl,
            "scheme": scheme or None,
            "token": token or None,
            "certificate_path": self._cfg.cert_file or None,
            "private_key_path": self._cfg.key_file or None,
        }

    def close(self) -> None:
        self._http.close()

    def _authorization(self) -> str | None:
        """The Authorization header value, e.g. "Bearer <token>" (its api_key name differs between
        versions of the kubernetes package; auth_settings() hides that)."""
        for setting in self._cfg.auth_settings().values():
            if setting.get("in") == "header" and setting.get("key", "").lower() == "authorization":
                return setting.get("value") or None
        return None

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        if self._cfg.refresh_api_key_hook is not None:
            self._cfg.refresh_api_key_hook(self._cfg)  # in-cluster tokens rotate
        headers = {"Accept": "application/json"}
        auth = self._authorization()
        if auth:
            headers["Authorization"] = auth
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        resp = self._http.request(method, path, json=json, params=params, headers=self._headers(content_type))
        if resp.status_code >= 400:
            try:
                message = resp.json().get("message", resp.text)
            except ValueError:
                message = resp.text
            raise KubeError(resp.status_code, method, path, message)
        return resp.json() if resp.content else {}

    def text(self, path: str, params: Mapping[str, str] | None = None) -> str:
        """A plain-text answer (a Pod's log: ``core_path("pods", ns, name) + "/log"``)."""
        headers = self._headers() | {"Accept": "text/plain, */*"}
        resp = self._http.request("GET", path, params=params, headers=headers)
        if resp.status_code >= 400:
            raise KubeError(resp.status_code, "GET", path, resp.text[:500])
        return resp.text

    def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self._call("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self, path: str, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        params = {
            k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v
        }
        return list(self._call("GET", path, params=params or None).get("items") or [])

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create; None when an object of that name exists already (someone else made it first)."""
        try:
            return self._call("POST", path, json=body)
        except KubeError as exc:
            if exc.status == 409:
                return None
            raise

    def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._call("PATCH", path, json=body, content_type=MERGE_PATCH)

    def delete(self, path: str) -> bool:
        """Delete; False when it was already gone."""
        try:
            self._call("DELETE", path)
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
