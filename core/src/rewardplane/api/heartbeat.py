"""The operator's heartbeat on each RewardModel: when it last confirmed the status, and how often it
does. A reader (``rewardplane status``, the SDK) tells from these two fields whether the status can
be trusted: with no operator running, a status stays as the last operator wrote it.

``status.confirmedAt`` (RFC 3339, the CONFIRMED column shows its age) is refreshed by a reconcile
once it is ``status.confirmIntervalSeconds`` old (the operator's resync interval), so a model costs
one status write per interval at most; it is unconfirmed once older than :func:`allowed_age`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

CONFIRMED_AT = "confirmedAt"
CONFIRM_INTERVAL = "confirmIntervalSeconds"
# A resync is late by whatever the queue of reconciles holds: room for it besides two missed ticks.
SLACK_S = 15.0


def parse_time(stamp: object) -> datetime | None:
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None


def rfc3339(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def confirmation(previous: Mapping[str, Any], now: datetime, interval_s: float) -> dict[str, Any]:
    """The heartbeat fields of the next status: the previous time while it is younger than the
    interval (an unchanged status then costs no write), else ``now``."""
    last = parse_time(previous.get(CONFIRMED_AT))
    young = last is not None and 0 <= (now - last).total_seconds() < interval_s
    return {
        CONFIRMED_AT: previous[CONFIRMED_AT] if young else rfc3339(now),
        CONFIRM_INTERVAL: int(round(interval_s)),
    }


def allowed_age(status: Mapping[str, Any]) -> float:
    interval = status.get(CONFIRM_INTERVAL)
    interval_s = float(interval) if isinstance(interval, int | float) and interval > 0 else 30.0
    return 3 * interval_s + SLACK_S


def unconfirmed(status: Mapping[str, Any] | None, now: datetime) -> str | None:
    """Why the status cannot be trusted (in words, with what to check), or None when an operator
    confirmed it recently."""
    status = status or {}
    last = parse_time(status.get(CONFIRMED_AT))
    if last is None:
        return (
            "no operator has confirmed this status (status.confirmedAt is missing): is the rewardplane "
            "operator running? (kubectl get deploy -A -l app.kubernetes.io/component=operator)"
        )
    age = (now - last).total_seconds()
    if age <= allowed_age(status):
        return None
    return (
        f"no operator has confirmed this status for {age:.0f} s (last at {status[CONFIRMED_AT]}; it is "
        f"confirmed every {status.get(CONFIRM_INTERVAL, 30)} s): it may be out of date; is the "
        "rewardplane operator running? (kubectl get deploy -A -l app.kubernetes.io/component=operator)"
    )
