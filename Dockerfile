# The rewardplane operator image (rewardplane-core + rewardplane-operator; no torch, no server).
#
#   docker build -t ghcr.io/rewardplane/operator:0.1.0 .            # online: python:3.11-slim, PyPI
#   bash scripts/build-images.sh                                     # offline: local base + wheelhouse
#
# BASE_IMAGE needs python3 (3.10+) with venv support; PIP_INSTALL_ARGS lets an offline build point
# pip at the wheelhouse that scripts/build-images.sh fills on the host (.wheelhouse/ in the context).
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG PIP_INSTALL_ARGS="-c /wheelhouse/constraints.txt"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# The glob keeps the build working without a wheelhouse (online: pip uses PyPI instead).
COPY images/constraints.txt .wheelhouse* /wheelhouse/
COPY core /src/core
COPY operator /src/operator
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install $PIP_INSTALL_ARGS /src/core /src/operator \
 && /opt/venv/bin/pip uninstall -q -y pip setuptools wheel

FROM ${BASE_IMAGE} AS operator
# tini as PID 1 forwards SIGTERM to the operator and reaps children. The local base has it;
# on another base it comes from the distribution (the only step that may need the network).
# The user needs a passwd entry: kopf (getpass.getuser) and torch look the user name up.
RUN command -v tini >/dev/null || { apt-get update -q && apt-get install -y -q --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*; } \
 && groupadd --system --gid 65532 rewardplane \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin rewardplane
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# A fixed non-root user, matching the chart's securityContext (runAsUser 65532).
USER 65532:65532
EXPOSE 9090 8081
ENTRYPOINT ["tini", "--", "python3", "-m", "rewardplane.operator"]
