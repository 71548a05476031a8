"""Generation throughput of the engine (engine/) against a minimal decode loop written here.

  python scripts/benchmark_engine.py [--config=configs/default.py] [--sequences=32,128] \
      [--prompt_tokens=64] [--new_tokens=64] [--slots=0] [--chunk=8] [--temperature=1.0] \
      [--samples=1] [--frequency_penalty=0] [--constrained=0] [--markdown]

Random params of the config's model (no checkpoint), prompts of random ids (each the prompt of
--samples sequences, with streams of their own, as GRPO's num_samples completions), every sequence
generating exactly --new_tokens tokens (no EOS can end one). For each number of sequences:
  engine     Engine.generate of them all (--slots at once; 0: all), prefill included, after one
             untimed run of the same (its compiles);
  reference  the least a decoder must do, in ~50 lines below: the same params in the compute dtype
             (cast once), one cache buffer per layer written in place and donated, the prompts
             prefilled in one call and every new token in one jitted loop (no host round trip),
             attending over the whole context (prompt + new tokens).
Prints tokens/s of each and their ratio (the engine's time over the reference's), the prompts the
engine ran through the model in one generate (its prefills; '-' for an engine that does not count
them), and how many of the engine's greedy tokens the reference reproduces (--temperature=0 checks
that they decode the same model); --markdown: as a Markdown table, without the prompts
(scripts/gpu_check.sh prints the transformers row of scripts/benchmark_peer.py under it).
--constrained=K: the engine once more with K of the sequences constrained by a JSON schema
(engine/grammar.py, the byte tokenizer's bytes: an array of objects that cannot end within
--new_tokens), and its time over the unconstrained engine's (the goal: <= 1.5). The
engine here is whatever `jax_pretrain` imports: run the script with another checkout first on
PYTHONPATH to time that checkout's engine (its Engine(config, params, tokenizer, slots=, context=,
chunk=) and Sequence).
"""
import math
import time

from absl import flags

from jax_pretrain import cli

_CONFIG = cli.define_config('default.py', 'Config file whose model to generate with.')
_SEQUENCES = flags.DEFINE_list('sequences', ['32', '128'], 'Sequences per measurement.')
_PROMPT = flags.DEFINE_integer('prompt_tokens', 64, 'Tokens of every prompt.')
_NEW = flags.DEFINE_integer('new_tokens', 64, 'Tokens generated per sequence.')
_SLOTS = flags.DEFINE_integer('slots', 0, "The engine's slots (0: as many as sequences).")
_CHUNK = flags.DEFINE_integer('chunk', 8, "The engine's steps per call.")
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'Sampling temperature (0: greedy).')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed runs of each (the fastest is reported).')
_SAMPLES = flags.DEFINE_integer('samples', 1, 'Sequences per prompt (a divisor of each number of '
                                'sequences).')
_KV = flags.DEFINE_list('kv_cache_dtype', ['auto'], "The engine's KV cache kinds to measure "
                        '(model.KV_CACHE_DTYPES: auto, fp8, int8), each against the reference.')
_PENALTY = flags.DEFINE_float('frequency_penalty', 0.0, "The engine's sequences' frequency "
                              'penalty (0: none; else the penalties and logit_bias run on the '
                              'device, engine/sampling.penalized, the reference without them).')
_CONSTRAINED = flags.DEFINE_integer('constrained', 0, 'Sequences that keep a grammar in one '
                                    'more run of the engine (0: none).')
_MARKDOWN = flags.DEFINE_bool('markdown', False, 'Print the results as a Markdown table.')
MARKDOWN_HEADER = ('| decoder | sequences × (prompt + new) | slots | tokens/s | reference '
                   'tokens/s | time / reference | same tokens |\n|---|---|---|---|---|---|---|')


class _Tokenizer:
  """Ids only: no EOS can be sampled (eos_id -1), pad is the last id."""

  def __init__(self, vocab_size: int):
    self.vocab_size, self.eos_id, self.pad_id = vocab_size, -1, vocab_size - 1

  def decode(self, ids) -> str:
    return ''


def reference(c, params, B: int, P: int, new_tokens: int, temperature: float):
  """The minimal decoder (see the module docstring), compiled: prompts [B, P] -> new tokens
  [B, new_tokens]."""
  import jax
  import jax.numpy as jnp
  S, L, K, H, N = P + new_tokens, c.num_layers, c.num_kv_heads, c.head_dim, c.num_heads
  cast = lambda x: x.astype(c.compute_dtype) if x.ndim >= 2 else x
  w = jax.tree.map(cast, params)
  layers = [jax.tree.map(lambda x, i=i: x[i], w['layers']) for i in range(L)]
  inv_freq = 1.0 / (c.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
  head = w['embedding'].T if c.tie_embeddings else w['lm_head']

  def norm(x, scale):
    x = x.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + c.norm_eps) * scale
            ).astype(c.compute_dtype)

  def rope(x, pos_BxT):  # x [B, T, heads, H]
    angle = pos_BxT.astype(jnp.float32)[..., None, None] * inv_freq
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                            x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1).astype(c.compute_dtype)

  def forward(layers, caches, tokens_BxT, pos_BxT):  # logits of the last token, caches
    x = jnp.take(w['embedding'], tokens_BxT, axis=0)
    rows = jnp.arange(B)[:, None]
    new = []
    for p, (k_cache, v_cache) in zip(layers, caches):
      h = norm(x, p['attn_norm']['scale'])
      a = p['attn']
      q = rope(jnp.einsum('btd,dnh->btnh', h, a['wq']), pos_BxT)
      k = rope(jnp.einsum('btd,dkh->btkh', h, a['wk']), pos_BxT)
      k_cache = k_cache.at[rows, pos_BxT].set(k)
      v_cache = v_cache.at[rows, pos_BxT].set(jnp.einsum('btd,dkh->btkh', h, a['wv']))
      q = q.reshape(*q.shape[:2], K, N // K, H)
      s = jnp.einsum('btkgh,bskh->bkgts', q, k_cache, preferred_element_type=jnp.float32)
      visible = jnp.arange(S)[None, None, :] <= pos_BxT[:, :, None]
      s = jnp.where(visible[:, None, None], s / math.sqrt(H), -jnp.inf)
      o = jnp.einsum('bkgts,bskh->btkgh', jax.nn.softmax(s, -1).astype(c.compute_dtype), v_cache)
      x = x + jnp.einsum('btnh,nhd->btd', o.reshape(*o.shape[:2], N, H), a['wo'])
      h = norm(x, p['mlp_norm']['scale'])
      m = p['mlp']
      x = x + jnp.einsum('btf,fd->btd', jax.nn.silu(h @ m['w_gate']) * (h @ m['w_up']),
                         m['w_down'])
      new.append((k_cache, v_cache))
    x = norm(x[:, -1], w['final_norm']['scale'])
    return jnp.einsum('bd,dv->bv', x, head, preferred_element_type=jnp.float32), new

  def sample(logits, key):
    if temperature == 0:
      return jnp.argmax(logits, -1).astype(jnp.int32)
    return jax.random.categorical(key, logits[:, :-1] / temperature).astype(jnp.int32)

  @jax.jit
  def run(layers, prompts_BxP, key):  # the caches live inside: updated in place
    caches = [(jnp.zeros((B, S, K, H), c.compute_dtype),) * 2 for _ in range(L)]
    logits, caches = forward(layers, caches, prompts_BxP, jnp.broadcast_to(jnp.arange(P), (B, P)))

    def step(i, state):
      logits, caches, out = state
      token = sample(logits, jax.random.fold_in(key, i))
      logits, caches = forward(layers, caches, token[:, None], jnp.full((B, 1), P + i))
      return logits, caches, out.at[:, i].set(token)
    return jax.lax.fori_loop(0, new_tokens, step,
                             (logits, caches, jnp.zeros((B, new_tokens), jnp.int32)))[2]
  return lambda prompts_BxP: run(layers, prompts_BxP, jax.random.key(0))


def timed(fn, repeats: int):
  """(the fastest of `repeats` timed runs in seconds, the last result), after an untimed run."""
  out = fn()  # compiles
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - t0)
  return best, out


def measure(c, params, n: int) -> list[str]:
  """The table's lines (--markdown: rows) for n sequences, one per --kv_cache_dtype."""
  import numpy as np

  from jax_pretrain import engine as engine_lib
  P, M, T, k = _PROMPT.value, _NEW.value, _TEMPERATURE.value, _SAMPLES.value
  distinct = np.random.default_rng(n).integers(0, c.vocab_size - 1, (n // k, P), dtype=np.int32)
  prompts = np.repeat(distinct, k, axis=0)
  slots = _SLOTS.value or n
  measured = []
  grammar = _grammar() if _CONSTRAINED.value else None
  for kind in _KV.value + (['json'] if grammar else []):
    eng = [engine_lib.Engine(c, params, _Tokenizer(c.vocab_size), slots=slots, context=P + M,
                             chunk=_CHUNK.value, kv_cache_dtype='auto' if kind == 'json' else kind)]

    def generate(eng=eng, kind=kind):
      seqs = [engine_lib.Sequence(
          prompt=prompts[b].tolist(), max_new_tokens=M, temperature=T, seed=0, stream=b,
          frequency_penalty=_PENALTY.value,
          grammar=grammar.matcher() if kind == 'json' and b < _CONSTRAINED.value else None)
          for b in range(n)]
      eng[0].generate(seqs)
      return seqs

    engine_s, seqs = timed(generate, _REPEATS.value)
    assert all(len(s.tokens) == M for s in seqs), 'a sequence ended early'
    before = eng[0].stats().get('prompts_prefilled')
    generate()
    run = eng[0].stats().get('prompts_prefilled')
    measured.append((kind, engine_s, seqs, '-' if run is None else f'{run - before:,}'))
    eng.clear()  # its cache: the next one and the reference allocate their own
  run = reference(c, params, n, P, M, T)
  ref_s, ref_tokens = timed(lambda: np.asarray(run(prompts)), _REPEATS.value)
  lines = []
  for kind, engine_s, seqs, prefilled in measured:
    same = np.mean([a == b for s, row in zip(seqs, ref_tokens) for a, b in zip(s.tokens, row)])
    name = 'engine (jax_pretrain)' + ('' if kind == 'auto' else f', {kind} KV cache')
    if kind == 'json':
      name = f'engine, {_CONSTRAINED.value} of {n} constrained'
      lines.append(f'constrained: {_CONSTRAINED.value} of {n} sequences, time / unconstrained '
                   f'engine: {engine_s / measured[0][1]:.2f}')
    if _MARKDOWN.value:
      lines.append(f'| {name} | {n} × ({P} + {M}) | {slots} | {n * M / engine_s:,.0f} | '
                   f'{n * M / ref_s:,.0f} | {engine_s / ref_s:.2f} | {same:.1%} |')
    else:
      lines.append(f'{kind:>5}  {n:>9}  {slots:>5}  {n * M / engine_s:>12,.0f}  '
                   f'{n * M / ref_s:>15,.0f}  {engine_s / ref_s:>23.2f}  {prefilled:>12}  '
                   f'{same:>11.1%}')
  return lines


def _grammar():
  """A JSON schema no sequence completes within --new_tokens: an array of at least 1,000
  objects (each a few fields of each kind), compiled for the byte tokenizer's ids."""
  from jax_pretrain.data import tokenizer as tokenizer_lib
  from jax_pretrain.engine import grammar as grammar_lib
  item = {'type': 'object', 'required': ['name', 'n', 'ok', 'tags'], 'properties': {
      'name': {'type': 'string'}, 'n': {'type': 'integer'}, 'ok': {'type': 'boolean'},
      'tags': {'type': 'array', 'items': {'enum': ['a', 'bc', 'def']}}}}
  return grammar_lib.Grammars(tokenizer_lib.ByteTokenizer()).json_schema(
      {'type': 'array', 'items': item, 'minItems': 1000})


def main():
  import jax
  import numpy as np

  from jax_pretrain import config as config_lib
  from jax_pretrain import model as model_lib

  devices = jax.devices()[:1]
  resolved, _ = config_lib.resolve(cli.config_value(_CONFIG), 1, device=devices[0])
  c = resolved.model
  params = jax.jit(model_lib.Transformer(c).init)(
      jax.random.key(0), np.zeros((1, 8), np.int32))['params']
  params = jax.tree.map(lambda x: getattr(x, 'value', x), params,
                        is_leaf=lambda x: hasattr(x, 'value'))
  print(f'{jax.devices()[0].device_kind}, jax {jax.__version__}: {c.num_layers} layers × '
        f'{c.d_model}, {model_lib.count_params(params):,} parameters, {c.dtype}; prompts of '
        f'{_PROMPT.value} tokens + {_NEW.value} new, temperature {_TEMPERATURE.value}, '
        f'{_SAMPLES.value} sequences a prompt')
  if _MARKDOWN.value:
    print(f'\n{MARKDOWN_HEADER}')
  else:
    print(f'{"KV":>5}  {"sequences":>9}  {"slots":>5}  {"engine tok/s":>12}  '
          f'{"reference tok/s":>15}  {"engine / reference time":>23}  {"prompts run":>12}  '
          f'{"same tokens":>11}')
  for n in _SEQUENCES.value:
    print('\n'.join(measure(c, params, int(n))), flush=True)


if __name__ == '__main__':
  cli.run(main)
