#!/usr/bin/env bash
# Install every distribution into $WEFT_VENV (default .venv) and run the test suite.
# Extra arguments go to pytest. pytest's "no tests collected" (exit 5) counts as success.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${WEFT_VENV:-$root/.venv}
WEFT_VENV=$venv bash "$root/scripts/install.sh" "$root/tests/example_plugin" "pytest>=8" "accelerate>=1.0" "openai>=1.40" "httpx>=0.27"
cd "$root"
set +e
"$venv/bin/python" -m pytest -q "$@"
status=$?
set -e
[ "$status" -eq 5 ] && { echo "pytest collected no tests"; status=0; }
exit "$status"
