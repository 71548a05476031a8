"""Compiles (ahead of time, on the CPU, nothing run) the train step and the eval step of every
preset for each 8-device mesh (data, fsdp, tensor) its shapes allow, with each remat policy, and
prints a Markdown table: one row per preset and mesh, one column per remat policy (ok, or the
error).

  python scripts/mesh_matrix.py [--presets tiny,small] [--remats full,dots] [--meshes 2x2x2,8x1x1]
          [--layers 2] [--seq_len 256] [--rows 1] [--out results.jsonl] [--table-only]
      [-- --config.x=y ...]

A crash of XLA's compiler (a failed CHECK aborts the process) must not end the sweep: the cases
compile in a worker process that reports each result as it finishes; when the worker dies, the case
it was compiling is marked with its CHECK line (or last line of output) and a new worker takes the
rest. With --out, results are appended there as they come and cases already there are skipped;
--table-only prints the table of --out.

Reductions, to fit a 2-core machine: --layers (default 2) layers, scanned (model.layers=scan),
so that the compiled program does not depend on their number; --seq_len (default
256) and --rows (default 1) sequences per data-parallel device (batch = data × fsdp × rows).
Every other shape (width, heads, kv heads, MLP, vocabulary) is the preset's own.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ('test', 'default', 'tiny', 'small', 'medium', 'medium_large', 'large', 'xlarge',
           'xxlarge')
REMATS = ('none', 'full', 'dots', 'dots_no_batch', 'minimal')
DEVICES = 8


def meshes(model) -> list[tuple[int, int, int]]:
  """Every (data, fsdp, tensor) of 8 devices that the model's shapes allow (config.resolve's
  rules: tensor divides the heads, kv heads, MLP and vocabulary; fsdp divides d_model)."""
  out = []
  for tensor in (1, 2, 4, 8):
    for fsdp in (1, 2, 4, 8):
      if DEVICES % (tensor * fsdp):
        continue
      if any(n % tensor for n in (model.num_heads, model.num_kv_heads, model.mlp_dim,
                                  model.vocab_size)) or model.d_model % fsdp:
        continue
      out.append((DEVICES // (tensor * fsdp), fsdp, tensor))
  return out


def cases(args) -> list[dict]:
  from jax_pretrain import config as config_lib
  out = []
  for preset in args.presets:
    if not os.path.isfile(os.path.join(ROOT, 'configs', f'{preset}.py')):
      continue  # e.g. a preset another branch adds
    model = config_lib.preset(preset).model
    for mesh in args.meshes or meshes(model):
      for remat in args.remats:
        out.append({'preset': preset, 'mesh': list(mesh), 'remat': remat})
  return out


def compile_case(case: dict, args) -> None:
  """Raises on an error; a compiler CHECK failure aborts the process."""
  import jax

  from jax_pretrain import config as config_lib
  from jax_pretrain import state as state_lib
  data, fsdp, tensor = case['mesh']
  c = config_lib.preset(case['preset'])
  for override in [*args.overrides,
                   f'--config.model.num_layers={args.layers}', '--config.model.layers=scan',
                   f'--config.data.seq_len={args.seq_len}',
                   f'--config.train.batch_size={data * fsdp * args.rows}',
                   '--config.train.micro_batch_size=0', f'--config.mesh.data={data}',
                   f'--config.mesh.fsdp={fsdp}', f'--config.mesh.tensor={tensor}',
                   f'--config.model.remat={case["remat"]}', '--config.train.steps=10',
                   '--config.optim.warmup_steps=1']:
    field, value = override[len('--config.'):].split('=', 1)
    group, name = field.split('.')
    kind = type(c[group][name])
    c[group][name] = (value in ('1', 'true', 'True')) if kind is bool else kind(value)
  devices = jax.devices()[:data * fsdp * tensor]
  s = state_lib.build(*config_lib.resolve(c, len(devices), device=devices[0]), devices)
  batch = state_lib.abstract_batch(s, s.config.train.batch_size)
  state_lib.jit_train_step(s, pad_id=-1).lower(s.abstract_state, batch).compile()
  state_lib.jit_eval_step(s, pad_id=-1).lower(s.abstract_state.params, batch).compile()


def worker(args) -> None:
  """Compiles the cases of stdin (JSON lines), printing 'RESULT {json}' after each."""
  for line in sys.stdin:
    case = json.loads(line)
    t0 = time.perf_counter()
    try:
      compile_case(case, args)
      result = 'ok'
    except Exception as e:  # noqa: BLE001  (reported in the table)
      result = f'{type(e).__name__}: {str(e).splitlines()[0][:120]}'
    print('RESULT ' + json.dumps({**case, 'result': result,
                                  'seconds': round(time.perf_counter() - t0, 1)}), flush=True)


def sweep(args, todo: list[dict]) -> list[dict]:
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=(os.environ.get('XLA_FLAGS', '')
                        + f' --xla_force_host_platform_device_count={DEVICES}'))
  results = []
  while todo:
    command = [sys.executable, __file__, '--worker', f'--layers={args.layers}',
               f'--seq_len={args.seq_len}', f'--rows={args.rows}', '--', *args.overrides]
    err_file = tempfile.TemporaryFile('w+')  # noqa: SIM115  (a pipe could fill; closed below)
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err_file, text=True)
    proc.stdin.write(''.join(json.dumps(c) + '\n' for c in todo))
    proc.stdin.close()
    done = []
    for line in proc.stdout:  # as each finishes
      if line.startswith('RESULT '):
        r = json.loads(line[len('RESULT '):])
        done.append(r)
        print(f'{r["preset"]} {r["mesh"]} {r["remat"]}: {r["result"]} ({r["seconds"]} s)',
              file=sys.stderr, flush=True)
        if args.out:
          with open(args.out, 'a', encoding='utf-8') as f:
            f.write(json.dumps(r) + '\n')
    proc.wait()
    err_file.seek(0)
    err = err_file.read()
    err_file.close()
    results += done
    todo = todo[len(done):]
    if todo:  # the worker died compiling todo[0]
      lines = [line for line in err.splitlines() if line.strip()]
      last = ([line for line in lines if 'Check failed' in line] or lines[-1:]
              or [f'exit {proc.returncode}'])
      crashed = {**todo[0], 'result': f'CRASH (exit {proc.returncode}): {last[0][:160]}'}
      print(f'{crashed["preset"]} {crashed["mesh"]} {crashed["remat"]}: {crashed["result"]}',
            file=sys.stderr, flush=True)
      results.append(crashed)
      if args.out:
        with open(args.out, 'a', encoding='utf-8') as f:
          f.write(json.dumps(crashed) + '\n')
      todo = todo[1:]
  return results


def table(results: list[dict], remats) -> str:
  rows = {}
  for r in results:
    rows.setdefault((r['preset'], tuple(r['mesh'])), {})[r['remat']] = r['result']
  lines = ['| preset | mesh (data, fsdp, tensor) | ' + ' | '.join(remats) + ' |',
           '|---|---|' + '---|' * len(remats)]
  for (preset, mesh), by_remat in rows.items():
    lines.append(f'| {preset} | {"×".join(map(str, mesh))} | '
                 + ' | '.join(by_remat.get(remat, '') for remat in remats) + ' |')
  return '\n'.join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--presets', default=','.join(PRESETS))
  p.add_argument('--remats', default=','.join(REMATS))
  p.add_argument('--meshes', default='', help='e.g. 2x2x2,8x1x1 (default: every allowed one)')
  p.add_argument('--layers', type=int, default=2)
  p.add_argument('--seq_len', type=int, default=256)
  p.add_argument('--rows', type=int, default=1, help='sequences per data-parallel device')
  p.add_argument('--out', default='', help='JSON lines: appended to, and cases there skipped')
  p.add_argument('--table-only', action='store_true')
  p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('overrides', nargs='*', help='--config.x=y after --')
  args = p.parse_args()
  args.presets = [x for x in args.presets.split(',') if x]
  args.remats = [x for x in args.remats.split(',') if x]
  args.meshes = [tuple(int(n) for n in m.split('x')) for m in args.meshes.split(',') if m]
  if args.worker:
    worker(args)
    return
  t0 = time.perf_counter()
  previous = []
  if args.out and os.path.exists(args.out):
    with open(args.out, encoding='utf-8') as f:
      previous = [json.loads(line) for line in f if line.strip()]
  if args.table_only:
    print(table(previous, args.remats))
    return
  seen = {(r['preset'], tuple(r['mesh']), r['remat']) for r in previous}
  todo = [c for c in cases(args) if (c['preset'], tuple(c['mesh']), c['remat']) not in seen]
  results = previous + sweep(args, todo)
  print(table(results, args.remats))
  bad = [r for r in results if r['result'] != 'ok']
  print(f'\n{len(results)} compiles, {len(bad)} failed, {time.perf_counter() - t0:.0f} s '
        f'(--layers {args.layers}, --seq_len {args.seq_len}).')
  sys.exit(1 if bad else 0)


if __name__ == '__main__':
  main()
