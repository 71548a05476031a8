"""What an 8-bit KV cache changes in a trained run's greedy decoding, against the 16-bit one.

  python scripts/kv_cache_accuracy.py --workdir=runs/default [--prompts=32 --new_tokens=32
      --kv_cache_dtype=int8,fp8 --json=OUT.json]

Prompts: `--prompts` passages of the embedded corpus (the default run's text), each cut at a
seeded offset to 64 tokens. Each is decoded greedily by the engine with the cache in the compute
dtype and with each 8-bit one. Printed per 8-bit kind: the share of new tokens equal at the same
position, the share of completions identical, and the mean absolute difference of the chosen
tokens' logprobs before each completion's first differing token (issue 38's gates: >= 85%,
< 0.05 nats).
"""
import argparse
import json

import jax
import numpy as np

from jax_pretrain import cli
from jax_pretrain import engine as engine_lib
from jax_pretrain import model as model_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.data import corpus

PROMPT_TOKENS = 64


def prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
  """n prompts of PROMPT_TOKENS tokens from the embedded corpus, at seeded documents and offsets."""
  docs = [d for d in corpus.embedded_documents() if len(d) > 4 * PROMPT_TOKENS * 8]
  rng = np.random.default_rng(seed)
  out = []
  for i in rng.choice(len(docs), n, replace=len(docs) < n):
    ids = tokenizer.encode(docs[i])
    start = int(rng.integers(0, len(ids) - PROMPT_TOKENS))
    out.append([int(t) for t in ids[start:start + PROMPT_TOKENS]])
  return out


def decode(run, ids: list[list[int]], new_tokens: int, kv_cache_dtype: str):
  """Greedy completions (tokens, logprobs) of each prompt, every prompt in a slot of its own."""
  eng = engine_lib.Engine(run.config.model, run.params, run.tokenizer, slots=len(ids),
                          context=PROMPT_TOKENS + new_tokens, kv_cache_dtype=kv_cache_dtype)
  seqs = [engine_lib.Sequence(prompt=p, max_new_tokens=new_tokens, temperature=0.0)
          for p in ids]
  eng.generate(seqs)
  return [(s.tokens, np.asarray(s.logprobs, np.float64)) for s in seqs]


def compare(base, other) -> dict:
  """Token agreement and logprob differences of two decodings of the same prompts."""
  equal = total = identical = 0
  diffs = []
  for (t0, lp0), (t1, lp1) in zip(base, other):
    n = max(len(t0), len(t1))
    same = [a == b for a, b in zip(t0, t1)]
    equal += sum(same)
    total += n
    identical += t0 == t1
    # Before the first differing token: the same context and the same token chosen.
    first = same.index(False) if False in same else min(len(t0), len(t1))
    diffs.extend(np.abs(lp0[:first] - lp1[:first]))
  return {'tokens_equal': equal / max(total, 1), 'completions_identical': identical / len(base),
          'logprob_abs_diff_mean': float(np.mean(diffs)) if diffs else None,
          'logprob_abs_diff_max': float(np.max(diffs)) if diffs else None,
          'positions_compared': len(diffs)}


def main() -> None:
  cli.output_policy()
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', required=True)
  p.add_argument('--prompts', type=int, default=32)
  p.add_argument('--new_tokens', type=int, default=32)
  p.add_argument('--kv_cache_dtype', default='int8,fp8')
  p.add_argument('--json', default='')
  a = p.parse_args()
  kinds = a.kv_cache_dtype.split(',')
  for kind in kinds:
    if kind not in model_lib.KV_CACHE_DTYPES:
      p.error(f'--kv_cache_dtype: {kind!r} is not one of {", ".join(model_lib.KV_CACHE_DTYPES)}')
  with cli.user_errors():
    measure(a, kinds)


def measure(a, kinds: list[str]) -> None:
  """Decodes the prompts with each cache and prints (and writes) the comparisons."""
  run = workdir_lib.load(a.workdir, None, devices=jax.devices()[:1])
  ids = prompts(run.tokenizer, a.prompts)
  base = decode(run, ids, a.new_tokens, 'auto')
  results = {'workdir': a.workdir, 'dtype': run.config.model.dtype, 'prompts': a.prompts,
             'new_tokens': a.new_tokens}
  for kind in kinds:
    r = results[kind] = compare(base, decode(run, ids, a.new_tokens, kind))
    line = (f'{kind:>5} vs {run.config.model.dtype} cache: {r["tokens_equal"]:.1%} of tokens '
            f'equal, {r["completions_identical"]:.1%} of completions identical')
    if r['positions_compared']:
      line += (f', chosen logprobs {r["logprob_abs_diff_mean"]:.4f} nats apart on average before '
               f'the first difference (max {r["logprob_abs_diff_max"]:.4f}, '
               f'{r["positions_compared"]} positions)')
    print(line)
  if a.json:
    with open(a.json, 'w', encoding='utf-8') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
