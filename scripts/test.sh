#!/usr/bin/env bash
# One command from a fresh clone to a test run: sets up .venv (with pytest), then runs the suite
# on the CPU with 8 simulated devices. Extra arguments go to pytest, e.g. bash scripts/test.sh -k model
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh" requirements-dev.txt
cd "$root"
export JAX_PLATFORMS=cpu
# Two workers: the CI machine has 2 cores, and much of the time is single-threaded compiling.
# A per-test limit: a deadlocked subprocess fails its test instead of hanging CI.
exec "$root/.venv/bin/python" -m pytest -q -n "${TEST_WORKERS:-2}" --timeout=600 "$@" tests
