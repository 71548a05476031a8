"""Times causal attention: XLA vs cuDNN vs our Pallas flash-attention kernel.

Forward, backward (the pullback alone, residuals precomputed) and forward+backward,
each a jitted function, median over --iters calls after a warm-up, rotating among a few
input sets. FLOPs: forward = 4*B*T*S*N*H (halved when causal), backward = 2.5x that,
forward+backward = 3.5x. Before timing, each implementation's output and gradients are
compared with cuDNN's (or XLA's where cuDNN cannot run) on the same inputs.

GPU:  python scripts/benchmark_attention.py
CPU smoke test (Pallas runs in interpret mode, cuDNN reports its error):
      python scripts/benchmark_attention.py --batch 1 --seq 256 --heads 2 --kv_heads 2 \
          --head_dim 64 --iters 2
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jax_pretrain.kernels.flash_attention import flash_attention

IMPLS = ('xla', 'cudnn', 'pallas')


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--seq', type=int, default=2048)
  p.add_argument('--heads', type=int, default=16)
  p.add_argument('--kv_heads', type=int, default=16)
  p.add_argument('--head_dim', type=int, default=128)
  p.add_argument('--iters', type=int, default=20, help='timed calls per measurement')
  p.add_argument('--warmup', type=int, default=2)
  p.add_argument('--input_sets', type=int, default=3, help='input sets rotated among')
  p.add_argument('--dtype', choices=('bfloat16', 'float16', 'float32'), default='bfloat16')
  p.add_argument('--causal', action=argparse.BooleanOptionalAction, default=True)
  p.add_argument('--impls', default=','.join(IMPLS), help='comma-separated subset of ' +
                 ','.join(IMPLS))
  p.add_argument('--block_q', type=int, default=128, help='pallas forward q tile')
  p.add_argument('--block_k', type=int, default=128, help='pallas forward kv tile')
  p.add_argument('--bwd_block_q', type=int, default=None, help='pallas backward q tile')
  p.add_argument('--bwd_block_k', type=int, default=None, help='pallas backward kv tile')
  p.add_argument('--reference', choices=IMPLS, default=None,
                 help='implementation the others are compared with (default: cudnn where it '
                      'runs, else xla)')
  p.add_argument('--markdown', action='store_true', help='print the table in Markdown')
  return p.parse_args(argv)


def make_attend(impl, args):
  if impl == 'pallas':
    return lambda q, k, v: flash_attention(
        q, k, v, causal=args.causal, block_q=args.block_q, block_k=args.block_k,
        bwd_block_q=args.bwd_block_q, bwd_block_k=args.bwd_block_k)
  return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=args.causal, implementation=impl)


def time_fn(fn, input_sets, iters, warmup):
  """Median wall time in ms of fn(*inputs), rotating through input_sets."""
  for i in range(max(warmup, 1)):
    jax.block_until_ready(fn(*input_sets[i % len(input_sets)]))
  times = []
  for i in range(iters):
    inputs = input_sets[i % len(input_sets)]
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def rel_err(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def short(e: Exception) -> str:
  msg = f'{type(e).__name__}: {e}'.strip().splitlines()[0]
  return msg if len(msg) <= 110 else msg[:107] + '...'


def main(argv=None):
  args = parse_args(argv)
  impls = [s.strip() for s in args.impls.split(',') if s.strip()]
  for impl in impls:
    if impl not in IMPLS:
      raise SystemExit(f'unknown implementation {impl!r}; choose from {IMPLS}')
  B, T, N, K, H = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
  dtype = jnp.dtype(args.dtype)
  fwd_flops = 4 * B * T * T * N * H * (0.5 if args.causal else 1.0)
  flops = {'fwd': fwd_flops, 'bwd': 2.5 * fwd_flops, 'fwdbwd': 3.5 * fwd_flops}
  print(f'jax {jax.__version__}, backend {jax.default_backend()}, '
        f'device {jax.devices()[0].device_kind}')
  print(f'B={B} T=S={T} N={N} K={K} H={H} {dtype.name} causal={args.causal} '
        f'iters={args.iters}; forward = {fwd_flops / 1e9:.4g} GFLOP')

  input_sets = []
  for s in range(max(args.input_sets, 1)):
    kq, kk, kv, kc = jax.random.split(jax.random.key(s), 4)
    input_sets.append((
        jax.random.normal(kq, (B, T, N, H), dtype),
        jax.random.normal(kk, (B, T, K, H), dtype),
        jax.random.normal(kv, (B, T, K, H), dtype),
        jax.random.normal(kc, (B, T, N, H), dtype),  # output cotangent
    ))

  # Correctness first: outputs and gradients on input set 0, against cuDNN where it runs.
  results, errors = {}, {}
  q0, k0, v0, ct0 = input_sets[0]
  for impl in impls:
    try:
      attend = make_attend(impl, args)
      o, pullback = jax.jit(lambda q, k, v, a=attend: jax.vjp(a, q, k, v))(q0, k0, v0)
      results[impl] = (o, *jax.jit(lambda pb, ct: pb(ct))(pullback, ct0))
      jax.block_until_ready(results[impl])
    except Exception as e:  # noqa: BLE001
      errors[impl] = short(e)
  preferred = (args.reference,) if args.reference else ('cudnn', 'xla')
  ref_name = next((r for r in preferred if r in results), None)
  rel = {}
  for impl, outs in results.items():
    if ref_name is None or impl == ref_name:
      rel[impl] = '-' if impl == ref_name else 'n/a'
      continue
    errs = [rel_err(a, b) for a, b in zip(outs, results[ref_name])]
    rel[impl] = (f'{errs[0]:.2e}' if not args.markdown else
                 ' / '.join(f'{e:.1e}' for e in errs))
    print(f'{impl} vs {ref_name}: rel err o {errs[0]:.2e}  dq {errs[1]:.2e}  '
          f'dk {errs[2]:.2e}  dv {errs[3]:.2e}')
  del results

  rows = []
  for impl in impls:
    if impl in errors:
      rows.append((impl, errors[impl]))
      continue
    try:
      attend = make_attend(impl, args)
      fwd = jax.jit(lambda q, k, v, ct, a=attend: a(q, k, v))
      vjp = jax.jit(lambda q, k, v, a=attend: jax.vjp(a, q, k, v)[1])
      bwd = jax.jit(lambda pullback, ct: pullback(ct))
      fwdbwd = jax.jit(lambda q, k, v, ct, a=attend: jax.vjp(a, q, k, v)[1](ct))
      # The backward alone: residuals (o, logsumexp, ...) are computed once per input set.
      bwd_sets = [(vjp(q, k, v), ct) for q, k, v, ct in input_sets]
      ms = {
          'fwd': time_fn(fwd, input_sets, args.iters, args.warmup),
          'bwd': time_fn(bwd, bwd_sets, args.iters, args.warmup),
          'fwdbwd': time_fn(fwdbwd, input_sets, args.iters, args.warmup),
      }
      del bwd_sets
      rows.append((impl, ms, rel[impl]))
    except Exception as e:  # noqa: BLE001
      rows.append((impl, short(e)))

  if args.markdown:
    print(f'\nB={B} T={T} heads={N} (kv {K}) × {H} {dtype.name} causal={args.causal}, median of '
          f'{args.iters}; relative L2 error against {ref_name} of o / dq / dk / dv\n')
  print_table(rows, flops, f'rel err vs {ref_name}: o / dq / dk / dv' if args.markdown else None)


def print_table(rows, flops, markdown_error_column: str | None):
  """The timing table, plain or (given the error column's title) in Markdown."""
  markdown = markdown_error_column is not None
  if markdown:
    print('| attention | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd ms | '
          f'fwd+bwd TFLOP/s | {markdown_error_column} |\n|---|---|---|---|---|---|---|---|')
  else:
    header = (f"{'impl':<8}{'fwd ms':>10}{'TFLOP/s':>9}{'bwd ms':>10}{'TFLOP/s':>9}"
              f"{'fwd+bwd ms':>12}{'TFLOP/s':>9}{'rel err':>10}")
    print(f'\n{header}\n' + '-' * len(header))
  for row in rows:
    if isinstance(row[1], str):
      print(f'| {row[0]} | failed: {row[1]} | | | | | | |' if markdown else
            f'{row[0]:<8}  failed: {row[1]}')
      continue
    impl, ms, err = row
    tf = {k: flops[k] / (ms[k] * 1e-3) / 1e12 for k in ms}
    if markdown:
      print(f"| {impl} | {ms['fwd']:.3f} | {tf['fwd']:.1f} | {ms['bwd']:.3f} | {tf['bwd']:.1f} | "
            f"{ms['fwdbwd']:.3f} | {tf['fwdbwd']:.1f} | {err} |")
    else:
      print(f"{impl:<8}{ms['fwd']:>10.3f}{tf['fwd']:>9.1f}{ms['bwd']:>10.3f}{tf['bwd']:>9.1f}"
            f"{ms['fwdbwd']:>12.3f}{tf['fwdbwd']:>9.1f}{err:>10}")


if __name__ == '__main__':
  main()
