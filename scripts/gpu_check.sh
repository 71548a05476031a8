#!/usr/bin/env bash
# Everything a session with an H100 must measure, in one command (about 7 minutes on one H100:
# 27 + 98 + 68 + 228 s, measured 2026-11-25), printed as Markdown ready for BENCHMARKS.md:
#   1. attention (scripts/benchmark_attention.py, B8 T2048 16 heads × 128, bf16, causal): cuDNN and
#      our Pallas kernel against XLA on the GPU (relative error of the output and of the three
#      gradients), and forward / backward / forward+backward TFLOP/s of all three;
#   2. the xlarge train step (scripts/benchmark.py: the trainer's code, settings and micro-batch
#      choice): tokens/s, MFU, peak memory, compile time (cold cache) for the default (attention,
#      remat and micro-batch 'auto') and two alternatives, the old default (XLA attention, remat
#      full, micro-batch 8) and cuDNN with remat full and micro-batch 16. Same seed and tokens for
#      all three: their loss and gradient norm after the last step agree to bf16 rounding when the
#      attention implementations agree (the model-level check of item 1);
#   3. the asynchronous checkpoint of xlarge (scripts/benchmark_checkpoint.py): the stall, the
#      write, the restore;
#   4. precision (issue 19): the xlarge step in bfloat16, in float16 with dynamic loss scaling (what
#      model.dtype 'auto' picks on a V100 or T4) and with model.fp8 (Hopper's FP8 matmuls):
#      tokens/s, memory, and loss and gradient norm after the last step (same seed and tokens).
# The plan's predictions to compare with: BENCHMARKS.md, "Compiled for the GPU, not measured".
#
# Usage: [STEPS="attention train_step checkpoint precision"] bash scripts/gpu_check.sh [--dry-run]
#   STEPS      which of the four to run (default all; where one command may last 10 minutes at most,
#              run STEPS="attention train_step checkpoint", then STEPS=precision)
#   --dry-run  the same steps at tiny shapes on the CPU, in about a minute: checks the script
#              (tests/test_gpu_check.py), measures nothing that matters.
# Environment: PYTHON (default .venv/bin/python, set up with requirements-gpu.txt), OUT (where the
# logs go; default a new temporary directory). Each step has a time limit; a step that fails or
# runs out of time is reported as such, and the others still run.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
out=${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}
mkdir -p "$out"
cd "$root"
# A cold persistent compilation cache, so that compile times are first-run times.
export JAX_COMPILATION_CACHE_DIR="$out/compile_cache"

if [[ ${1:-} == --dry-run ]]; then
  export JAX_PLATFORMS=cpu
  attention_args=(--batch 1 --seq 128 --heads 2 --kv_heads 2 --head_dim 64 --iters 2 --warmup 1
                  --input_sets 1)
  train_args=(--config=configs/test.py --config.train.batch_size=16 --steps 2 --warmup 1
              --variant= --variant=model.attention=pallas
              --variant=model.remat=full,train.micro_batch_size=1)
  checkpoint_args=(--config=configs/test.py --saves 1)
  precision_args=(--config=configs/test.py --config.train.batch_size=16 --steps 2 --warmup 1
                  --config.model.attention=xla --variant=model.dtype=bfloat16
                  --variant=model.dtype=float16 --variant=model.dtype=bfloat16,model.fp8=True)
  limits=(300 300 120 300)
else
  attention_args=(--batch 8 --seq 2048 --heads 16 --kv_heads 16 --head_dim 128 --iters 20)
  # 32 sequences per step: the preset's micro-batches, fewer of them (tokens/s does not depend on
  # how many micro-batches a step accumulates).
  train_args=(--config=configs/xlarge.py --config.train.batch_size=32 --steps 5 --warmup 2
              --variant= --variant=model.attention=xla,model.remat=full,train.micro_batch_size=8
              --variant=model.attention=cudnn,model.remat=full,train.micro_batch_size=16)
  checkpoint_args=(--config=configs/xlarge.py --saves 2 --dir="$out/checkpoint")
  precision_args=(--config=configs/xlarge.py --config.train.batch_size=32 --steps 5 --warmup 2
                  --config.model.attention=cudnn --config.model.remat=dots
                  --config.train.micro_batch_size=8 --variant=model.dtype=bfloat16
                  --variant=model.dtype=float16 --variant=model.dtype=bfloat16,model.fp8=True)
  # (FP8's compile alone took 153 s on the H100, 2026-11-25: its step timed out at 200 s)
  limits=(100 330 90 420)
fi

steps=" ${STEPS:-attention train_step checkpoint precision} "
want() { [[ $steps == *" $1 "* ]]; }

# run NAME LIMIT COMMAND...: runs it with a time limit, logs to $out/NAME.log, prints its Markdown
# (from the first table line on), or why there is none.
run() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout --signal=TERM "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo
  if [[ $rc == 124 ]]; then
    echo "| $name | timed out after $limit s (log: $out/$name.log) |"
  elif [[ $rc != 0 ]]; then
    echo "| $name | failed, exit $rc: $(grep -v '^\s*$' "$out/$name.log" | tail -n 1) |"
  else
    awk '/^\|/ {table = 1} table' "$out/$name.log"
  fi
  echo
  echo "($name: $((SECONDS - start)) s)"
}

echo "## GPU check, $(date -u +%Y-%m-%d)"
echo
"$python" -c 'import jax; d = jax.devices(); print(f"Device: {len(d)} × {d[0].device_kind}, "
                                                f"jax {jax.__version__}")' 2>/dev/null
[[ -x "$(command -v nvidia-smi)" ]] && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader | sed 's/^/nvidia-smi: /'
echo "Command: bash scripts/gpu_check.sh ${1:-} (logs: $out)"

want attention && echo && echo "### Attention: cuDNN and Pallas against XLA" &&
run attention "${limits[0]}" "$python" scripts/benchmark_attention.py "${attention_args[@]}" \
  --reference xla --markdown

want train_step && echo && echo "### Train step: the default and two alternatives" &&
run train_step "${limits[1]}" "$python" scripts/benchmark.py "${train_args[@]}" --markdown

want checkpoint && echo && echo "### Checkpoint: asynchronous save and restore" &&
run checkpoint "${limits[2]}" "$python" scripts/benchmark_checkpoint.py "${checkpoint_args[@]}" \
  --markdown

want precision && echo && echo "### Precision: bfloat16, float16 with loss scaling, FP8" &&
run precision "${limits[3]}" "$python" scripts/benchmark.py "${precision_args[@]}" --markdown
true  # (a step left out by STEPS is not a failure)
