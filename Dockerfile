# The rewardplane operator image: `docker build -t ghcr.io/rewardplane/operator:0.1.0 .`
# Only the operator's dependencies (extra `operator`): no torch, no server code at run time.
FROM python:3.11-slim AS build
WORKDIR /src
# pyproject maps the top-level folders onto rewardplane.* subpackages, so all of them are needed
# to build the wheel (they are small; the heavy server deps are extras not installed here).
COPY pyproject.toml README.md ./
COPY src ./src
COPY sdk ./sdk
COPY operator ./operator
COPY images/reward-server/server ./images/reward-server/server
COPY localcluster ./localcluster
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/rewardplane-*.whl)[operator]" && rm -rf /wheels
# A fixed non-root user, matching the chart's securityContext (runAsUser 65532).
USER 65532:65532
EXPOSE 9090 8081
ENTRYPOINT ["python", "-m", "rewardplane.operator"]
