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
# A test whose worker process died (twice in ~6 full runs, in test_resume's FP8 run and
# test_profile_summary's profiled run, each passing alone; cause not found) runs once more in a
# new worker (pytest-rerunfailures; the crash's dump, if any, stays in the log); --only-rerun's
# pattern matches no assertion or exception, so a test that fails is never run again.
exec "$root/.venv/bin/python" -m pytest -q -n "${TEST_WORKERS:-2}" --timeout=600 \
  --reruns=1 --only-rerun='^a crashed worker only$' "$@" tests
