#!/usr/bin/env bash
# Creates (or reuses) .venv with a Python >= 3.12 and installs the requirements.
# Usage: bash scripts/setup.sh [requirements file]   (default: requirements.txt)
# Set JAX_PRETRAIN_PYTHON to force an interpreter; set VENV to put the venv elsewhere.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
req=${1:-requirements.txt}
venv=${VENV:-$root/.venv}

find_python() {
  local candidates=("${JAX_PRETRAIN_PYTHON:-}" python3.13 python3.12 python3)
  # pyenv installs that are not on the active PATH (the shim may refuse them).
  for d in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin; do candidates+=("$d/python3"); done
  for py in "${candidates[@]}"; do
    [[ -n $py ]] || continue
    if "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
      echo "$py"; return 0
    fi
  done
  echo "error: jax >= 0.11 needs Python >= 3.12 and none was found (tried: ${candidates[*]})." >&2
  echo "Install Python 3.12 or set JAX_PRETRAIN_PYTHON=/path/to/python3.12." >&2
  return 1
}

if [[ ! -x $venv/bin/python ]]; then
  py=$(find_python)
  echo "setup: creating $venv with $py ($("$py" --version))"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi

# Reinstall only when a requirements file or pyproject.toml changed since the last install. The
# package itself is installed in editable mode: `import jax_pretrain` works from any directory.
stamp=$venv/.requirements.$(basename "$req").sha
want=$(cd "$root" && cat requirements*.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  echo "setup: installing $req into $venv"
  (cd "$root" && "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$req")
  # (setuptools warns about editable installs at length; shown only if the install fails)
  if ! out=$(cd "$root" && "$venv/bin/python" -m pip install -q --disable-pip-version-check \
      --no-deps -e . 2>&1); then
    echo "$out" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
