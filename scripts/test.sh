#!/usr/bin/env bash
# The test command (README; .ci/run calls exactly this): install what is missing, run the static
# checks, then the unit and integration suites. GPU tests skip where no GPU exists. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Static checks first: lint, format, the layers' import contract, types (docs/architecture.md).
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
.venv/bin/mypy
export PATH="${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}/bin:$PATH"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
