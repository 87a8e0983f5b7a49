"""Which objects belong to one RewardModel *object* (its UID), not merely to its name.

A RewardModel deleted and created again under the same name is a new model: the old one's Pods
(still terminating), WeightSyncs (until garbage collection deletes them) and status must not
lend it their weights version. Pure functions over the objects' metadata.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from rewardplane.api.heartbeat import parse_time
from rewardplane.api.names import RM_KIND


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def model_owners(obj: Mapping[str, Any]) -> list[str]:
    """The UIDs of the RewardModels ``obj`` names as owners."""
    return [
        str(ref.get("uid"))
        for ref in _meta(obj).get("ownerReferences") or []
        if ref.get("kind") == RM_KIND and ref.get("uid")
    ]


def _created(obj: Mapping[str, Any]) -> datetime | None:
    return parse_time(_meta(obj).get("creationTimestamp"))


def belongs_to(obj: Mapping[str, Any], rm: Mapping[str, Any]) -> bool:
    """Whether ``obj`` (a Pod, a WeightSync) is of this RewardModel object.

    An owner reference decides: owned by this UID, yes; owned by another RewardModel (an earlier
    object of the same name), no. An object without one (a WeightSync made by kubectl) belongs to
    the model it names when it was created no earlier than the model: one created before it was
    about an object that is gone (timestamps have seconds; a same-second one counts as this
    model's, the likelier reading).
    """
    uid = _meta(rm).get("uid")
    owners = model_owners(obj)
    if owners:
        return uid in owners
    mine, model_created = _created(obj), _created(rm)
    return mine is None or model_created is None or mine >= model_created


def of_model(objs: Iterable[Mapping[str, Any]], rm: Mapping[str, Any]) -> list[Any]:
    """The objects of ``objs`` that belong to this RewardModel object."""
    return [o for o in objs if belongs_to(o, rm)]
