"""`python -m jax_pretrain.plan --json` for every preset on each target and device count, and the
Markdown table of the results (BENCHMARKS.md, "compiled, not measured").

  python scripts/plan_presets.py [--targets h100,a100-80,a100-40] [--devices 1,8] \\
      [--presets tiny,...] [--remats dots,full,...] [--out plans.jsonl] [--table-only] \\
      [-- --memory_gib=24 --config.x=y ...]

Each plan runs in its own process (one compile at a time: a deviceless GPU compile of xlarge
takes ~1 GB and 10-60 s on a 2-core machine). Results are appended to --out as JSON lines, and
cases already there are not compiled again; --table-only only prints the table of --out (--pivot:
presets down, targets across).

--remats: a sweep. Each case is also planned with each of these model.remat policies (the fit
then chooses the micro-batch for it: the largest that fits without XLA recomputing more), and the
table compares the default's roofline with the best the sweep found.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ('default', 'tiny', 'small', 'medium', 'medium_large', 'large', 'xlarge', 'xxlarge')


def run_plan(preset: str, target: str, devices: int, overrides: list[str],
             remat: str = '') -> dict:
  """plan's JSON of one case; remat: the sweep's model.remat ('' : the config's)."""
  command = [sys.executable, '-m', 'jax_pretrain.plan', f'--config=configs/{preset}.py',
             f'--target={target}', f'--num_devices={devices}', '--json', *overrides]
  if remat:
    command.append(f'--config.model.remat={remat}')
  out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  if out.returncode:
    error = [line for line in out.stderr.splitlines() if line.startswith('error:')]
    return {'preset': preset, 'target': target, 'num_devices': devices, 'sweep_remat': remat,
            'error': (error or out.stderr.strip().splitlines()[-1:] or ['?'])[0]}
  return {'preset': preset, 'sweep_remat': remat, **json.loads(out.stdout)}


def _key(r: dict) -> tuple:
  return r['preset'], r['target'], r['num_devices'], r.get('sweep_remat', '')


def row(r: dict) -> str:
  card = f' ({r["device_memory_gib"]:.0f} GiB)' if 'device_memory_gib' in r else ''
  case = f'| {r["preset"]} | {r["target"]}{card} | {r["num_devices"]} |'
  if 'error' in r:
    return f'{case} {r["error"]} | | | | | |'
  mesh = ','.join(f'{k}={v}' for k, v in r['mesh'].items() if v > 1) or '1'
  fits = 'fits' if r['fits'] else '**does not fit**'
  comm = sum(r['collective_bytes_per_step'].values()) / 1e9
  layers = f', {r["layers"]}' if 'layers' in r else ''
  return (f'{case} {mesh}: {r["attention"]}, {r["remat"]}{layers}, mb {r["micro_batch_size"]} × '
          f'{r["grad_accum_steps"]} | {r["peak_memory_gib"]:.1f} / {r["usable_memory_gib"]:.1f} '
          f'GiB, {fits} | {r["flops_ratio"]:.2f} | {comm:.2f} | {r["tokens_per_s"]:,.0f} | '
          f'{r["mfu"]:.0%} |')


def pivot(results: list[dict]) -> str:
  """Presets down, (target, GPUs) across; each cell: peak GiB (fits), compiled/model FLOPs,
  roofline tokens/s, and the micro-batch × accumulation, remat, layers (where scanned) and FSDP
  the plan chose."""
  cases = list(dict.fromkeys((r['target'], r['num_devices'],
                              r.get('device_memory_gib', 0)) for r in results))
  presets = list(dict.fromkeys(r['preset'] for r in results))
  by_key = {(r['preset'], r['target'], r['num_devices'], r.get('device_memory_gib', 0)): r
            for r in results}
  lines = ['| preset | ' + ' | '.join(f'{n} × {t} ({m:.0f} GiB)' for t, n, m in cases) + ' |',
           '|---|' + '---|' * len(cases)]
  for preset in presets:
    cells = []
    for t, n, m in cases:
      r = by_key.get((preset, t, n, m))
      if r is None or 'error' in r:
        cells.append(r['error'] if r else '')
        continue
      mark = '' if r['fits'] else ' ✗'
      mesh = ','.join(f'{k}={v}' for k, v in r['mesh'].items() if v > 1 and k != 'data')
      cells.append(f'{r["peak_memory_gib"]:.1f} GiB{mark}, {r["flops_ratio"]:.2f}×, '
                   f'{r["tokens_per_s"] / 1e3:,.0f}k tok/s, mb {r["micro_batch_size"]}×'
                   f'{r["grad_accum_steps"]}, {r["remat"]}'
                   + (', scanned' if r.get('layers') == 'scan' else '')
                   + (f', {mesh}' if mesh else ''))
    lines.append(f'| {preset} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def sweep_table(results: list[dict]) -> str:
  """Per case: the default (as the trainer chooses), the best roofline of the sweep, and each
  remat's micro-batch and tokens/s (-: does not fit)."""
  defaults = [r for r in results if not r.get('sweep_remat') and 'error' not in r]
  remats = list(dict.fromkeys(r['sweep_remat'] for r in results if r.get('sweep_remat')))
  lines = ['| preset | GPUs | default: remat, mb × accumulation, tokens/s | ' + ' | '.join(remats)
           + ' | default / best |', '|---|---|---|' + '---|' * len(remats) + '---|']
  for d in defaults:
    sweep = {r['sweep_remat']: r for r in results
             if r.get('sweep_remat') and _key(r)[:3] == _key(d)[:3]}
    found = [r for r in sweep.values() if 'error' not in r and r['fits']] + [d]
    best = max(found, key=lambda r: r['tokens_per_s'])
    cells = [f'mb {r["micro_batch_size"]}, {r["tokens_per_s"]:,.0f}'
             if r is not None and 'error' not in r else '-' for r in map(sweep.get, remats)]
    lines.append(f'| {d["preset"]} | {d["num_devices"]} | {d["remat"]}, mb '
                 f'{d["micro_batch_size"]} × {d["grad_accum_steps"]}, {d["tokens_per_s"]:,.0f} | '
                 + ' | '.join(cells) + f' | {d["tokens_per_s"] / best["tokens_per_s"]:.3f} |')
  return '\n'.join(lines)


HEADER = ('| preset | target | GPUs | mesh: attention, remat, micro-batch × accumulation | peak / '
          'usable memory per GPU | compiled / model FLOPs | collective GB per GPU per step | '
          'roofline tokens/s | roofline MFU |\n|---|---|---|---|---|---|---|---|---|')


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
  p.add_argument('--targets', default='h100')
  p.add_argument('--devices', default='1,8')
  p.add_argument('--presets', default=','.join(PRESETS))
  p.add_argument('--remats', default='', help='the sweep: also plan with each of these remats')
  p.add_argument('--out', default='plans.jsonl')
  p.add_argument('--table-only', action='store_true')
  p.add_argument('--pivot', action='store_true',
                 help='print presets × (target, GPUs), one cell each, instead of a row per case')
  args, overrides = p.parse_known_args()
  overrides = [o for o in overrides if o != '--']
  done = []
  if os.path.exists(args.out):
    with open(args.out, encoding='utf-8') as f:
      done = [json.loads(line) for line in f if line.strip()]
  if not args.table_only:
    have = {_key(r) for r in done}
    for target in args.targets.split(','):
      for devices in map(int, args.devices.split(',')):
        for preset in args.presets.split(','):
          for remat in [''] + [r for r in args.remats.split(',') if r]:
            if (preset, target, devices, remat) in have:
              continue
            r = run_plan(preset, target, devices, overrides, remat)
            done.append(r)
            with open(args.out, 'a', encoding='utf-8') as f:
              f.write(json.dumps(r) + '\n')
            print(row(r), file=sys.stderr, flush=True)
  if args.remats:
    print(sweep_table(done))
    return
  if args.pivot:
    print(pivot(done))
    return
  print(HEADER)
  for r in done:
    print(row(r))


if __name__ == '__main__':
  main()
