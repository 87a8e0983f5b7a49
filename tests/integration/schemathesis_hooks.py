"""Schemathesis hooks for the conformance run (``test_schemathesis.py``).

``/runtime_version?wait_for_version=N&timeout_s=T`` is a long-poll that rightly holds the request
up to ``T`` (≤ 300) seconds while version N is not served; generated cases would spend the run
waiting. The hook keeps ``T`` small; everything else about the generated case stays as generated.

``POST /sleep`` puts the server to sleep, after which scoring rightly answers 503 (documented) — but
the run asserts that no case meets a 5xx. A server put to sleep by a case is woken right after it,
so every other endpoint is fuzzed against a serving replica (``test_sleep.py`` covers the asleep
answers)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx
import schemathesis


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    query = case.query
    if case.path == "/runtime_version" and isinstance(query, dict):
        timeout = query.get("timeout_s")
        if not isinstance(timeout, int | float) or timeout > 0.2:
            query["timeout_s"] = 0.2
    return case


@schemathesis.hook
def after_call(context: Any, case: Any, response: Any) -> None:
    if case.path == "/sleep" and response.status_code == 200:
        parts = urlsplit(str(response.request.url))
        auth = response.request.headers.get("Authorization", "")
        woke = httpx.post(
            f"{parts.scheme}://{parts.netloc}/wake", json={}, headers={"Authorization": auth}, timeout=60
        )
        woke.raise_for_status()
