#!/usr/bin/env bash
# Issue 55's GPU checks, one prepared command per step, in the issue's order (docs/gpu.md, "The next GPU session").
# Each step runs scripts/gpu_check.sh on the run stack (and, for steps 1, 1b and 2 vllm, vLLM) already carried to
# the warm machine (scripts/gpu_parts.sh) and writes its log to $OUT (or .gpu/results). LIMIT is the step's own
# limit in seconds (each test file, bench or demo run inside it gets that much); the estimates come from the
# H100/H200 runs of docs/gpu.md, and the `run` call's timeout_s should be LIMIT + 60.
#
#   scripts/gpu_steps.sh 1           # vLLM colocated with the trainer: tests/gpu/test_gpu_vllm_hybrid.py      ~4 min
#   scripts/gpu_steps.sh 1b          # configs/demo_gpu.yaml with rollout.backend=vllm, to its end            ~7 min
#   scripts/gpu_steps.sh 2 hf        # bench_trl, our HF rollout against TRL (goal <= 0.75)                    ~6 min
#   scripts/gpu_steps.sh 2 vllm      # bench_trl, our vLLM rollout against TRL (goal <= 0.3)                   ~7 min
#   scripts/gpu_steps.sh 3           # bench_gpu:update with the fused decoder kernels + their gpu tests      ~3 min
#   scripts/gpu_steps.sh 4           # the async mode on one GPU; says it is skipped until trainer.mode has it ~0-6 min
#   scripts/gpu_steps.sh 5 SEED ON   # the demo, trainer.seed=SEED, compiled log-prob pass ON=1 / off ON=0   ~5 min
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEP="${1:?usage: gpu_steps.sh 1|1b|2 hf|2 vllm|3|4|5 SEED 0|1}"
OUTDIR="${OUT:-$ROOT/.gpu/results}"
mkdir -p "$OUTDIR"
export RESULTS="$OUTDIR/step-$STEP${2:+-$2}${3:+-$3}.txt" RESULTS_DIR="$OUTDIR" PYTHONUNBUFFERED=1
STACK=("$ROOT/scripts/gpu_check.sh" --stack)  # the run stack alone (3 parts carried)
# step 4: the demo in the asynchronous mode (tests/test_gpu_carry.py checks these overrides make a valid run)
ASYNC_DEMO_ARGS="trainer.mode=async trainer.async.max_staleness=1 cluster.hybrid_engine=false"
CHECK=("${STACK[@]}" --vllm)  # and vLLM's parts
# vLLM in the hybrid worker: the demo's sampling, 30 % of the GPU (its weights and KV cache), prompts of the demo
VLLM_ROLLOUT='rollout={"backend":"vllm","n":8,"temperature":0.7,"max_new_tokens":48,"dtype":"bfloat16",'
VLLM_ROLLOUT+='"gpu_memory_utilization":0.3,"max_model_len":512}'

case "$STEP" in
  1)
    DEMO=0 GPU_TESTS="test_gpu_vllm_hybrid.py" TIMEOUT="${LIMIT:-420}" "${CHECK[@]}"
    ;;
  1b)
    DEMO_ARGS="$VLLM_ROLLOUT trainer.run_name=demo-gpu-vllm" GPU_TESTS=none TIMEOUT="${LIMIT:-540}" "${CHECK[@]}"
    ;;
  2)
    backend="${2:?usage: gpu_steps.sh 2 hf|vllm}"
    [[ $backend == vllm ]] && STACK=("${CHECK[@]}")
    BENCH_TRL_ROLLOUT="$backend" DEMO=0 GPU_TESTS=none BENCHES=bench_trl TIMEOUT="${LIMIT:-540}" "${STACK[@]}" --bench
    ;;
  3)
    DEMO=0 GPU_TESTS="test_gpu_fused_layers.py test_gpu_fused_logits.py" BENCHES=bench_gpu:update \
      TIMEOUT="${LIMIT:-300}" "${STACK[@]}" --bench
    ;;
  4)
    # the asynchronous mode on one GPU: rollout and trainer in two workers sharing the device (no hybrid engine)
    DEMO_ARGS="$ASYNC_DEMO_ARGS trainer.run_name=demo-gpu-async" GPU_TESTS=none TIMEOUT="${LIMIT:-480}" "${STACK[@]}"
    ;;
  5)
    seed="${2:?usage: gpu_steps.sh 5 SEED 0|1}" on="${3:?usage: gpu_steps.sh 5 SEED 0|1}"
    RLSTAGES_COMPILED_LOGPROBS="$on" DEMO_ARGS="trainer.seed=$seed trainer.run_name=demo-gpu-s$seed-c$on" \
      GPU_TESTS=none TIMEOUT="${LIMIT:-420}" "${STACK[@]}"
    ;;
  *)
    echo "gpu_steps: unknown step $STEP; expected 1, 1b, 2, 3, 4 or 5" >&2
    exit 2
    ;;
esac
