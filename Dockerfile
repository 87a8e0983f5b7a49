# The rewardplane operator image: `docker build -t ghcr.io/rewardplane/operator:0.1.0 .`
# Only the operator's distributions (rewardplane-core, rewardplane-operator): no torch, no server code.
FROM python:3.11-slim AS build
WORKDIR /src
COPY core ./core
COPY operator ./operator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./core ./operator

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# A fixed non-root user, matching the chart's securityContext (runAsUser 65532).
USER 65532:65532
EXPOSE 9090 8081
ENTRYPOINT ["python", "-m", "rewardplane.operator"]
