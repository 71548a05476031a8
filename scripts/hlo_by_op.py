"""A compiled program's kernels of one kind, grouped by the jax operation they come from.

  python scripts/hlo_by_op.py STEP.hlo [--kind=elementwise] [--top=30]

STEP.hlo: `python -m jax_pretrain.plan ... --hlo=STEP.hlo`. Each kernel's HBM bytes per step (as
jax_pretrain/hlo.py counts them, times its executions) are summed over the jax operation in its
metadata, with the layer index and the loop wrappers taken out, so that one line is one place in
the model: where a kind's bytes go (e.g. the elementwise passes the remat policy or FP8 adds).
"""
import argparse
import collections
import re

from jax_pretrain import hlo

_NOISE = (r'jit\(train_step\)/', r'while/body/', r'eval_jaxpr/')


def by_op(text: str, kind: str) -> list[tuple[str, float, float]]:
  """[(jax operation, HBM bytes a step, kernel launches a step)] of `kind`, most bytes first."""
  op_names = {}
  for m in re.finditer(r'%(\S+) = .*?op_name="([^"]*)"', text):
    op_names.setdefault(m.group(1), m.group(2))
  groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
  for k in hlo.analyze(text).kernels:
    if k.kind != kind:
      continue
    op = op_names.get(k.name, '?')
    for noise in _NOISE:
      op = re.sub(noise, '', op)
    op = re.sub(r'layers_\d+', 'layers_i', op)
    groups[op][0] += k.hbm_bytes * k.times
    groups[op][1] += k.times
  return sorted(((op, b, t) for op, (b, t) in groups.items()), key=lambda x: -x[1])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('hlo')
  p.add_argument('--kind', default='elementwise')
  p.add_argument('--top', type=int, default=30)
  args = p.parse_args()
  with open(args.hlo, encoding='utf-8') as f:
    rows = by_op(f.read(), args.kind)
  print(f'{args.kind}: {sum(b for _, b, _ in rows) / 1e9:.1f} GB a step')
  for op, b, t in rows[:args.top]:
    print(f'{b / 1e9:9.2f} GB  x{t:6.0f}  {op}')


if __name__ == '__main__':
  main()
