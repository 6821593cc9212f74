#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then lints and runs the CPU test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k reference).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
# Exit code 5 means pytest collected no tests: a filter matched nothing, not a failure
# of the code, but CI must not pass silently on an empty run either.
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit code 5)" >&2
  exit 1
fi
exit "$rc"
