# The rewardplane operator image (rewardplane-core + rewardplane-operator; no torch, no server).
#
#   docker build -t ghcr.io/rewardplane/operator:0.1.0 .            # online: python:3.11-slim, PyPI
#   bash scripts/build-images.sh                                     # offline: local base + wheelhouse
#
# BASE_IMAGE needs python3 (3.11+) with venv support; PIP_INSTALL_ARGS lets an offline build point
# pip at the wheelhouse that scripts/build-images.sh fills on the host (.wheelhouse/ in the context).
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG PIP_INSTALL_ARGS="-c /wheelhouse/constraints.txt"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# The glob keeps the build working without a wheelhouse (online: pip uses PyPI instead).
COPY images/constraints.txt .wheelhouse* /wheelhouse/
# Third-party dependencies first, from the distributions' metadata alone: a change to the code
# then rebuilds only the small layer of the project's own packages.
COPY images/deps.py /src/deps.py
COPY core/pyproject.toml /src/core/pyproject.toml
COPY operator/pyproject.toml /src/operator/pyproject.toml
RUN python3 -m venv /opt/venv \
 && python3 /src/deps.py /src/core/pyproject.toml:kube /src/operator/pyproject.toml >/src/deps.txt \
 && /opt/venv/bin/pip install $PIP_INSTALL_ARGS -r /src/deps.txt \
 && /opt/venv/bin/pip uninstall -q -y pip setuptools wheel
COPY core /src/core
COPY operator /src/operator
RUN python3 -m venv /opt/pip \
 && /opt/pip/bin/pip install $PIP_INSTALL_ARGS --no-deps --target /opt/rewardplane /src/core /src/operator

FROM ${BASE_IMAGE} AS operator
# tini as PID 1 forwards SIGTERM to the operator and reaps children. The local base has it;
# on another base it comes from the distribution (the only step that may need the network).
# The user needs a passwd entry: kopf (getpass.getuser) looks the user name up.
RUN command -v tini >/dev/null || { apt-get update -q && apt-get install -y -q --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*; } \
 && groupadd --system --gid 65532 rewardplane \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin rewardplane
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/rewardplane /opt/rewardplane
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/opt/rewardplane PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# A fixed non-root user, matching the chart's securityContext (runAsUser 65532).
USER 65532:65532
EXPOSE 9090 8081
ENTRYPOINT ["tini", "--", "python3", "-m", "rewardplane.operator"]
