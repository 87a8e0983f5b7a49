"""Schemathesis hooks for the conformance run (``test_schemathesis.py``).

``/runtime_version?wait_for_version=N&timeout_s=T`` is a long-poll that rightly holds the request
up to ``T`` (≤ 300) seconds while version N is not served; generated cases would spend the run
waiting. The hook keeps ``T`` small; everything else about the generated case stays as generated."""

from __future__ import annotations

from typing import Any

import schemathesis


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    query = case.query
    if case.path == "/runtime_version" and isinstance(query, dict):
        timeout = query.get("timeout_s")
        if not isinstance(timeout, int | float) or timeout > 0.2:
            query["timeout_s"] = 0.2
    return case
