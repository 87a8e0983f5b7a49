#!/usr/bin/env bash
# The test command (README; .ci/run calls exactly this): install what is missing, build the images
# (as root: the real-node end-to-end suite runs them), run the static checks, then every suite:
# unit, integration, e2e (the real single-node cluster). GPU tests skip where no GPU exists.
# Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [[ "$(id -u)" -eq 0 ]]; then
  bash scripts/build-images.sh
else
  echo "[test] not root: the images are not built and the real-node e2e suite will be skipped" >&2
fi
# Static checks first: lint, format, the layers' import contract, types (docs/architecture.md).
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
.venv/bin/mypy
.venv/bin/python scripts/dashboard.py --check  # the chart's Grafana dashboard, generated
export PATH="${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}/bin:$PATH"
# Two workers (PYTEST_WORKERS), one file each at a time: most tests wait on server processes and
# the real node, so two run side by side on two cores; a file's tests stay together and in order
# (the e2e suite is one session on one cluster). The slowest tests are listed at the end.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" --dist loadfile \
  --durations=40 "$@"
