"""Training-step benchmark on synthetic tokens (generated on the devices: input never waits).

  python scripts/benchmark.py --config=configs/xlarge.py [--config.x=y ...] [--steps 20] [--sweep]
      [--variant=model.attention=xla,train.micro_batch_size=8 ...] [--markdown]

Compiles the real train step (the trainer's own code, with the trainer's runtime settings and its
choice of micro-batch when train.micro_batch_size=0), warms up, then times --steps steps one by
one and reports the median: tokens/s, MFU (the trainer's formula), peak device memory, compile
time, and the loss and gradient norm after the last step (same seed and tokens for every setting,
so settings that compute the same thing agree to rounding). --sweep tries micro-batch × remat
policy × attention implementation; each --variant is one setting (comma-separated overrides of
the config; an empty --variant= is the config as given). A setting that fails (out of memory,
unsupported) is listed with its error. Results print as a table, best first (--markdown: in
Markdown, in the order run).
"""
import itertools
import statistics
import time

from absl import flags

from jax_pretrain import cli

_CONFIG = cli.define_config('xlarge.py', 'Config file to benchmark.')
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps (after warm-up).')
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Untimed steps after compiling.')
_SWEEP = flags.DEFINE_bool('sweep', False, 'Try micro-batch × remat × attention.')
_MICRO_BATCHES = flags.DEFINE_list('micro_batches', ['4', '8', '16'], 'Sweep: micro-batch sizes.')
_REMATS = flags.DEFINE_list('remats', ['full', 'dots_no_batch', 'minimal', 'none'],
                            'Sweep: remat policies.')
_ATTENTIONS = flags.DEFINE_list('attentions', ['cudnn', 'pallas'], 'Sweep: attention kernels.')
_VARIANTS = flags.DEFINE_multi_string('variant', [], 'One setting: GROUP.FIELD=VALUE,... over the '
                                      'config (repeatable; empty: the config itself).')
_MARKDOWN = flags.DEFINE_bool('markdown', False, 'Print the results as a Markdown table.')


def benchmark(config, steps: int, warmup: int) -> dict:
  import jax

  from jax_pretrain import config as config_lib
  from jax_pretrain import memory
  from jax_pretrain import metrics as metrics_lib
  from jax_pretrain import model as model_lib
  from jax_pretrain import state as state_lib

  devices = jax.devices()
  config = config_lib.typed(config)
  resolved, run = config_lib.resolve(config, len(devices), device=devices[0])
  t0 = time.perf_counter()
  # micro_batch_size=0: as the trainer does
  resolved, run, _ = memory.fit_micro_batch(config, resolved, run, devices)
  fit_s = time.perf_counter() - t0
  s = state_lib.build(resolved, run, devices)
  c = s.config
  state = state_lib.init_state(s)
  t0 = time.perf_counter()
  step = state_lib.jit_train_step(s, pad_id=-1).lower(
      s.abstract_state, state_lib.abstract_batch(s, c.train.batch_size)).compile()
  compile_s = time.perf_counter() - t0
  make_batch = jax.jit(
      lambda key: {'tokens': jax.random.randint(key, (c.train.batch_size, c.data.seq_len + 1), 0,
                                                c.model.vocab_size)},
      out_shardings={'tokens': s.batch_sharding})
  batches = [make_batch(jax.random.key(i)) for i in range(4)]  # rotate: no cached input
  times = []
  for i in range(warmup + steps):
    t = time.perf_counter()
    state, metrics = step(state, batches[i % len(batches)])
    jax.block_until_ready(metrics)
    if i >= warmup:
      times.append(time.perf_counter() - t)
  step_time = statistics.median(times)
  tokens_per_sec = s.run.tokens_per_step / step_time
  device = s.mesh.devices.flat[0]
  peak = metrics_lib.peak_flops_per_device(device.device_kind, c.train.peak_flops)
  mfu = metrics_lib.mfu(model_lib.flops_per_token(c.model, c.data.seq_len),
                        tokens_per_sec, s.mesh.size, peak)
  in_use = (device.memory_stats() or {}).get('peak_bytes_in_use')
  return {'micro_batch': c.train.micro_batch_size, 'remat': c.model.remat,
          'attention': c.model.attention, 'step_s': step_time, 'tokens_per_s': tokens_per_sec,
          'mfu': mfu, 'peak_gib': in_use / 2**30 if in_use else None, 'compile_s': compile_s,
          'compiled_gib': memory.peak_bytes(step) / 2**30,
          'fit_s': fit_s, 'accumulation': s.run.grad_accum_steps, 'loss': float(metrics['loss']),
          'grad_norm': float(metrics['grad_norm']), 'precision': _precision(c),
          'device': f'{s.mesh.size} × {device.device_kind}'}


def _precision(c) -> str:
  return f'{c.model.dtype}{" + fp8" if c.model.fp8 else ""}'


def row(r: dict) -> str:
  if 'error' in r:
    return f'{r["micro_batch"]:>5} {r["remat"]:>14} {r["attention"]:>7}  failed: {r["error"]}'
  mfu = f'{r["mfu"]:.1%}' if r['mfu'] is not None else 'n/a'
  mem = f'{r["peak_gib"]:.1f}' if r['peak_gib'] is not None else 'n/a'
  return (f'{r["micro_batch"]:>5} {r["remat"]:>14} {r["attention"]:>7} {r["step_s"]:>8.3f} '
          f'{r["tokens_per_s"]:>12,.0f} {mfu:>6} {mem:>8} {r["compile_s"]:>9.1f}')


HEADER = (f'{"micro":>5} {"remat":>14} {"attn":>7} {"step_s":>8} {"tokens/s":>12} {"MFU":>6} '
          f'{"peak_GiB":>8} {"compile_s":>9}')

# Peak memory: XLA's buffer assignment of the step (what the plan predicts), and the device
# allocator's high-water mark, which only grows within a process (so, after the first row, it is
# the largest so far).
MARKDOWN_HEADER = ('| attention, remat, micro-batch × accumulation, precision | tokens/s | MFU | '
                   'step s | peak GiB: XLA / device so far | compile s (+ micro-batch search) | '
                   'loss, grad norm after the last step |\n|---|---|---|---|---|---|---|')


def markdown_row(r: dict) -> str:
  setting = f'{r["attention"]}, {r["remat"]}, mb {r["micro_batch"]}'
  if 'error' in r:
    return f'| {setting} | failed: {r["error"]} | | | | | |'
  mfu = f'{r["mfu"]:.1%}' if r['mfu'] is not None else 'n/a'
  mem = f'{r["peak_gib"]:.1f}' if r['peak_gib'] is not None else 'n/a'
  return (f'| {setting} × {r["accumulation"]}, {r["precision"]} | {r["tokens_per_s"]:,.0f} | '
          f'{mfu} | {r["step_s"]:.3f} | {r["compiled_gib"]:.1f} / {mem} | {r["compile_s"]:.1f} '
          f'(+ {r["fit_s"]:.1f}) | {r["loss"]:.4f}, {r["grad_norm"]:.4f} |')


def settings(config) -> list:
  """The configs to run: --sweep's product, or each --variant, or the config as given."""
  if _SWEEP.value:
    runs = []
    for micro, remat, attention in itertools.product(_MICRO_BATCHES.value, _REMATS.value,
                                                     _ATTENTIONS.value):
      c = config.copy_and_resolve_references()
      c.train.micro_batch_size, c.model.remat, c.model.attention = int(micro), remat, attention
      runs.append(c)
    return runs
  runs = []
  for variant in _VARIANTS.value or ['']:
    c = config.copy_and_resolve_references()
    for override in filter(None, variant.split(',')):
      path, value = override.split('=', 1)
      group, field = path.split('.')
      old = c[group][field]
      c[group][field] = value.lower() == 'true' if isinstance(old, bool) else type(old)(value)
    runs.append(c)
  return runs


def main():
  from jax_pretrain import runtime
  runtime.configure()  # the trainer's XLA flags, memory fraction, cache
  import jax
  print('\n'.join(runtime.settings(jax.default_backend())))
  config = cli.config_value(_CONFIG)
  results = []
  for c in settings(config):
    try:
      results.append(benchmark(c, _STEPS.value, _WARMUP.value))
    except Exception as e:  # noqa: BLE001  (OOM, unsupported kernel, ...)
      results.append({'micro_batch': c.train.micro_batch_size, 'remat': c.model.remat,
                      'attention': c.model.attention,
                      'error': f'{type(e).__name__}: {str(e).splitlines()[0][:120]}'})
    print(row(results[-1]), flush=True)
    jax.clear_caches()
  if _MARKDOWN.value:
    print(f'\njax {jax.__version__}, {jax.devices()[0].device_kind} × {jax.device_count()}, '
          f'batch {config.train.batch_size} × seq {config.data.seq_len}, median of '
          f'{_STEPS.value} steps\n')
    print(MARKDOWN_HEADER)
    for r in results:
      print(markdown_row(r))
    return
  ok = sorted((r for r in results if 'error' not in r), key=lambda r: -r['tokens_per_s'])
  print(f'\njax {jax.__version__}, {ok[0]["device"] if ok else jax.devices()[0].device_kind}, '
        f'batch {config.train.batch_size} × seq {config.data.seq_len}, median of '
        f'{_STEPS.value} steps')
  print(HEADER)
  for r in ok + [r for r in results if 'error' in r]:
    print(row(r))


if __name__ == '__main__':
  cli.run(main)
