#!/usr/bin/env bash
# The fine-tuning worked example, on the CPU, from a fresh clone (docs/fine_tuning.md):
#   1. pretrain the embedded default (configs/default.py)             ~2-3 min
#   2. write a verifiable task: reversing 3-6 letters, 2000 train items and 200 held out
#   3. SFT on the train items (configs/sft.py)                         ~3 min
#   4. DPO on the train items' preference pairs (the answer chosen over a wrong one) from the
#      SFT run (configs/dpo.py; the held-out items' pairs are its eval)  5-9 min loaded
#   5. GRPO on the same items from the DPO run (configs/grpo.py)       ~3-4 min
# and the greedy held-out accuracy (python -m jax_pretrain.evaluate --task) after 1, 3, 4 and 5.
#
#   bash scripts/worked_example.sh [RUNS_DIRECTORY]     (default runs/example)
#
# Every stage is a trainer run with its own workdir under RUNS_DIRECTORY: run the script again
# and finished stages resume at their last step (nothing retrains), a stopped one continues.
# The same command on the same machine gives the same numbers (CPU runs are deterministic).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh" requirements.txt
cd "$root"
runs=${1:-runs/example}
py=(env JAX_PLATFORMS=cpu "$root/.venv/bin/python")
task=$runs/task

"${py[@]}" -m jax_pretrain.main --workdir="$runs/default"
"${py[@]}" scripts/make_task.py --output-dir "$task" --task reverse --train 2000 --heldout 200 \
    --seed 0
"${py[@]}" -m jax_pretrain.main --config=configs/sft.py --workdir="$runs/sft" \
    --config.checkpoint.restore_from="$runs/default" --config.data.train="$task/sft.jsonl" \
    --config.optim.learning_rate=5e-4 --config.train.steps=150
"${py[@]}" -m jax_pretrain.dpo --workdir="$runs/dpo" --init="$runs/sft" \
    --config.data.train="$task/prefs.jsonl" --config.data.val="$task/heldout_prefs.jsonl" \
    --config.dpo.rpo_alpha=1.0 --config.optim.learning_rate=1e-4 --config.train.steps=60 \
    --config.train.eval_every=20 --config.train.log_every=5
"${py[@]}" -m jax_pretrain.grpo --workdir="$runs/grpo" --init="$runs/dpo" \
    --task="$task/train.jsonl" --eval_task="$task/heldout.jsonl" \
    --config.grpo.num_samples=16 --config.train.batch_size=256 --config.grpo.max_new_tokens=8 \
    --config.optim.learning_rate=2e-5 --config.optim.min_learning_rate=2e-5 \
    --config.optim.warmup_steps=5 \
    --config.train.steps=100 --config.train.eval_every=25 --config.train.log_every=5

for stage in default sft dpo grpo; do
  "${py[@]}" -m jax_pretrain.evaluate --workdir="$runs/$stage" --task="$task/heldout.jsonl" \
      --max_new_tokens=8 --json="$runs/$stage/heldout_accuracy.json" > /dev/null
done
echo
echo "held-out accuracy (greedy, exact answers, $(wc -l < "$task/heldout.jsonl") items):"
for stage in default sft dpo grpo; do
  "${py[@]}" -c 'import json, sys
accuracy = json.load(open(sys.argv[2]))["accuracy"]
print(f"  {sys.argv[1]:<8} {accuracy:.1%}")' "$stage" "$runs/$stage/heldout_accuracy.json"
done
