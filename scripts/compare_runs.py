"""Training runs side by side, from their workdirs' metrics.jsonl, as one Markdown table.

  python scripts/compare_runs.py NAME=WORKDIR [NAME=WORKDIR ...] [--reference=NAME]

A row a run: its speed (the median of the logged intervals' tokens/s and MFU, the first interval
left out: it holds the compile), its train loss at the last step all the runs logged, its last
eval loss, and each loss against the reference run's (default: the first). gpu_check.sh's
'trainer' step prints it for the default and the FP8 run of the same steps.
"""
import argparse
import json
import os
import statistics
import sys


def read(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [json.loads(line) for line in f]


def summary(records: list[dict]) -> dict:
  train = [r for r in records if 'train/loss' in r]
  speeds = [r['perf/tokens_per_sec'] for r in train[1:]] or [train[0]['perf/tokens_per_sec']]
  mfus = [r['perf/mfu'] for r in train[1:] if r.get('perf/mfu') is not None]
  evals = [r for r in records if 'eval/loss' in r]
  return {'loss': {r['step']: r['train/loss'] for r in train},
          'tokens_per_s': statistics.median(speeds),
          'mfu': statistics.median(mfus) if mfus else None,
          'eval': (evals[-1]['step'], evals[-1]['eval/loss']) if evals else None}


def table(runs: dict[str, dict], reference: str) -> str:
  step = max(set.intersection(*(set(s['loss']) for s in runs.values())))
  ref = runs[reference]
  lines = [f'| run | tokens/s | MFU | train loss at step {step} | vs {reference} | eval loss | '
           f'vs {reference} |', '|---|---|---|---|---|---|---|']
  for name, s in runs.items():
    mfu = f'{s["mfu"]:.1%}' if s['mfu'] is not None else 'n/a'
    loss = s['loss'][step]
    rel = f'{loss / ref["loss"][step] - 1:+.2%}'
    if s['eval'] and ref['eval']:
      ev, ev_rel = f'{s["eval"][1]:.4f} (step {s["eval"][0]})', \
          f'{s["eval"][1] / ref["eval"][1] - 1:+.2%}'
    else:
      ev, ev_rel = 'n/a', 'n/a'
    lines.append(f'| {name} | {s["tokens_per_s"]:,.0f} | {mfu} | {loss:.4f} | {rel} | {ev} | '
                 f'{ev_rel} |')
  return '\n'.join(lines)


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('runs', nargs='+', help='NAME=WORKDIR')
  p.add_argument('--reference', default='')
  args = p.parse_args(argv)
  runs = {}
  for spec in args.runs:
    name, sep, workdir = spec.partition('=')
    if not sep:
      print(f'error: {spec!r}: give NAME=WORKDIR', file=sys.stderr)
      return 1
    try:
      runs[name] = summary(read(workdir))
    except (OSError, ValueError, KeyError, IndexError) as e:
      print(f'error: {workdir}/metrics.jsonl: {e!r}', file=sys.stderr)
      return 1
  reference = args.reference or next(iter(runs))
  if reference not in runs:
    print(f'error: --reference={reference!r} is none of {list(runs)}', file=sys.stderr)
    return 1
  print(table(runs, reference))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
