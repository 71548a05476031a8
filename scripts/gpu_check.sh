#!/usr/bin/env bash
# Everything a session with an H100 must measure, in one command, printed as Markdown ready for
# BENCHMARKS.md (attention, train_step, checkpoint and precision took 27 + 98 + 68 + 228 s on one
# H100, 2026-11-25; the others are not measured yet):
#   0. trainer (issue 36, first): the trainer itself (python -m jax_pretrain.main, the real
#      loader on the embedded text), xlarge at its defaults (layers unrolled, cuDNN, remat dots),
#      16 × 2048 tokens a step in micro-batches of 8, for 300 steps, then the same with model.fp8:
#      tokens/s and MFU (median of the logged intervals), the train and eval loss at the end, FP8
#      against bfloat16 (scripts/compare_runs.py). Goals: the default >= 53,000 tokens/s, FP8
#      >= 60,000 with its loss within 1% of the default's;
#   1. attention (scripts/benchmark_attention.py, B8 T2048 16 heads × 128, bf16, causal): cuDNN and
#      our Pallas kernel against XLA on the GPU (relative error of the output and of the three
#      gradients), and forward / backward / forward+backward TFLOP/s of all three;
#   2. the xlarge train step (scripts/benchmark.py: the trainer's code, settings and micro-batch
#      choice): tokens/s, MFU, peak memory, compile time (cold cache) for the default (attention,
#      remat and micro-batch 'auto') and two alternatives, the old default (XLA attention, remat
#      full, micro-batch 8) and cuDNN with remat full and micro-batch 16. Same seed and tokens for
#      all three: their loss and gradient norm after the last step agree to bf16 rounding when the
#      attention implementations agree (the model-level check of item 1). Under them, the peer's
#      row (scripts/benchmark_peer.py: the same model, tokens a step and micro-batch in Hugging Face
#      transformers + torch.compile, SDPA, fused AdamW, bf16 autocast);
#   3. the asynchronous checkpoint of xlarge (scripts/benchmark_checkpoint.py): the stall, the
#      write, the restore;
#   4. precision (issue 19): the xlarge step in bfloat16, in float16 with dynamic loss scaling (what
#      model.dtype 'auto' picks on a V100 or T4) and with model.fp8 (Hopper's FP8 matmuls):
#      tokens/s, memory, and loss and gradient norm after the last step (same seed and tokens);
#   5. profile (issue 30): the trainer itself (python -m jax_pretrain.main, xlarge, 32 × 2048 tokens
#      a step from a token file made here, the real loader) traces steps 10..12, and
#      jax_pretrain.profile_summary prints their device time a step by kind (matmul, attention,
#      recomputation, elementwise, loss, optimizer, copies, collectives, idle). XLA's command
#      buffers are off for this run (XLA_FLAGS), so that every kernel names its HLO instruction;
#   6. engine: decoding xlarge's model, 64 sequences × (512 + 128) tokens
#      (scripts/benchmark_engine.py) with its KV cache in bf16, int8 and fp8 (issue 38), and under
#      it the peer's: transformers generate with a static cache, compiled;
#   7. numerics (issue 45): the tests whose claims the device must keep, run on it (pytest; on the
#      device image: ../shared/tools/device-wheels.sh pytest iniconfig pluggy): FP8 inference gives
#      a row the same logits alone and in any batch (bit for bit), FP8 under float16 against
#      float64, the 8-bit KV caches under float16 against dequantizing first; a row each.
# The plan's predictions to compare with: BENCHMARKS.md, "Compiled for the GPU, not measured".
#
# Usage: [STEPS="trainer attention train_step checkpoint precision profile engine numerics"] \
#            bash scripts/gpu_check.sh [--dry-run]
#   STEPS      which of the eight to run (default all; where one command may last 10 minutes at
#              most, run STEPS=trainer first (about 9 minutes), then STEPS="profile engine", then
#              STEPS="attention train_step checkpoint", then STEPS="precision numerics")
#   --dry-run  the same steps at tiny shapes on the CPU, in a few minutes: checks the script
#              (tests/test_gpu_check.py), measures nothing that matters.
# Environment: PYTHON (default .venv/bin/python, set up with requirements-gpu.txt; the peer's rows
# need torch and transformers, from requirements-dev.txt, and say so where they are missing), OUT
# (where the logs go; default a new temporary directory). Each step has a time limit; a step that
# fails or runs out of time is reported as such, and the others still run.
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
  peer_train_args=(--config=configs/test.py --config.train.batch_size=16 --micro_batch=8 --steps 2
                   --warmup 1 --nocompile --nodecode)
  profile_args=(--config=configs/test.py --config.train.steps=6 --config.train.profile_steps=3:4
                --config.model.remat=full)
  profile_vocab=384
  engine_args=(--config=configs/test.py --sequences=2 --prompt_tokens=8 --new_tokens=4 --repeats=1
               --kv_cache_dtype=auto,int8,fp8)
  trainer_args=(--config=configs/test.py --config.train.steps=6 --config.train.log_every=2
                --config.model.dtype=bfloat16)
  trainer_limit=200
  peer_engine_args=(--config=configs/test.py --sequences=2 --prompt_tokens=8 --new_tokens=4
                    --nocompile --notrain)
  limits=(300 400 120 300 300 300 300)
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
  peer_train_args=(--config=configs/xlarge.py --config.train.batch_size=32 --micro_batch=8
                   --nodecode)
  profile_args=(--config=configs/xlarge.py --config.train.batch_size=32 --config.train.steps=12
                --config.optim.warmup_steps=2 --config.train.profile_steps=10:12)
  profile_vocab=32768
  engine_args=(--config=configs/xlarge.py --sequences=64 --prompt_tokens=512 --new_tokens=128
               --repeats=1 --kv_cache_dtype=auto,int8,fp8)
  peer_engine_args=(--config=configs/xlarge.py --sequences=64 --prompt_tokens=512
                    --new_tokens=128 --notrain)
  limits=(100 560 90 420 300 420 300)
  trainer_args=(--config=configs/xlarge.py --config.train.batch_size=16
                --config.train.micro_batch_size=8 --config.train.steps=300
                --config.optim.warmup_steps=30 --config.train.log_every=25)
  trainer_limit=290
fi

steps=" ${STEPS:-trainer attention train_step checkpoint precision profile engine numerics} "
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

# then_peer OUR_SCRIPT ARGS... -- PEER_ARGS...: our benchmark, then the peer's rows
# (scripts/benchmark_peer.py --markdown; its log: $out/peer.log) under our table.
then_peer() {
  local ours=()
  while [[ $1 != -- ]]; do ours+=("$1"); shift; done
  shift
  "$python" "${ours[@]}" && "$python" scripts/benchmark_peer.py "$@" --markdown 2>>"$out/peer.log"
}

# profile VOCAB TRAINER_ARGS...: the trainer on a token file made here (random ids, with the sidecar
# that names a vocabulary of VOCAB ids, its last the pad), its profiled steps summarised by kind.
profile() {
  local vocab=$1
  shift
  "$python" -c "import json, numpy as np
np.save('$out/tokens.npy', np.random.default_rng(0).integers(0, $vocab - 1, 4_000_000, np.uint16))
json.dump({'vocab_size': $vocab, 'eos_id': $vocab - 2, 'pad_id': $vocab - 1},
          open('$out/tokens.json', 'w'))" &&
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" "$python" -m jax_pretrain.main \
    "$@" --workdir="$out/profile_run" --config.data.train="$out/tokens.npy" \
    --config.train.eval_steps=1 --config.checkpoint.save_final=false --config.train.sample_prompt= &&
  "$python" -m jax_pretrain.profile_summary --workdir="$out/profile_run"
}
# trainer LIMIT TRAINER_ARGS...: the trainer on the embedded text as configured, then with
# model.fp8, each within LIMIT seconds; their speed and losses side by side.
trainer() {
  local limit=$1
  shift
  local common=(--config.data.train=embedded --config.train.eval_steps=4
                --config.checkpoint.save_final=false --config.train.sample_prompt=)
  rm -rf "$out/trainer_default" "$out/trainer_fp8"
  timeout --signal=TERM "$limit" "$python" -m jax_pretrain.main "$@" "${common[@]}" \
    --workdir="$out/trainer_default" &&
  timeout --signal=TERM "$limit" "$python" -m jax_pretrain.main "$@" "${common[@]}" \
    --config.model.fp8=true --workdir="$out/trainer_fp8" &&
  "$python" scripts/compare_runs.py default="$out/trainer_default" fp8="$out/trainer_fp8"
}
# numerics: the device-bound numerics tests (step 7) on this device, a Markdown row each.
numerics() {
  set -o pipefail
  echo '| test | on this device |'
  echo '|---|---|'
  local tests='alone_and_in_any_batch or float16_compute_matches or cache_under_float16'
  JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} "$python" -m pytest -q -p no:cacheprovider -rA \
    tests/test_fp8.py tests/test_sample.py -k "$tests" |
    awk '/^(PASSED|FAILED|ERROR) / {print "| " $2 " | " $1 " |"}'
}
export -f then_peer profile trainer numerics
export python out

echo "## GPU check, $(date -u +%Y-%m-%d)"
echo
"$python" -c 'import jax; d = jax.devices(); print(f"Device: {len(d)} × {d[0].device_kind}, "
                                                f"jax {jax.__version__}")' 2>/dev/null
[[ -x "$(command -v nvidia-smi)" ]] && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader | sed 's/^/nvidia-smi: /'
echo "Command: bash scripts/gpu_check.sh ${1:-} (logs: $out)"

want trainer && echo && echo "### Trainer: the default and FP8, the same steps" &&
run trainer $((2 * trainer_limit + 30)) bash -c 'trainer "$@"' _ "$trainer_limit" \
  "${trainer_args[@]}"

want attention && echo && echo "### Attention: cuDNN and Pallas against XLA" &&
run attention "${limits[0]}" "$python" scripts/benchmark_attention.py "${attention_args[@]}" \
  --reference xla --markdown

want train_step && echo && echo "### Train step: the default, two alternatives and the peer" &&
run train_step "${limits[1]}" bash -c 'then_peer "$@"' _ scripts/benchmark.py "${train_args[@]}" \
  --markdown -- "${peer_train_args[@]}"

want checkpoint && echo && echo "### Checkpoint: asynchronous save and restore" &&
run checkpoint "${limits[2]}" "$python" scripts/benchmark_checkpoint.py "${checkpoint_args[@]}" \
  --markdown

want precision && echo && echo "### Precision: bfloat16, float16 with loss scaling, FP8" &&
run precision "${limits[3]}" "$python" scripts/benchmark.py "${precision_args[@]}" --markdown

want profile && echo && echo "### Profile: the trainer's device time a step by kind" &&
run profile "${limits[4]}" bash -c 'profile "$@"' _ "$profile_vocab" "${profile_args[@]}"

want engine && echo && echo "### Decoding: the engine, its reference and the peer" &&
run engine "${limits[5]}" bash -c 'then_peer "$@"' _ scripts/benchmark_engine.py \
  "${engine_args[@]}" --markdown -- "${peer_engine_args[@]}"

want numerics && echo && echo "### Numerics: FP8 and the 8-bit caches' tests on the device" &&
run numerics "${limits[6]}" bash -c numerics
true  # (a step left out by STEPS is not a failure)
