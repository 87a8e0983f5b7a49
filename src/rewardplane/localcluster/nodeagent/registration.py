"""The agent's Node in the API: registered (created, or its labels patched), its status
heartbeated, registered again when someone deletes it, and marked not Ready when the agent stops.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from rewardplane.localcluster.nodeagent.config import API_TIMEOUT_S, AgentConfig
from rewardplane.localcluster.nodeagent.node_object import node_object, node_status

log = logging.getLogger("rewardplane.nodeagent")

MERGE_PATCH = "application/strategic-merge-patch+json"


class NodeRegistration:
    def __init__(self, core: Any, cfg: AgentConfig, stop_event: threading.Event) -> None:
        self.core = core  # kubernetes.client.CoreV1Api
        self.cfg = cfg
        self.stop_event = stop_event

    def register_until_ok(self) -> None:
        """Register, retrying with a growing delay (at most 10 s) until it works or the agent stops."""
        delay = 0.5
        while not self.stop_event.is_set():
            try:
                self.register()
                return
            except Exception as exc:
                log.warning(
                    "registering node %s failed (retrying in %.0fs): %s", self.cfg.node_name, delay, exc
                )
                self.stop_event.wait(delay)
                delay = min(delay * 2, 10)

    def register(self) -> None:
        body = node_object(self.cfg)
        try:
            # the client serializes a plain dict as it would a V1Node; its stubs only name V1Node
            self.core.create_node(body, _request_timeout=API_TIMEOUT_S)
        except Exception as exc:
            if getattr(exc, "status", None) != 409:
                raise
            self.core.patch_node(
                self.cfg.node_name,
                {"metadata": {"labels": body["metadata"]["labels"]}},
                _content_type=MERGE_PATCH,
                _request_timeout=API_TIMEOUT_S,
            )
        self.patch_status()

    def patch_status(self, **kw: Any) -> None:
        """Write the Node's status now (``kw``: ready, reason, message of its Ready condition)."""
        self.core.patch_node_status(
            self.cfg.node_name,
            {"status": node_status(self.cfg, time.time(), **kw)},
            _content_type=MERGE_PATCH,
            _request_timeout=API_TIMEOUT_S,
        )

    def heartbeat_loop(self) -> None:
        """Every ``heartbeat_s`` until the agent stops: the status again, or a new registration."""
        while not self.stop_event.wait(self.cfg.heartbeat_s):
            try:
                self.patch_status()
            except Exception as exc:
                if getattr(exc, "status", None) == 404:  # someone deleted the Node: register again
                    with contextlib.suppress(Exception):
                        self.register()
                else:
                    log.warning("node heartbeat failed: %s", exc)

    def mark_stopped(self) -> None:
        with contextlib.suppress(Exception):
            self.patch_status(
                ready=False, reason="NodeAgentStopped", message="the rewardplane node agent stopped"
            )
