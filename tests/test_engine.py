"""The engine's programs move what a decode needs and no more (the cache written in place, split
over a mesh's devices, the live window read), its rows decode the same anywhere, and its
incremental detokenization gives the tokenizer's own text."""
import json
from pydoc_data import topics
import random
import re
import threading

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jax_pretrain import engine
from jax_pretrain import hlo
from jax_pretrain import model as model_lib
from jax_pretrain import sharding
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.engine import grammar as grammar_lib
from jax_pretrain.engine import runner
from jax_pretrain.grpo import rollout
from tests.conftest import tiny_model


@pytest.fixture(scope='module')
def tiny():
  return tiny_model()


def _layer_bytes(cfg, slots: int, context: int) -> int:
  return slots * context * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def _compiled_decode(cfg, params, slots: int, context: int, live: int):
  eng = engine.Engine(cfg, params, tokenizer_lib.ByteTokenizer(), slots=slots, context=context)
  return eng, eng.lower_decode(slots, live=live).compile()


def test_decode_updates_the_cache_in_place_and_reads_the_live_window(tiny):
  cfg, params = tiny
  slots, context = 16, 1024
  eng, compiled = _compiled_decode(cfg, params, slots, context, live=64)
  text = compiled.as_text()
  layer = _layer_bytes(cfg, slots, context)
  m = compiled.memory_analysis()
  # Every cache buffer (2 a layer) and the logits are outputs written into their donated inputs.
  aliases = re.search(r'input_output_alias=\{(.*?)\}, entry', text).group(1)
  assert aliases.count('may-alias') + aliases.count('must-alias') >= 2 * cfg.num_layers + 1
  assert m.alias_size_in_bytes >= 2 * cfg.num_layers * layer
  # No copy of a cache buffer anywhere; temporaries far below one buffer, and the same for a
  # cache 4 times shorter: nothing in them grows with the cache.
  shape = f'[{slots},{context},{cfg.num_kv_heads},{cfg.head_dim}]'
  assert not [line for line in text.splitlines() if shape in line and ' copy(' in line]
  assert m.temp_size_in_bytes < layer / 4
  shorter = _compiled_decode(cfg, params, slots, context // 4, live=64)[1]
  assert shorter.memory_analysis().temp_size_in_bytes == m.temp_size_in_bytes
  # What a call moves depends on the live window it reads (64 positions), not on the cache's
  # length; a wider window moves more.
  moved = lambda c: hlo.analyze(c.as_text(), unknown_trips=eng.chunk).hbm_bytes
  assert moved(shorter) == moved(compiled)
  assert moved(_compiled_decode(cfg, params, slots, context, live=256)[1]) > moved(compiled)


@pytest.mark.parametrize('kv_cache_dtype', ['auto', 'int8'])
def test_on_a_mesh_each_device_holds_and_decodes_its_slots(tiny, kv_cache_dtype):
  """And an 8-bit cache's scales split with its rows: the same tokens as on one device."""
  cfg, params = tiny
  mesh = sharding.make_mesh((2, 2, 2), jax.devices()[:8])
  replicated = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.P()))
  eng = engine.Engine(cfg, replicated, tokenizer_lib.ByteTokenizer(), slots=16, context=64,
                      mesh=mesh, kv_cache_dtype=kv_cache_dtype)
  assert (eng.slots, eng.local_slots, eng.devices) == (16, 2, 8)
  for x in jax.tree.leaves(eng.runner.state().cache):
    assert x.sharding.shard_shape(x.shape) == (2, 64, cfg.num_kv_heads, cfg.head_dim)[:x.ndim]
  compiled = eng.lower_decode(2, live=64).compile()
  # The per-device program's cache parameters are its 2 slots; it gathers only the new tokens.
  assert f'[2,64,{cfg.num_kv_heads},{cfg.head_dim}]' in compiled.as_text()
  assert f'[16,64,{cfg.num_kv_heads},{cfg.head_dim}]' not in compiled.as_text()
  stats = hlo.analyze(compiled.as_text(), unknown_trips=eng.chunk)
  assert {k for k, c in stats.collectives.items() if c.count} == {'all-gather'}

  # The same sequences decode to the same tokens as on one device with 4 slots (other slots,
  # other neighbours, other devices).
  def run(eng):
    seqs = [engine.Sequence(prompt=list(range(1, 2 + i % 7)), max_new_tokens=5 + i % 13,
                            temperature=1.0, seed=7, stream=i, top_p=0.9 if i % 3 == 0 else 1.0)
            for i in range(20)]
    eng.generate(seqs)
    return seqs

  one = run(engine.Engine(cfg, params, tokenizer_lib.ByteTokenizer(), slots=4, context=64,
                          kv_cache_dtype=kv_cache_dtype))
  many = run(eng)
  assert [s.tokens for s in one] == [s.tokens for s in many]
  np.testing.assert_allclose(np.concatenate([s.logprobs for s in one]),
                             np.concatenate([s.logprobs for s in many]), atol=1e-5)


@pytest.mark.parametrize('n, bucket', [(1, 16), (16, 16), (17, 24), (25, 32), (33, 48),
                                       (49, 64), (513, 768), (769, 1024), (1025, 1100)])
def test_live_buckets_waste_at_most_a_third(n, bucket):
  assert engine.live_bucket(n, 1100) == bucket


def test_hlo_charges_in_place_scatters_and_slices_as_executed():
  x = jnp.zeros((1024, 1024), jnp.float32)  # 4 MiB
  scatter = jax.jit(lambda x, i, r: x.at[i].set(r), donate_argnums=0)
  text = scatter.lower(x, 3, jnp.ones(1024)).compile().as_text()
  assert hlo.analyze(text).hbm_bytes < 4 * 4096  # the row written (and read), not the buffer
  sliced = jax.jit(lambda x: jnp.sum(x[:16] * 2, axis=0))
  assert hlo.analyze(sliced.lower(x).compile().as_text()).hbm_bytes < 4 * 16 * 4096


def _tokenizers(tmp_path):
  texts = [topics.topics[k] for k in sorted(topics.topics)[:60]]
  yield tokenizer_lib.ByteTokenizer()
  yield tokenizer_lib.train_sentencepiece(texts, str(tmp_path / 'sp.model'), 400)
  yield tokenizer_lib.train_bytelevel_bpe(texts, str(tmp_path / 'bpe' / 'tokenizer.json'), 400)


def test_incremental_detokenization_gives_the_tokenizers_text(tmp_path):
  rng = random.Random(0)
  texts = ['The for statement  is used to iterate', 'naïve café — 東京 🙂 x = 1\n\ty', ' a  b ']
  for tok in _tokenizers(tmp_path):
    streams = [[int(t) for t in tok.encode(text)] for text in texts]
    streams.append([rng.randrange(tok.vocab_size) for _ in range(60)])  # any ids at all
    for ids in streams:
      seq = engine.Sequence(prompt=[0], max_new_tokens=len(ids))
      shown = ''
      while len(seq.tokens) < len(ids):
        seq.tokens += ids[len(seq.tokens):len(seq.tokens) + rng.randrange(1, 4)]
        text = seq.detokenize(tok)
        assert text.startswith(shown)  # text once shown never changes
        shown = text
      whole = tok.decode(ids)
      assert whole.startswith(shown) and '\ufffd' not in whole[len(shown):] or shown == whole
      assert seq.detokenize(tok, final=True) == whole


def test_a_stop_string_before_an_unfinished_character_ends_the_sequence_at_once(tiny):
  """Bytes of 'ab\\n東京xyz' in chunks of 4 with stop '\\n': the chunk that writes the newline
  also starts a 3-byte character, whose text is not complete yet; the sequence still ends there,
  keeping no token after the one that completed the stop string (GRPO trains on those tokens)."""
  cfg, params = tiny
  tok = tokenizer_lib.ByteTokenizer()
  eng = engine.Engine(cfg, params, tok, slots=1, context=64)
  ids = [int(t) for t in tok.encode('ab\n東京xyz')]
  seq = engine.Sequence(prompt=[0], max_new_tokens=len(ids), stop=('\n',))
  for start in range(0, len(ids), 4):
    chunk = np.asarray(ids[start:start + 4])
    eng.output.extend(seq, chunk, np.zeros(len(chunk), np.float32), None, None)
    if seq.done:
      break
  assert (seq.finish_reason, seq.text, seq.tokens) == ('stop', 'ab', ids[:3])
  assert len(seq.logprobs) == 3


class _RaisesOn(tokenizer_lib.ByteTokenizer):
  """The byte tokenizer, but its decode raises on any ids that hold `bad`."""

  def __init__(self, bad: int):
    self.bad = bad

  def decode(self, ids) -> str:
    if self.bad in list(ids):
      raise ValueError(f'cannot decode {self.bad}')
    return super().decode(ids)


PROMPTS = [[72, 101, 108], [1, 2, 3], [200, 5], [9]]


def _greedy(prompts, max_new_tokens=12, **kw):
  return [engine.Sequence(prompt=list(p), max_new_tokens=max_new_tokens, **kw) for p in prompts]


def test_a_sequence_whose_handling_raises_fails_alone(tiny):
  """A tokenizer that raises on a token of one sequence: that sequence fails, the others decode
  their tokens; it is no failure of the engine (run_forever with max_failures=1 goes on)."""
  cfg, params = tiny
  fine = engine.Engine(cfg, params, tokenizer_lib.ByteTokenizer(), slots=4, context=64,
                       chunk=4).generate(_greedy(PROMPTS))
  bad = next(t for t in fine[0].tokens if all(t not in s.tokens for s in fine[1:]))
  eng = engine.Engine(cfg, params, _RaisesOn(bad), slots=4, context=64, chunk=4)
  seqs = eng.generate(_greedy(PROMPTS))
  assert seqs[0].finish_reason == 'error' and seqs[0].error == f'ValueError: cannot decode {bad}'
  assert [s.tokens for s in seqs[1:]] == [s.tokens for s in fine[1:]]
  assert [s.text for s in seqs[1:]] == [s.text for s in fine[1:]]
  assert eng.stats()['busy'] == 0

  ended, done = [], threading.Event()

  def serve():
    try:
      eng.run_forever(max_failures=1)
    except Exception as e:  # noqa: BLE001  (what the test looks at)
      ended.append(e)

  def on_update(seq):
    if all(s.done for s in seqs):
      done.set()

  thread = threading.Thread(target=serve)
  thread.start()
  seqs = _greedy(PROMPTS, on_update=on_update)
  for seq in seqs:
    eng.submit(seq)
  assert done.wait(120)
  assert not eng.stopped and thread.is_alive()
  eng.stop()
  thread.join(60)
  assert ended == [] and seqs[0].finish_reason == 'error'
  assert [s.tokens for s in seqs[1:]] == [s.tokens for s in fine[1:]]


@pytest.mark.parametrize('max_new_tokens', [3, 12])  # (3: every token in the first call)
def test_a_failed_generate_frees_its_slots(tiny, monkeypatch, max_new_tokens):
  cfg, params = tiny
  eng = engine.Engine(cfg, params, tokenizer_lib.ByteTokenizer(), slots=2, context=64, chunk=4)
  expected = [s.tokens for s in eng.generate(_greedy(PROMPTS, max_new_tokens))]
  decode = eng.runner.decode

  def fails(*args):
    raise RuntimeError('broken')

  monkeypatch.setattr(eng.runner, 'decode', fails)
  seqs = _greedy(PROMPTS, max_new_tokens)  # 4 sequences, 2 slots: two wait
  with pytest.raises(RuntimeError, match='broken'):
    eng.generate(seqs)
  assert all(s.finish_reason == 'error' and s.error == 'RuntimeError: broken' for s in seqs)
  assert eng.stats()['busy'] == eng.stats()['waiting'] == 0
  monkeypatch.setattr(eng.runner, 'decode', decode)
  assert [s.tokens for s in eng.generate(_greedy(PROMPTS, max_new_tokens))] == expected


def _mixed(on_update=None):
  """Sequences of every kind: greedy and sampled (top-k, top-p), short and long, stop strings,
  alternatives; more of them than slots, so that some join while others decode."""
  return [engine.Sequence(prompt=[(7 * i + j) % 250 + 1 for j in range(1 + i % 9)],
                          max_new_tokens=3 + (5 * i) % 17, temperature=(i % 3) * 0.7, seed=11,
                          stream=i, top_k=5 if i % 4 == 1 else 0, top_p=0.8 if i % 5 == 2 else 1.0,
                          stop=('e',) if i % 6 == 5 else (), alternatives=i % 7 == 3,
                          on_update=on_update) for i in range(14)]


def test_each_row_decodes_what_it_decodes_alone_and_the_next_call_goes_before_the_read(tiny):
  """A sequence's tokens do not depend on its neighbours, on when it was admitted or on the
  calls in flight; the host reads a call's tokens only after it has dispatched the next one."""
  cfg, params = tiny
  tok = tokenizer_lib.ByteTokenizer()
  alone = [engine.Engine(cfg, params, tok, slots=1, context=64, chunk=4).generate([seq])[0]
           for seq in _mixed()]
  eng = engine.Engine(cfg, params, tok, slots=4, context=64, chunk=4)
  events = []
  decode, read = eng.runner.decode, eng.runner.read
  eng.runner.decode = lambda call: events.append('decode') or decode(call)
  eng.runner.read = lambda out: events.append('read') or read(out)
  together = eng.generate(_mixed())
  assert [s.tokens for s in together] == [s.tokens for s in alone]
  assert [(s.text, s.finish_reason) for s in together] == [(s.text, s.finish_reason) for s in alone]
  logprobs = lambda seqs: np.concatenate([[*s.logprobs, s.eos_logprob or 0.0] for s in seqs])
  np.testing.assert_allclose(logprobs(together), logprobs(alone), atol=1e-5)
  assert {s.finish_reason for s in together} == {'length', 'stop'}
  top = lambda seqs: [[[i for i, _ in t] for t in s.top_logprobs] for s in seqs]
  assert top(together) == top(alone)
  assert [len(s.top_logprobs) for s in together] == [
      len(s.tokens) if s.alternatives else 0 for s in together]
  # Every read but the last comes after the next call's dispatch: decode, decode, read, ...
  assert events[:2] == ['decode', 'decode'] and events.count('read') >= 4
  reads = [i for i, e in enumerate(events) if e == 'read']
  assert all(events[i - 1] == 'decode' for i in reads[:-1]), events
  assert eng.stats()['busy'] == 0


def test_the_engines_params_fuse_the_projections_and_leave_the_models_alone(tiny):
  """decoding_params: each layer's query, key and value one matrix and its gate and up one, read
  in one matmul each; the model's params (the trainer's, a checkpoint's) are not touched."""
  cfg, params = tiny
  before = jax.tree.map(np.array, params)
  decoding = runner.decoding_params(cfg, params)
  D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  for i in range(cfg.num_layers):
    attn, mlp = decoding[f'layers_{i}']['attn'], decoding[f'layers_{i}']['mlp']
    assert set(attn) == {'wqkv', 'wo'} and set(mlp) == {'w_gate_up', 'w_down'}
    assert attn['wqkv'].shape == (D, N + 2 * K, H) and mlp['w_gate_up'].shape == (D, 2, F)
    layer = jax.tree.map(lambda x, i=i: x[i], params['layers'])
    np.testing.assert_array_equal(attn['wqkv'], np.concatenate(
        [layer['attn'][w] for w in ('wq', 'wk', 'wv')], axis=1))
    np.testing.assert_array_equal(mlp['w_gate_up'][:, 1], layer['mlp']['w_up'])
  jax.tree.map(np.testing.assert_array_equal, params, before)
  # The engine scores (lm_eval, echoed prompts) with its copy as the model does with its params.
  tokens = np.array([[256, 72, 101, 108, 108, 111, 32, 119]])
  eng = engine.Engine(cfg, params, tokenizer_lib.ByteTokenizer(), slots=1, context=16)
  np.testing.assert_allclose(eng.score(tokens)[0], engine.token_logprobs(
      model_lib.Transformer(cfg), params, tokens)[0], atol=1e-5)


def test_the_completions_of_one_prompt_share_its_prefill(tiny):
  """GRPO's rollouts: a prompt is run through the model once for its num_samples completions (its
  keys and values copied into their slots), and the rollouts are those of a prefill each."""
  cfg, params = tiny
  tok = tokenizer_lib.ByteTokenizer()
  prompts = [[72, 101, 108, 108], [1, 2, 3], [200, 5, 9, 9, 9, 9, 1]]
  kw = {'max_new_tokens': 10, 'temperature': 1.0, 'seed': 5, 'pad_id': tok.pad_id,
        'eos_id': tok.eos_id}
  shared = engine.Engine(cfg, params, tok, slots=8, context=64, chunk=4)
  r = rollout.rollouts(shared, prompts, 4, **kw)
  assert shared.stats()['prompts_prefilled'] == 3  # (12 completions in waves of 8 slots)
  alone = engine.Engine(cfg, params, tok, slots=1, context=64, chunk=4)
  expected = rollout.rollouts(alone, prompts, 4, **kw)
  assert alone.stats()['prompts_prefilled'] == 12
  np.testing.assert_array_equal(r.tokens_BxT1, expected.tokens_BxT1)
  np.testing.assert_allclose(r.logp_BxT, expected.logp_BxT, atol=1e-5)
  assert r.completions == expected.completions and len(set(r.completions)) > 3


def _penalized_reference(logits_V, generated, presence, frequency, bias):
  """vLLM's logits processing in float64: logit_bias added, then the penalties over the output
  tokens so far (presence where a token occurred, frequency × its count)."""
  out = np.asarray(logits_V, np.float64).copy()
  for token, b in bias:
    out[token] += b
  counts = np.bincount(np.asarray(generated, np.int64), minlength=len(out)).astype(np.float64)
  return out - frequency * counts - presence * (counts > 0)


def test_penalized_is_the_numpy_reference():
  rng = np.random.default_rng(0)
  B, V, K = 4, 50, engine.MAX_LOGIT_BIAS
  logits = rng.normal(size=(B, V)).astype(np.float32)
  generated = [rng.integers(0, V, size=n).tolist() for n in (0, 7, 30, 3)]
  presence, frequency = np.float32([0.0, 0.5, -1.5, 2.0]), np.float32([0.0, 0.3, 1.0, -0.7])
  bias = [[], [(3, 5.0), (10, -100.0)], [(0, 1.5)], [(V - 1, 100.0), (3, -2.0), (7, 0.25)]]
  counts = np.stack([np.bincount(g, minlength=V) for g in generated]).astype(np.int32)
  bias_ids, bias_values = np.zeros((B, K), np.int32), np.zeros((B, K), np.float32)
  for b, pairs in enumerate(bias):
    for k, (token, value) in enumerate(pairs):
      bias_ids[b, k], bias_values[b, k] = token, value
  ours = np.asarray(engine.penalized(logits, counts, presence, frequency, bias_ids, bias_values))
  for b in range(B):
    np.testing.assert_allclose(ours[b], _penalized_reference(
        logits[b], generated[b], presence[b], frequency[b], bias[b]), atol=1e-5)
  np.testing.assert_array_equal(ours[0], logits[0])  # (nothing asked: the logits as they are)
  # A grammar's bitmask (bit i % 32 of word i // 32: id i allowed): -inf elsewhere; all set: none.
  allowed_BxV = rng.random((B, V)) < 0.3
  allowed_BxV[0] = True
  mask_BxW = np.packbits(np.pad(allowed_BxV, ((0, 0), (0, 64 - V))), axis=1,
                         bitorder='little').view(np.int32)
  masked = np.asarray(engine.penalized(logits, counts, presence, frequency, bias_ids, bias_values,
                                       mask_BxW))
  np.testing.assert_array_equal(masked, np.where(allowed_BxV, ours, -np.inf))


def test_greedy_rows_with_penalties_and_logit_bias_follow_the_numpy_reference(tiny):
  """Each row's own presence/frequency penalty and logit_bias, applied on the device over its own
  output tokens, decoded together (2 slots, 6 sequences: slots reused; 2 of one prompt: copies of
  its prefill): each greedy token is the argmax of the float64 reference's processed logits, the
  logprobs reported are the model's own (vLLM's default), and the penalties change the text."""
  cfg, params = tiny
  tok = tokenizer_lib.ByteTokenizer()
  prompt = [72, 101, 108]
  plain = engine.Engine(cfg, params, tok, slots=1, context=64, chunk=4).generate(
      _greedy([prompt], max_new_tokens=16))[0].tokens
  settings = [dict(), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
              dict(logit_bias=((plain[0], -100.0), (plain[1], 3.0))),
              dict(presence_penalty=-0.5, frequency_penalty=0.8, logit_bias=((65, 4.0),)),
              dict(frequency_penalty=1.5)]
  prompts = [prompt] * 4 + [[1, 2, 3], [1, 2, 3]]
  eng = engine.Engine(cfg, params, tok, slots=2, context=64, chunk=4)
  seqs = eng.generate([engine.Sequence(prompt=list(p), max_new_tokens=16, **kw)
                       for p, kw in zip(prompts, settings)])
  model = model_lib.Transformer(cfg)
  for seq, kw in zip(seqs, settings):
    ids = seq.prompt + seq.tokens
    logits_TxV = np.asarray(model.apply({'params': params}, np.asarray([ids]))[0], np.float64)
    logits_TxV[:, tok.vocab_size:] = -np.inf
    logits_TxV[:, tok.pad_id] = -np.inf
    for i, token in enumerate(seq.tokens):
      raw_V = logits_TxV[len(seq.prompt) - 1 + i]
      processed_V = _penalized_reference(raw_V, seq.tokens[:i], kw.get('presence_penalty', 0.0),
                                         kw.get('frequency_penalty', 0.0),
                                         kw.get('logit_bias', ()))
      assert processed_V[token] >= processed_V.max() - 1e-4, (kw, i)
      raw_logprobs = raw_V - np.logaddexp.reduce(raw_V[np.isfinite(raw_V)])
      assert seq.logprobs[i] == pytest.approx(raw_logprobs[token], abs=1e-4)
  assert seqs[0].tokens == plain
  assert all(s.tokens != plain for s in seqs[1:4])
  assert len(set(seqs[1].tokens)) > len(set(plain)) and plain[0] not in seqs[3].tokens
  assert 65 in seqs[4].tokens and 65 not in plain  # (its bias of +4)


def test_extra_eos_ids_end_a_sequence_as_eos_does(tiny):
  """A generation_config.json's EOS ids: the sequence ends before the first (finish 'stop'), its
  logprob kept as EOS's."""
  cfg, params = tiny
  tok = tokenizer_lib.ByteTokenizer()
  plain = engine.Engine(cfg, params, tok, slots=1, context=64, chunk=4).generate(
      _greedy([PROMPTS[0]], max_new_tokens=16))[0]
  end = plain.tokens[5]
  first = plain.tokens.index(end)
  [seq] = engine.Engine(cfg, params, tok, slots=1, context=64, chunk=4,
                        eos_ids=(end, tok.eos_id)).generate(_greedy([PROMPTS[0]], 16))
  assert seq.tokens == plain.tokens[:first] and seq.finish_reason == 'stop'
  assert seq.eos_logprob == pytest.approx(plain.logprobs[first], abs=1e-5)


SCHEMA = {'type': 'object', 'additionalProperties': False, 'required': ['name', 'n', 'ok', 'kind'],
          'properties': {'name': {'type': 'string', 'maxLength': 6},
                         'n': {'type': 'integer', 'minimum': 0, 'maximum': 99},
                         'ok': {'type': 'boolean'}, 'kind': {'enum': ['a', 'bc']}}}


def _allowed(grammar, tokens, vocab_size):
  """bool [len(tokens), vocab_size]: what a fresh matcher of the grammar allows before each token
  (each token must be allowed: it is then taken)."""
  matcher, mask_1xW, rows = grammar.matcher(), np.zeros((1, (vocab_size + 31) // 32), np.int32), []
  for token in tokens:
    matcher.fill(mask_1xW, 0)
    rows.append(np.unpackbits(mask_1xW.view(np.uint8), bitorder='little')[:vocab_size] > 0)
    assert rows[-1][token], token
    matcher.advance(token)
  return np.stack(rows)


def test_constrained_and_free_rows_decode_together(tiny, tmp_path):
  """With each kind of tokenizer (bytes, sentencepiece, byte-level BPE), a model with random
  weights: every token of a constrained row is one its grammar allows (a fresh matcher replays
  it), a greedy one is the argmax of the float64 reference's logits over the allowed ids, each
  answer is JSON that validates against the schema (jsonschema) and ends when the grammar is
  complete; the free rows decoded beside them (greedy and sampled) are what they are alone."""
  cfg, params = tiny
  texts = [topics.topics[k].encode('ascii', 'ignore').decode()
           for k in sorted(topics.topics)[:60]]
  model = model_lib.Transformer(cfg)  # (its 384 ids: the tokenizers' 360, 300 and 259)
  for tok in [tokenizer_lib.ByteTokenizer(),
              tokenizer_lib.train_sentencepiece(texts, str(tmp_path / 'sp.model'), 360),
              tokenizer_lib.train_bytelevel_bpe(texts, str(tmp_path / 'bpe/tokenizer.json'), 300)]:
    grammar = grammar_lib.Grammars(tok).json_schema(SCHEMA)
    prompt = [int(t) for t in tok.encode('Answer in JSON:')][:8]
    free = lambda: [engine.Sequence(prompt=[5, 6, 7], max_new_tokens=12),
                    engine.Sequence(prompt=[9], max_new_tokens=20, temperature=1.0, seed=3)]
    constrained = [engine.Sequence(prompt=prompt, max_new_tokens=56, temperature=t, seed=s,
                                   grammar=grammar.matcher()) for t, s in ((0, 0), (1.0, 1))]
    alone = [engine.Engine(cfg, params, tok, slots=4, context=64, chunk=4).generate([seq])[0]
             for seq in free()]
    eng = engine.Engine(cfg, params, tok, slots=4, context=64, chunk=4)
    together = eng.generate([constrained[0], *free(), constrained[1]])
    assert [s.tokens for s in together[1:3]] == [s.tokens for s in alone]
    for seq in constrained:
      assert seq.finish_reason == 'stop', (tok, seq.text)
      jsonschema.validate(json.loads(seq.text), SCHEMA)
      allowed_TxV = _allowed(grammar, seq.tokens, cfg.vocab_size)
      assert not allowed_TxV.all(axis=1).any()  # (the grammar cut something at every step)
    seq = constrained[0]
    logits_TxV = np.asarray(model.apply({'params': params}, np.asarray(
        [seq.prompt + seq.tokens]))[0], np.float64)[len(seq.prompt) - 1:-1]
    reference = np.where(_allowed(grammar, seq.tokens, cfg.vocab_size), logits_TxV, -np.inf)
    np.testing.assert_array_equal(seq.tokens, reference.argmax(axis=1))
