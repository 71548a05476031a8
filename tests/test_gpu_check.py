"""scripts/gpu_check.sh: its CPU dry run prints the Markdown tables a GPU session fills in."""
import re
import subprocess
import sys

from tests.conftest import ROOT
from tests.conftest import subprocess_env


def test_gpu_check_dry_run_prints_every_table(tmp_path):
  env = dict(subprocess_env(), PYTHON=sys.executable, OUT=str(tmp_path))
  out = subprocess.run(['bash', 'scripts/gpu_check.sh', '--dry-run'], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-3000:]
  text = out.stdout
  for heading in ('### Trainer: the default and FP8, the same steps',
                  '### Attention: cuDNN and Pallas against XLA',
                  '### Train step: the default, two alternatives and the peer',
                  '### Checkpoint: asynchronous save and restore',
                  '### Precision: bfloat16, float16 with loss scaling, FP8',
                  "### Profile: the trainer's device time a step by kind",
                  '### Decoding: the engine, its reference and the peer',
                  "### Numerics: FP8 and the 8-bit caches' tests on the device"):
    assert heading in text
  # Trainer: the default and FP8 runs of the trainer, trained the same steps to near losses.
  trainer = dict(re.findall(r'^\| (default|fp8) \| [\d,]+ \| n/a \| ([\d.]+) \|', text, re.M))
  assert set(trainer) == {'default', 'fp8'}, text
  assert abs(float(trainer['fp8']) / float(trainer['default']) - 1) < 0.05, trainer
  text, precision = text.split('### Precision')
  precision, profile = precision.split('### Profile')
  profile, engine = profile.split('### Decoding')
  engine, numerics = engine.split('### Numerics')
  rows = {line.split('|')[1].strip(): line for line in text.splitlines()
          if line.startswith('| ') and not line.startswith('| attention')}
  # Attention: cuDNN cannot run on the CPU and says so; Pallas agrees with XLA.
  assert 'failed' in rows['cudnn']
  errors = [float(x) for x in re.findall(r'\d\.\de[-+]\d\d', rows['pallas'].split('|')[8])]
  assert len(errors) == 4 and max(errors) < 2e-2
  # Train step: three settings of the same model, seed and tokens end at the same loss.
  steps = [line for line in text.splitlines() if re.match(r'\| (xla|pallas), \w+, mb \d+ ×', line)]
  assert len(steps) == 3, text
  losses = {line.split('|')[7].strip() for line in steps}
  assert len(losses) == 1, steps
  # The peer's row, in the same columns, trained the same model (random weights of its own).
  peer = re.search(r'^\| transformers eager: .*\| ([\d.]+), [\d.]+ \|$', text, re.M)
  assert peer and peer.group(0).count('|') == steps[0].count('|'), text
  assert abs(float(peer.group(1)) - float(losses.pop().split(',')[0])) < 0.05
  assert re.search(r'\| \d+M params, [\d.]+ GiB \| [\d.]+ s', text)
  # Precision: the same model in bfloat16, float16 (loss scaling) and FP8, each trained.
  rows = re.findall(r'^\| xla, \w+, mb \d+ × \d+, (\w+(?: \+ fp8)?) \| [\d,]+ \|'
                    r'.*\| ([\d.]+), [\d.]+ \|$', precision, re.M)
  assert [r[0] for r in rows] == ['bfloat16', 'float16', 'bfloat16 + fp8'], precision
  losses = [float(r[1]) for r in rows]
  assert max(losses) - min(losses) < 0.05 * max(losses), rows
  # Profile: the trainer's own trace, every kind of its work, the rows adding up to the traced time.
  ms = dict(re.findall(r'^\| ([a-z /]+) \| ([\d,.]+) \| [\d.]+% \|$', profile, re.M))
  ms = {kind: float(value.replace(',', '')) for kind, value in ms.items()}
  assert {'matmul', 'recomputation', 'loss', 'optimizer', 'idle', 'traced'} <= set(ms), profile
  assert ms['matmul'] > 0 and ms['recomputation'] > 0, profile
  assert abs(sum(v for k, v in ms.items() if k != 'traced') - ms['traced']) < 0.1 * len(ms)
  # Decoding: the engine's rows (a 16-bit and each 8-bit KV cache) and the peer's under them, in
  # one table.
  rows = [line for line in engine.splitlines() if line.startswith('| ')]
  assert [row.split('|')[1].strip() for row in rows[1:]] == [
      'engine (jax_pretrain)', 'engine (jax_pretrain), int8 KV cache',
      'engine (jax_pretrain), fp8 KV cache', 'transformers generate (static cache)'], engine
  assert len({row.count('|') for row in rows}) == 1, engine
  # Numerics: the device-bound tests, each run (on the CPU here) and passed.
  ran = re.findall(r'^\| tests/\S+::(\w+)\S* \| (\w+) \|$', numerics, re.M)
  assert {name for name, _ in ran} == {
      'test_fp8_with_float16_compute_matches_float64',
      'test_fp8_inference_gives_a_row_the_same_logits_alone_and_in_any_batch',
      'test_a_quantized_cache_under_float16_is_as_accurate_as_dequantizing_first'}, numerics
  assert len(ran) == 5 and {status for _, status in ran} == {'PASSED'}, numerics
