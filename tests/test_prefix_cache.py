"""The engine's prefix cache (engine/scheduler.py): a prompt reuses the keys and values of the
longest cached prefix of it, in whole blocks, and decodes what it decodes without the cache, on one
device and a mesh, in a 16-bit and an 8-bit cache; the least recently used prefix is evicted
first."""
import random

import jax
import pytest

from jax_pretrain import engine
from jax_pretrain import sharding
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.engine import scheduler as scheduler_lib
from tests.conftest import tiny_model

BLOCK = scheduler_lib.BLOCK


@pytest.fixture(scope='module')
def tiny():
  return tiny_model()


def _engine(tiny, mesh: bool, kv_cache_dtype: str, prefix_cache: bool, slots: int = 16,
            context: int = 128):
  cfg, params = tiny
  kw = {}
  if mesh:
    kw['mesh'] = sharding.make_mesh((2, 2, 1), jax.devices()[:4])
    params = jax.device_put(params, jax.sharding.NamedSharding(kw['mesh'], jax.P()))
  return engine.Engine(cfg, params, tokenizer_lib.ByteTokenizer(), slots=slots, context=context,
                       chunk=8, kv_cache_dtype=kv_cache_dtype, prefix_cache=prefix_cache, **kw)


def _reusable(cached: list[int], prompt: list[int]) -> int:
  """The tokens a prompt reuses of what a slot holds: their common prefix in whole blocks, at
  most the prompt's length - 1."""
  n = 0
  while n < min(len(cached), len(prompt) - 1) and cached[n] == prompt[n]:
    n += 1
  return n // BLOCK * BLOCK


def _conversation(eng):
  """Four turns of a chat, each prompt its history (the earlier turns and answers) and a new
  message; then a request with a system prompt of 40 tokens, and four at once sharing it. Returns
  the turns, the cached tokens each should reuse, the request and the four."""
  rng = random.Random(0)
  words = lambda n: [rng.randrange(1, 250) for _ in range(n)]
  history, turns, expected = words(24), [], []
  held: list[list[int]] = []  # what the earlier turns' slots hold
  for _ in range(4):
    history += words(rng.randrange(3, 10))
    seq = engine.Sequence(prompt=list(history), max_new_tokens=10)
    expected.append(max([0] + [_reusable(h, seq.prompt) for h in held]))
    eng.generate([seq])
    turns.append(seq)
    held.append(seq.prompt + seq.tokens[:-1])  # (the last token ended it: not run)
    history += seq.tokens
  system = words(40)
  first = engine.Sequence(prompt=system + words(7), max_new_tokens=8)
  eng.generate([first])
  together = [engine.Sequence(prompt=system + words(9 + k), max_new_tokens=8) for k in range(4)]
  eng.generate(together)
  return turns, expected, first, together


@pytest.mark.parametrize('kv_cache_dtype', ['auto', 'int8'])
@pytest.mark.parametrize('mesh', [False, True])
def test_a_prompt_reuses_its_cached_prefix_and_decodes_as_without_the_cache(tiny, mesh,
                                                                           kv_cache_dtype):
  cached = _engine(tiny, mesh, kv_cache_dtype, prefix_cache=True)
  turns, expected, first, together = _conversation(cached)
  plain = _engine(tiny, mesh, kv_cache_dtype, prefix_cache=False)
  turns_, _, first_, together_ = _conversation(plain)
  # Greedy: the same tokens with the cache as without it.
  assert [s.tokens for s in turns] == [s.tokens for s in turns_]
  assert [s.tokens for s in [first, *together]] == [s.tokens for s in [first_, *together_]]
  assert sum(len(s.tokens) for s in turns) >= 20, [s.tokens for s in turns]
  # Each turn reuses its history's block-aligned prefix (the previous turn's prompt and answer).
  assert [s.cached_tokens for s in turns] == expected and expected[0] == 0
  assert all(n >= 32 for n in expected[1:])
  # Requests admitted together sharing a cached system prompt: its 32 tokens (2 whole blocks of
  # 40) run once, not 4 times: each of them reuses them, 3 through a copy of the row.
  assert first.cached_tokens == 0 and [s.cached_tokens for s in together] == [32] * 4
  assert cached.stats()['cached_tokens'] == sum(expected) + 4 * 32
  assert plain.stats()['cached_tokens'] == 0
  assert all(s.cached_tokens == 0 for s in [*turns_, first_, *together_])


def test_the_least_recently_used_prefix_is_evicted_first(tiny):
  """A new prompt takes a free slot of the fewest decode rows (slot 0, then 1, then 2-3: powers of
  two), the least recently used among those: a kept prefix is reused, the older one of slots
  2-3 evicted."""
  eng = _engine(tiny, False, 'auto', prefix_cache=True, slots=4)
  rng = random.Random(1)
  p0, p1, p2, p3, q0, q1, q2 = ([rng.randrange(1, 250) for _ in range(50)] for _ in range(7))
  run = lambda *prompts: [s.cached_tokens for s in eng.generate(
      [engine.Sequence(prompt=p, max_new_tokens=4) for p in prompts])]
  assert run(p0, p1, p2, p3) == [0] * 4  # slots 0-3
  assert run(p2 + [7, 8]) == [48]  # p2's slot used again: p3's is now the older of slots 2-3
  assert run(q0, q1, q2) == [0] * 3  # slots 0, 1, then 3 (p3's), not 2 (p2's)
  assert run(p2 + [9]) == [48]
  assert run(p3 + [9]) == [0]
  assert eng.scheduler.stats() == {'busy': 0, 'waiting': 0}


def test_new_params_forget_the_cached_prefixes(tiny):
  """GRPO gives the engine new params each step: the old params' keys and values are not reused."""
  eng = _engine(tiny, False, 'auto', prefix_cache=True, slots=2)
  prompt = list(range(1, 60))
  eng.generate([engine.Sequence(prompt=prompt, max_new_tokens=4)])
  eng.set_params(tiny[1])
  assert eng.generate([engine.Sequence(prompt=prompt, max_new_tokens=4)])[0].cached_tokens == 0
  assert eng.generate([engine.Sequence(prompt=prompt, max_new_tokens=4)])[0].cached_tokens == 48


def test_the_warmup_compiles_the_prefix_prefills_and_traffic_lowers_nothing(tiny):
  eng = _engine(tiny, False, 'int8', prefix_cache=True, slots=2, context=64)
  eng.warmup()
  warm = set(eng.shapes)
  # Prompts pad to 16, 32 or 64 tokens, 1 or 2 per prefill, with no copy or 2, each after a cached
  # prefix or not; decodes of 1 or 2 slots over 16, 24, 32, 48 or 64 positions.
  assert len(warm) == 3 * 2 * 2 * 2 + 2 * 5
  system = list(range(1, 40))
  seqs = [engine.Sequence(prompt=system + [k] * (k + 1), max_new_tokens=8) for k in range(4)]
  for seq in seqs:  # (one at a time: each after the one before is cached)
    eng.generate([seq])
  assert [s.cached_tokens for s in seqs] == [0, 32, 32, 32]
  again = [engine.Sequence(prompt=s.prompt, max_new_tokens=8) for s in seqs[2:]]
  eng.generate(again)  # together: one in the slot that holds the prefix, one copying its row
  assert [s.cached_tokens for s in again] == [32, 32]
  assert [s.tokens for s in again] == [s.tokens for s in seqs[2:]]
  assert eng.shapes == warm and eng.runner.programs.pending() == 0
