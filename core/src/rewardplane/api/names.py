"""Names of the custom resources and of what the operator makes for them: API group and version,
kinds, plurals, labels, annotations, and the names of a RewardModel's children.

The operator writes these, the SDK and the CLI read them: one definition keeps both sides agreeing.
"""

from __future__ import annotations

GROUP = "rewardplane.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

RM_KIND = "RewardModel"
RM_PLURAL = "rewardmodels"
WS_KIND = "WeightSync"
WS_PLURAL = "weightsyncs"

# Labels and annotations on a RewardModel's children.
LABEL_MODEL = f"{GROUP}/model"
LABEL_REPLICA = f"{GROUP}/replica"
# On a trainer's Pod: the RewardModel it pushes weights to (its NetworkPolicy lets such Pods in).
LABEL_TRAINER_OF = f"{GROUP}/trainer-of"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
SERVER_COMPONENT = "reward-server"  # LABEL_COMPONENT of a RewardModel's replica Pods
ANNOTATION_SPEC_HASH = f"{GROUP}/spec-hash"
ANNOTATION_RANK_OFFSET = f"{GROUP}/rank-offset"
ANNOTATION_GROUP_PORT = f"{GROUP}/group-port"
RESERVATIONS_ANNOTATION = f"{GROUP}/gpu-reservations"
FINALIZER = f"{GROUP}/cleanup"

# The control-plane token lives in a Secret, under this key.
TOKEN_KEY = "token"


def token_secret_name(model_name: str) -> str:
    return f"{model_name}-control-token"


def service_name(model_name: str) -> str:
    return model_name


def pod_name(model_name: str, index: int) -> str:
    """Stable replica names: a replica keeps its name (and its persisted weights) across restarts."""
    return f"{model_name}-{index}"


def server_labels(model_name: str) -> dict[str, str]:
    """The labels that select a RewardModel's replica Pods (its Service's selector)."""
    return {LABEL_MODEL: model_name, LABEL_COMPONENT: SERVER_COMPONENT}


def server_selector(model_name: str) -> str:
    """:func:`server_labels` as a label selector string: ``status.selector``, which the scale
    subresource hands to an HorizontalPodAutoscaler to find the Pods it measures."""
    return ",".join(f"{k}={v}" for k, v in server_labels(model_name).items())


def custom_path(namespace: str | None = None, name: str | None = None, plural: str = RM_PLURAL) -> str:
    """REST path of a rewardplane custom resource (collection when ``name`` is None)."""
    path = f"/apis/{GROUP}/{VERSION}" + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    return path + (f"/{name}" if name else "")


def core_path(kind_plural: str, namespace: str | None = None, name: str | None = None) -> str:
    """REST path of a core/v1 object (collection when ``name`` is None)."""
    path = "/api/v1" + (f"/namespaces/{namespace}" if namespace else "") + f"/{kind_plural}"
    return path + (f"/{name}" if name else "")
