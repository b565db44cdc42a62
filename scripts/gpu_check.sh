#!/usr/bin/env bash
# Run the `gpu` tests (tests/gpu, `pytest -m gpu`) on a machine with a CUDA build of torch and no network.
#
#   scripts/gpu_check.sh --download   # on a machine WITH network: fill $WHEELS (.whl/) with the wheels the gpu
#                                     # tests need, at the versions this checkout's .venv has, for CPython 3.12
#                                     # on x86-64 Linux, without their dependencies (torch, triton, nvidia-*,
#                                     # numpy, tokenizers... are the GPU machine's own); DeepSpeed (an sdist) is
#                                     # built into a pure-Python wheel here
#   scripts/gpu_check.sh --stack --download  # here: the whole run stack (Ray, Prefect, MLflow, ... and the demo
#                                     # model's GGUF) for CPython 3.12, as .gpu/stack.tar.xz.part-* of <= 56 MiB each
#                                     # (scripts/gpu_stack.py); each part travels in its own call to a warm machine
#   scripts/gpu_check.sh --vllm --download   # here: vLLM's CUDA 13 build for torch 2.11 and the packages it imports
#                                     # that neither the image nor the stack holds, as .gpu/vllm.tar.xz.part-* of
#                                     # <= 56 MiB each (scripts/gpu_vllm_carry.py)
#   scripts/gpu_parts.sh              # on the GPU machine, in each call that carries parts: keep them in
#                                     # $PARTS_DIR (/tmp/rlstages-parts) for the calls after it, say what is missing
#   scripts/gpu_check.sh --stack [--vllm] [--bench]  # on the GPU machine: check, join and unpack the parts
#                                     # (scripts/gpu_parts.sh; --vllm: vLLM's too, on PYTHONPATH after the
#                                     # stack's), then the whole demo
#                                     # run (`rlstages run configs/demo_gpu.yaml`: Prefect flow, a Ray actor with
#                                     # the GPU, MLflow store, checkpoints, held-out evaluation); its metrics, log
#                                     # and reward curve in $RESULTS_DIR (default $OUT or .gpu/results)
#   scripts/gpu_check.sh [--bench]    # on the GPU machine: the wheels installed offline into $SITE (put first on
#                                     # PYTHONPATH, over the machine's own versions), each test file in its own
#                                     # pytest process (each sets up its own process group); with --bench, then
#                                     # bench/bench_gpu.py and bench/bench_gpu_sync.py; all output in $RESULTS
#
# With --stack: DEMO=0 skips the demo run, DEMO_ARGS adds its overrides (e.g. trainer.profile.steps=[3]),
# GPU_TESTS=none skips the tests (or names the test files to run), BENCHES lists the benches (bench_gpu:update,rollout
# runs only those figures of bench_gpu).
# Environment: PYTHON (default python3, the interpreter whose torch has CUDA), WHEELS (default .whl),
# RESULTS (default gpu_check_results.txt), SITE (default /tmp/rlstages-gpu-site), TIMEOUT per file in seconds
# (600). The gpu tests import only torch, transformers, tensordict, safetensors, pydantic, pyyaml (and deepspeed /
# megatron-core for their files): no Ray, Prefect or MLflow. A file whose package is missing is skipped with
# the reason (pytest's skip), not failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl}"
RESULTS="${RESULTS:-$ROOT/gpu_check_results.txt}"
SITE="${SITE:-/tmp/rlstages-gpu-site}"
TIMEOUT="${TIMEOUT:-600}"
# Pure-Python or cp312 wheels the GPU machine may lack or hold at another version than the one tested here
PACKAGES=(transformers tensordict pyvers pydantic pydantic_core annotated-types typing-inspection typing_extensions
  regex megatron-core hjson py-cpuinfo)
BENCH=0
STACK=0
VLLM=0
for arg in "$@"; do
  case "$arg" in
    --bench) BENCH=1 ;;
    --stack) STACK=1 ;;
    --vllm) VLLM=1 ;;
  esac
done
STACK_DIR="${STACK_DIR:-/tmp/rlstages-stack}"
VLLM_DIR="${VLLM_DIR:-/tmp/rlstages-vllm}"
RESULTS_DIR="${RESULTS_DIR:-${OUT:-$ROOT/.gpu/results}}"

if [[ " $* " == *" --download "* && ($STACK == 1 || $VLLM == 1) ]]; then
  if [[ $STACK == 1 ]]; then
    "${LOCAL_PYTHON:-$ROOT/.venv/bin/python}" "$ROOT/scripts/gpu_stack.py" "$ROOT/.gpu" || exit 1
  fi
  if [[ $VLLM == 1 ]]; then
    "${LOCAL_PYTHON:-$ROOT/.venv/bin/python}" "$ROOT/scripts/gpu_vllm_carry.py" "$ROOT/.gpu" || exit 1
  fi
  exit 0
fi

if [[ " $* " == *" --download "* ]]; then
  LOCAL="${LOCAL_PYTHON:-$ROOT/.venv/bin/python}"
  mkdir -p "$WHEELS"
  platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  for name in "${PACKAGES[@]}"; do
    version="$("$LOCAL" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")" || exit 1
    "$LOCAL" -m pip download -q --no-deps "${platform[@]}" -d "$WHEELS" "$name==$version" || exit 1
  done
  version="$("$LOCAL" -c "import importlib.metadata as m; print(m.version('deepspeed'))")" || exit 1
  DS_BUILD_OPS=0 "$LOCAL" -m pip wheel -q --no-deps --no-build-isolation --no-binary=:all: -w "$WHEELS" \
    "deepspeed==$version" || exit 1
  rm -f "$WHEELS"/*.tar.gz
  du -sh "$WHEELS"
  echo "wheels in $WHEELS; copy the repository with it to the GPU machine and run scripts/gpu_check.sh there"
  exit 0
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: $PYTHON has no CUDA torch or sees no GPU (torch.cuda.is_available() is False)" >&2
  exit 2
fi
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || { echo "gpu_check: the wheels in $WHEELS did not install" >&2; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu_check: no wheels in $WHEELS; using what $PYTHON already has" >&2
fi

if [[ $STACK == 1 ]]; then
  if [[ ! -d "$STACK_DIR/site" ]]; then
    "$ROOT/scripts/gpu_parts.sh" unpack stack "$STACK_DIR" || exit 2
  fi
  export PYTHONPATH="$STACK_DIR/site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$STACK_DIR/site/bin:$PATH"
fi
if [[ $VLLM == 1 ]]; then  # after the stack on PYTHONPATH: the two hold no package in common
  if [[ ! -d "$VLLM_DIR/vllm-site" ]]; then
    "$ROOT/scripts/gpu_parts.sh" unpack vllm "$VLLM_DIR" || exit 2
  fi
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$VLLM_DIR/vllm-site" VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1
fi

PKGROOT="$(mktemp -d)"  # `rlstages.*` resolves to this checkout, without installing it (or its Ray/Prefect deps)
ln -s "$ROOT" "$PKGROOT/rlstages"
export PYTHONPATH="$PKGROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT" || exit 2

{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  "$PYTHON" - <<'EOF'
import torch
print(f"device: {torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()}), torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
for name in ("transformers", "tensordict", "deepspeed", "megatron.core", "flash_attn", "vllm"):
    try:
        module = __import__(name, fromlist=["__version__"])
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001 - report what is missing, go on
        print(f"{name}: not importable ({type(exc).__name__})")
EOF
} > "$RESULTS" 2>&1

status=0
if [[ $STACK == 1 && "${DEMO:-1}" == 1 ]]; then
  mkdir -p "$RESULTS_DIR"
  echo "== rlstages run configs/demo_gpu.yaml ${DEMO_ARGS:-}" | tee -a "$RESULTS"
  start=$(date +%s)
  # shellcheck disable=SC2086  # DEMO_ARGS: dotted overrides, one word each
  timeout "$TIMEOUT" "$PYTHON" -m rlstages.flows.cli.main run configs/demo_gpu.yaml ${DEMO_ARGS:-} \
    > "$RESULTS_DIR/demo_gpu.log" 2>&1
  rc=$?
  echo "== rlstages run configs/demo_gpu.yaml exit $rc in $(( $(date +%s) - start )) s" | tee -a "$RESULTS"
  [[ $rc -ne 0 ]] && status=1
  "$PYTHON" "$ROOT/scripts/gpu_stack_report.py" "$RESULTS_DIR" >> "$RESULTS" 2>&1
fi
for file in tests/gpu/test_gpu_*.py; do
  [[ "${GPU_TESTS:-}" == none ]] && break
  [[ $STACK == 1 && -n "${GPU_TESTS:-}" && " $GPU_TESTS " != *" $(basename "$file") "* ]] && continue
  echo "== $file" | tee -a "$RESULTS"
  timeout "$TIMEOUT" "$PYTHON" -m pytest -p no:cacheprovider -m gpu -rA -q "$file" >> "$RESULTS" 2>&1
  rc=$?
  echo "== $file exit $rc" | tee -a "$RESULTS"
  [[ $rc -ne 0 && $rc -ne 5 ]] && status=1  # 5: nothing collected
done
if [[ $BENCH == 1 ]]; then
  for bench in ${BENCHES:-bench_gpu bench_gpu_sync bench_trl}; do  # bench_gpu:update,rollout = those figures only
    name="${bench%%:*}"; args=()
    [[ "$bench" == *:* ]] && IFS=, read -r -a args <<< "${bench#*:}"
    echo "== bench/$name.py ${args[*]}" | tee -a "$RESULTS"
    timeout "$TIMEOUT" "$PYTHON" -m "bench.$name" "${args[@]}" >> "$RESULTS" 2>&1
    echo "== bench/$name.py exit $?" | tee -a "$RESULTS"
  done
fi
rm -rf "$PKGROOT"
echo "gpu_check: results in $RESULTS (exit $status)"
exit $status
