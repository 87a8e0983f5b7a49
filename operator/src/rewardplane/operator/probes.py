"""Ask each ready reward server which weights it serves (``/health`` and ``/runtime_version``)."""

from __future__ import annotations

import httpx

from rewardplane.protocol import Endpoints, HealthResponse, RuntimeVersionResponse

from .status import ProbeResult

# Short: a hung server must not hold up the status of every other replica.
PROBE_TIMEOUT = httpx.Timeout(2.0, connect=1.0)


def probe_server(client: httpx.Client, base_url: str) -> ProbeResult:
    """One server's weights version and state; ``error`` says why it could not be read."""
    try:
        health = client.get(base_url + Endpoints.HEALTH, timeout=PROBE_TIMEOUT)
        health.raise_for_status()
        HealthResponse.model_validate(health.json())
        runtime = client.get(base_url + Endpoints.RUNTIME_VERSION, timeout=PROBE_TIMEOUT)
        runtime.raise_for_status()
        version = RuntimeVersionResponse.model_validate(runtime.json())
    except (httpx.HTTPError, ValueError) as exc:
        return ProbeResult(error=f"{base_url}: {type(exc).__name__}: {exc}")
    return ProbeResult(version=version.version, state=version.state)
