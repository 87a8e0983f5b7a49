#!/usr/bin/env bash
# Downloads (on the CPU machine) the wheels the GPU machine lacks for rewardplane's server and SDK
# into .whl/proj (ignored by git), for `scripts/gpu-run.sh` there. The GPU machine has Python 3.12,
# torch, transformers, peft, httpx and anyio; it lacks pydantic, fastapi, uvicorn, tenacity, ...
# Carry the folder with the device tool: carry [".whl/proj"].
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qs '^/.whl/$' .git/info/exclude || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
DEST=.whl/proj
mkdir -p "$DEST"
PY=${PYTHON:-python3}
WHEELS=(
  "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5"
  "fastapi==0.165.0" "starlette==1.10.0" "annotated-doc==0.0.7" "opentelemetry-api==1.45.2"
  "importlib-metadata" "zipp" "uvicorn==0.54.0" "h11==0.16.0" "click==8.5.1" "tenacity==9.2.1"
  "prometheus-client==0.26.0" "httptools==0.9.0" "pytest" "pluggy" "iniconfig" "packaging"
)
for w in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "$w"
done
du -sh "$DEST"
