#!/usr/bin/env bash
# Run the `gpu` tests (tests/gpu, `pytest -m gpu`) on a machine with a CUDA build of torch and no network.
#
#   scripts/gpu_check.sh --download   # on a machine WITH network: fill $WHEELS (.whl/) with the wheels the gpu
#                                     # tests need (torch, triton and nvidia-* left out: the GPU machine has them)
#   scripts/gpu_check.sh              # on the GPU machine: a venv over its torch, the wheels installed offline,
#                                     # each test file in its own pytest process (each sets up its own process
#                                     # group), output and device name written to $RESULTS
#
# Environment: PYTHON (default python3, the interpreter whose torch has CUDA), WHEELS (default .whl),
# RESULTS (default gpu_check_results.txt), VENV (default .venv-gpu), TIMEOUT per file in seconds (600).
# The gpu tests import only torch, transformers, tensordict, safetensors, pydantic, pyyaml (and deepspeed /
# megatron-core for their files): no Ray, Prefect or MLflow. A file whose package is missing is skipped with
# the reason (pytest's skip), not failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl}"
RESULTS="${RESULTS:-$ROOT/gpu_check_results.txt}"
VENV="${VENV:-$ROOT/.venv-gpu}"
TIMEOUT="${TIMEOUT:-600}"
PACKAGES=(transformers tokenizers safetensors tensordict "pydantic>=2" pyyaml pytest deepspeed megatron-core)

if [[ "${1:-}" == "--download" ]]; then
  mkdir -p "$WHEELS"
  "$PYTHON" -m pip download --only-binary=:all: -d "$WHEELS" "${PACKAGES[@]}" || exit 1
  rm -f "$WHEELS"/torch-*.whl "$WHEELS"/triton-*.whl "$WHEELS"/nvidia_*.whl
  echo "wheels in $WHEELS; copy the repository with it to the GPU machine and run scripts/gpu_check.sh there"
  exit 0
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: $PYTHON has no CUDA torch or sees no GPU (torch.cuda.is_available() is False)" >&2
  exit 2
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv --system-site-packages "$VENV" || exit 2  # its torch (CUDA build) stays visible
fi
if [[ -d "$WHEELS" ]]; then
  "$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" "${PACKAGES[@]}" \
    || echo "gpu_check: some wheels did not install; files that need them will be skipped" >&2
else
  echo "gpu_check: no wheel folder $WHEELS; using what $PYTHON already has" >&2
fi

PKGROOT="$(mktemp -d)"  # `rlstages.*` resolves to this checkout, without installing it (or its Ray/Prefect deps)
ln -s "$ROOT" "$PKGROOT/rlstages"
export PYTHONPATH="$PKGROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT" || exit 2

{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  "$VENV/bin/python" - <<'EOF'
import torch
print(f"device: {torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()}), torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
for name in ("transformers", "tensordict", "deepspeed", "megatron.core", "flash_attn"):
    try:
        module = __import__(name, fromlist=["__version__"])
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001 - report what is missing, go on
        print(f"{name}: not importable ({type(exc).__name__})")
EOF
} > "$RESULTS" 2>&1

status=0
for file in tests/gpu/test_gpu_*.py; do
  echo "== $file" | tee -a "$RESULTS"
  timeout "$TIMEOUT" "$VENV/bin/python" -m pytest -p no:cacheprovider -m gpu -rA -q "$file" >> "$RESULTS" 2>&1
  rc=$?
  echo "== $file exit $rc" | tee -a "$RESULTS"
  [[ $rc -ne 0 && $rc -ne 5 ]] && status=1  # 5: nothing collected
done
rm -rf "$PKGROOT"
echo "gpu_check: results in $RESULTS (exit $status)"
exit $status
