"""Time to first token of a chat's fourth turn, with and without the engine's prefix cache.

  python scripts/benchmark_prefix_cache.py [--preset=default] [--history=2000] [--context=2304]

A chat of four turns through one engine of one slot (a preset's model, randomly initialized: the
time does not depend on the weights; one slot: the calls' shapes are those the untimed run
compiled): each turn's prompt is the whole conversation so far (the earlier
turns' messages and answers, as a chat client resends it) and a new message; the fourth turn's
prompt has --history tokens before its new message. Its time to first token is a generate() of
one token (its prefill and one decode call), with --prefix_cache on (its history's keys and values
reused from the third turn's slot) and off (the whole prompt prefilled). Each engine first runs a
conversation of the same lengths untimed (its programs compiled), then --repeats timed ones of
fresh tokens; the median is printed, and whether the greedy tokens of both agree.
"""
import argparse
import dataclasses
import random
import statistics
import time

from flax.linen import meta
import jax
import jax.numpy as jnp

from jax_pretrain import config as config_lib
from jax_pretrain import engine
from jax_pretrain import model as model_lib
from jax_pretrain.data import tokenizer as tokenizer_lib


def conversation(eng: engine.Engine, seed: int, history: int, message: int, answer: int):
  """The four turns' (first token's seconds, greedy tokens, cached tokens) of one chat."""
  rng = random.Random(seed)
  words = lambda n: [rng.randrange(1, 256) for _ in range(n)]
  before = history - 3 * answer  # the messages of the first three turns, answers aside
  sizes = [before // 3, before // 3, before - 2 * (before // 3), message]
  prompt: list[int] = []
  turns = []
  for k, size in enumerate(sizes):
    prompt = prompt + words(size)
    first = engine.Sequence(prompt=list(prompt), max_new_tokens=1)
    t0 = time.perf_counter()
    eng.generate([first])
    seconds = time.perf_counter() - t0
    seq = engine.Sequence(prompt=list(prompt), max_new_tokens=answer if k < 3 else 1)
    eng.generate([seq])  # (its answer, part of the next turn's prompt)
    turns.append((seconds, first.tokens, first.cached_tokens))
    prompt += seq.tokens + words(answer - len(seq.tokens))  # (an early EOS: filled up)
  return turns


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--preset', default='default')
  p.add_argument('--history', type=int, default=2000)
  p.add_argument('--message', type=int, default=100, help="the fourth turn's new message")
  p.add_argument('--answer', type=int, default=32, help="each earlier turn's answer")
  p.add_argument('--context', type=int, default=2304)
  p.add_argument('--repeats', type=int, default=3)
  a = p.parse_args()
  config, _ = config_lib.resolve(config_lib.preset(a.preset), num_devices=1,
                                 backend=jax.default_backend())
  cfg = dataclasses.replace(config.model, init_std=0.2)
  params = meta.unbox(jax.jit(model_lib.Transformer(cfg).init)(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params'])
  results = {}
  for prefix_cache in (False, True):
    eng = engine.Engine(cfg, params, tokenizer_lib.ByteTokenizer(), slots=1, context=a.context,
                        prefix_cache=prefix_cache)
    conversation(eng, 0, a.history, a.message, a.answer)  # (compiles its programs)
    runs = [conversation(eng, 1 + r, a.history, a.message, a.answer) for r in range(a.repeats)]
    fourth = [run[3] for run in runs]
    results[prefix_cache] = statistics.median(t for t, _, _ in fourth), [x[1] for x in fourth]
    print(f'prefix_cache={prefix_cache}: the fourth turn ({a.history + a.message} prompt tokens, '
          f'{fourth[0][2]} cached): first token in {results[prefix_cache][0] * 1000:.0f} ms '
          f'(median of {a.repeats}: {", ".join(f"{t * 1000:.0f}" for t, _, _ in fourth)}); '
          f'turns 1-3 (medians): '
          f'{", ".join(f"{statistics.median(r[k][0] for r in runs) * 1000:.0f}" for k in range(3))}'
          f' ms, cached {", ".join(str(x[2]) for x in runs[0][:3])}',
          flush=True)
  print(f'with the cache / without: {results[True][0] / results[False][0]:.3f}; greedy tokens '
        f'{"equal" if results[True][1] == results[False][1] else "DIFFER"}')


if __name__ == '__main__':
  main()
