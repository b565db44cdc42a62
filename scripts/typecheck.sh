#!/usr/bin/env bash
# mypy over the four packages under their installed names (rlstages.configs, .engines, .tasks, .flows).
# mypy does not follow setuptools' editable finder, so a folder of symlinks gives it the `rlstages/` tree.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SHIM="$ROOT/.cache/typecheck"
mkdir -p "$SHIM/rlstages"
for d in configs engines tasks flows; do ln -sfn "$ROOT/$d" "$SHIM/rlstages/$d"; done
# a regular package at the top, and no namespace packages: a folder without __init__.py never shadows a module
: > "$SHIM/rlstages/__init__.py"
MYPY="${MYPY:-$ROOT/.venv/bin/mypy}"
cd "$ROOT"
MYPYPATH="$SHIM" exec "$MYPY" --config-file pyproject.toml -p rlstages.configs -p rlstages.engines -p rlstages.tasks -p rlstages.flows --no-namespace-packages "$@"
