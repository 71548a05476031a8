#!/usr/bin/env bash
# One command from a fresh clone to a trained model: sets up .venv, then trains.
# With no arguments it trains the embedded default (configs/default.py) on the CPU.
# Any arguments are passed to jax_pretrain.main, e.g.
#   bash scripts/train.sh --config=configs/xlarge.py --workdir=runs/xl
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh" "${REQUIREMENTS:-requirements.txt}"
cd "$root"
args=("$@")
[[ " $* " == *" --workdir="* ]] || args+=(--workdir=runs/default)
exec "$root/.venv/bin/python" -m jax_pretrain.main "${args[@]}"
