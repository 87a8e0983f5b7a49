#!/usr/bin/env bash
# The test command (README; .ci/run calls exactly this): install what is missing, lint, run the
# unit and integration suites. GPU tests skip where no GPU exists. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
export PATH="${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}/bin:$PATH"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
