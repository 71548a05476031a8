"""How long one asynchronous save stalls training, and how long a restore takes.

  python scripts/benchmark_checkpoint.py --config=configs/small.py [--config.x=y] [--saves 3]

Builds the preset's real train state (fresh parameters, in its shardings), compiles the
checkpoint digests' programs as the trainer does during its start-up (Checkpointer.prepare, timed
apart), then measures
  stall:   time from calling save until training could continue (the blocking part: the digests'
           reductions dispatched, the arrays copied off the devices), per save; the median over
           --saves saves;
  write:   time until the checkpoint is complete on disk (the background part);
  restore: time to restore the latest checkpoint into the same shardings.
"""
import shutil
import statistics
import tempfile
import time

from absl import flags

from jax_pretrain import cli

_CONFIG = cli.define_config('small.py', 'Preset whose state is saved.')
_SAVES = flags.DEFINE_integer('saves', 3, 'Saves to time.')
_DIR = flags.DEFINE_string('dir', None, 'Where to write (default: a temporary directory).')
_MARKDOWN = flags.DEFINE_bool('markdown', False, 'Print the result as a Markdown table.')


def main():
  import jax

  from jax_pretrain import checkpoint as checkpoint_lib
  from jax_pretrain import config as config_lib
  from jax_pretrain import model as model_lib
  from jax_pretrain import state as state_lib

  resolved, run = config_lib.resolve(cli.config_value(_CONFIG), jax.device_count(),
                                     device=jax.devices()[0])
  s = state_lib.build(resolved, run)
  state = jax.block_until_ready(state_lib.init_state(s))
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  directory = _DIR.value or tempfile.mkdtemp(prefix='ckpt_bench_')
  checkpointer = checkpoint_lib.Checkpointer(directory, keep=2)
  t0 = time.perf_counter()
  checkpointer.prepare(s.abstract_state)
  checkpointer.wait_prepared()
  prepare_s = time.perf_counter() - t0
  stalls, writes = [], []
  for i in range(_SAVES.value):
    t0 = time.perf_counter()
    checkpointer.save(i + 1, state, {})
    stalls.append(time.perf_counter() - t0)
    checkpointer.wait()
    writes.append(time.perf_counter() - t0)
  t0 = time.perf_counter()
  step, restored = checkpointer.restore_latest(s.abstract_state)
  jax.block_until_ready(restored)
  restore_s = time.perf_counter() - t0
  checkpointer.close()
  if _DIR.value is None:
    shutil.rmtree(directory)
  n = model_lib.count_params(s.abstract_state.params)
  print(f'jax {jax.__version__}, {s.mesh.size} × {s.mesh.devices.flat[0].device_kind}; the '
        f"digests' programs compiled ahead in {prepare_s:.1f} s (the trainer: during start-up, in "
        'the background)')
  if _MARKDOWN.value:
    print('\n| state | save stall (blocking part), median | save complete on disk | restore |\n'
          '|---|---|---|---|\n'
          f'| {n / 1e6:.0f}M params, {state_bytes / 2**30:.2f} GiB | '
          f'{statistics.median(stalls):.3f} s ({", ".join(f"{x:.3f}" for x in stalls)}) | '
          f'{statistics.median(writes):.2f} s | {restore_s:.2f} s |')
    return
  print(f'state: {n / 1e6:.0f}M params, {state_bytes / 2**30:.2f} GiB (params + Adam moments, '
        'float32)')
  print(f'save stall (blocking part), median of {len(stalls)}: {statistics.median(stalls):.3f} s '
        f'(all: {", ".join(f"{x:.3f}" for x in stalls)})')
  print(f'save complete on disk, median: {statistics.median(writes):.2f} s')
  print(f'restore of step {step}: {restore_s:.2f} s')


if __name__ == '__main__':
  cli.run(main)
