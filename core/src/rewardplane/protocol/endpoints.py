"""Endpoint paths, headers and the environment variables that server and clients share."""

from __future__ import annotations

from . import settings


class Endpoints:
    HEALTH = "/health"
    READY = "/ready"  # the readiness probe: 200 only while the replica takes traffic (admission)
    SCORE = "/score"
    CLASSIFY = "/classify"
    POOLING = "/pooling"
    RUNTIME_VERSION = "/runtime_version"
    WORLD_SIZE = "/get_world_size"
    METRICS = "/metrics"
    MODEL_INFO = "/model_info"
    # drop-in routes of other servers (compat): served at the root and under V1_PREFIX
    EMBEDDINGS = "/embeddings"
    MODELS = "/models"
    TOKENIZE = "/tokenize"
    DETOKENIZE = "/detokenize"
    GET_REWARD = "/get_reward"  # OpenRLHF's remote reward model
    CHAT_COMPLETIONS = "/chat/completions"  # OpenAI's; generative models (task generate) only
    V1_PREFIX = "/v1"
    # control plane (bearer token required)
    INIT_COMMUNICATOR = "/init_communicator"
    UPDATE_PARAM_BATCH = "/update_param_batch"
    CLOSE_COMMUNICATOR = "/close_communicator"
    NUM_BACKGROUND_TASKS = "/get_num_background_tasks"
    PARAM_MANIFEST = "/param_manifest"
    RESTORE_WEIGHTS = "/restore_weights"
    PARAM_CHECKSUMS = "/param_checksums"
    SEND_WEIGHTS = "/send_weights"
    SLEEP = "/sleep"
    WAKE = "/wake"
    ADMISSION = "/admission"


CONTROL_PLANE_PATHS = frozenset(
    {
        Endpoints.INIT_COMMUNICATOR,
        Endpoints.UPDATE_PARAM_BATCH,
        Endpoints.CLOSE_COMMUNICATOR,
        Endpoints.NUM_BACKGROUND_TASKS,
        Endpoints.PARAM_MANIFEST,
        Endpoints.RESTORE_WEIGHTS,
        Endpoints.PARAM_CHECKSUMS,
        Endpoints.SEND_WEIGHTS,
        Endpoints.SLEEP,
        Endpoints.WAKE,
        Endpoints.ADMISSION,
    }
)

VERSION_HEADER = "X-Rewardplane-Weights-Version"
# The token's variables (``settings``): their names, for a Pod's env and for messages.
TOKEN_ENV = settings.TOKEN.name
TOKEN_FILE_ENV = settings.TOKEN_FILE.name
