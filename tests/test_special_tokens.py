"""A tokenizer whose files name EOS as the pad token (GPT-2-derived checkpoints, many instruct
models): pad gets an id of its own, so EOS is trained (the loss drops only pad targets) and sampled
(the engine never draws pad): completions end at EOS, and GRPO's rows end with it."""
import dataclasses
import json
import os

from flax.linen import meta
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import engine as engine_lib
from jax_pretrain import model as model_lib
from jax_pretrain import state as state_lib
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.grpo import rollout

pytest.importorskip('tokenizers')

EOS = tokenizer_lib.BYTE_LEVEL_EOS


@pytest.fixture(scope='module')
def pad_is_eos(tmp_path_factory):
  """A byte-level BPE whose tokenizer_config.json names its EOS as pad (and as BOS)."""
  directory = tmp_path_factory.mktemp('tok') / 'gpt2_like'
  tokenizer_lib.train_bytelevel_bpe(['the cat sat on the mat'] * 20,
                                    str(directory / 'tokenizer.json'), 300)
  with open(directory / 'tokenizer_config.json', 'w', encoding='utf-8') as f:
    json.dump({'bos_token': EOS, 'eos_token': EOS, 'pad_token': EOS}, f)
  return str(directory)


def test_pad_named_as_eos_gets_an_id_of_its_own_and_the_record_keeps_it(pad_is_eos, tmp_path):
  tok = tokenizer_lib.load(pad_is_eos)
  assert (tok.bos_id, tok.eos_id) == (0, 0)
  assert tok.pad_id == tok.num_pieces and tok.vocab_size == tok.num_pieces + 1
  tokenizer_lib.save(tok, str(tmp_path / 'run'))  # as a run keeps it (WORKDIR/tokenizer/)
  back = tokenizer_lib.load(str(tmp_path / 'run'))
  assert (back.bos_id, back.eos_id, back.pad_id, back.identity) == (
      tok.bos_id, tok.eos_id, tok.pad_id, tok.identity)
  # A record written before the fix (pad 0 = EOS) still loads, with pad moved off EOS.
  rec = dict(tokenizer_lib.record(tok), pad_id=0, tokenizer=tok.former_identity)
  old = tokenizer_lib.from_record(rec, str(tmp_path / 'run'), 'old record')
  assert (old.eos_id, old.pad_id) == (0, tok.pad_id)
  # The same for a pad named as BOS only, for sentencepiece-style ids, and for bare ids.
  assert tokenizer_lib.IdTokenizer(100, eos_id=5, pad_id=5).pad_id == 100
  assert tokenizer_lib.IdTokenizer(100, eos_id=5, bos_id=7, pad_id=7).pad_id == 100
  assert tokenizer_lib.IdTokenizer(100, eos_id=5, pad_id=9).pad_id == 9


def test_eos_targets_count_in_the_loss(pad_is_eos):
  tok = tokenizer_lib.load(pad_is_eos)
  config, _ = config_lib.resolve(config_lib.preset('test'), num_devices=1, backend='cpu',
                                 tokenizer_vocab_size=tok.vocab_size)
  model = model_lib.Transformer(config.model)
  doc = tok.encode('the cat sat').tolist()
  row = [tok.eos_id, *doc, tok.eos_id, *doc, tok.eos_id]
  row += [tok.pad_id] * (17 - len(row))
  params = meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))['params'])
  _, count = state_lib.make_loss_fn(model, tok.pad_id)(params, jnp.asarray([row], jnp.int32))
  # Every target but the padding: both EOS that end a document included.
  assert int(count) == len(row) - 1 - row.count(tok.pad_id) == 2 * len(doc) + 2


def _eos_model(tok):
  """The test model rigged to predict EOS: every token embeds to the same direction (EOS's row 10
  times longer), the blocks add nothing, so EOS's logit is 10 times every other's."""
  config, _ = config_lib.resolve(config_lib.preset('test'), num_devices=1, backend='cpu',
                                 tokenizer_vocab_size=tok.vocab_size)
  cfg = config.model
  params = meta.unbox(jax.jit(model_lib.Transformer(cfg).init)(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params'])
  params = jax.tree.map(np.array, params)  # (writable copies)
  table = np.ones((cfg.vocab_size, cfg.d_model), np.float32)
  table[tok.eos_id] *= 10
  params['embedding'] = table
  params['layers']['attn']['wo'] *= 0  # (every layer's: the layers are stacked)
  params['layers']['mlp']['w_down'] *= 0
  assert cfg.tie_embeddings
  return cfg, params


def test_the_engine_samples_eos_and_stops_there_and_grpo_trains_on_it(pad_is_eos):
  tok = tokenizer_lib.load(pad_is_eos)
  cfg, params = _eos_model(tok)
  eng = engine_lib.Engine(cfg, params, tok, slots=4, context=64)
  prompt = tok.encode('the cat').tolist()
  done = eng.generate([engine_lib.Sequence(prompt=prompt, max_new_tokens=8, temperature=1.0,
                                           seed=s) for s in range(3)])
  for seq in done:  # ended by EOS at once, not by the length
    assert (seq.finish_reason, seq.tokens, seq.text) == ('stop', [], '')
    assert seq.eos_logprob is not None and seq.eos_logprob > -1e-3
  r = rollout.rollouts(eng, [prompt], 2, max_new_tokens=8, temperature=1.0, seed=0,
                       pad_id=tok.pad_id, eos_id=tok.eos_id)
  P = len(prompt)
  np.testing.assert_array_equal(r.tokens_BxT1, [[*prompt, tok.eos_id]] * 2)
  np.testing.assert_array_equal(r.mask_BxT[:, P - 1], [1, 1])  # the EOS is a trained target
  np.testing.assert_array_equal(r.lengths, [1, 1])


def test_an_imported_checkpoint_whose_pad_is_eos_gets_a_pad_row_of_its_own(pad_is_eos, tmp_path):
  from jax_pretrain import hf  # noqa: PLC0415
  from jax_pretrain import workdir as workdir_lib  # noqa: PLC0415
  tok = tokenizer_lib.load(pad_is_eos)
  config, _ = config_lib.resolve(config_lib.preset('test'), num_devices=1, backend='cpu')
  c = dataclasses.replace(config.model, vocab_size=tok.num_pieces)  # as GPT-2's: no spare row
  params = meta.unbox(model_lib.Transformer(c).init(jax.random.key(0),
                                                    jnp.zeros((1, 8), jnp.int32))['params'])
  hf.save(str(tmp_path / 'hf'), jax.tree.map(np.asarray, params), c, max_position_embeddings=32)
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    with open(os.path.join(pad_is_eos, name), 'rb') as src, open(tmp_path / 'hf' / name,
                                                                   'wb') as dst:
      dst.write(src.read())
  hf.import_run(str(tmp_path / 'hf'), str(tmp_path / 'run'), config_lib.preset('test'))
  run = workdir_lib.load(str(tmp_path / 'run'))
  assert (run.tokenizer.eos_id, run.tokenizer.pad_id) == (tok.eos_id, tok.num_pieces)
  assert run.config.model.vocab_size > run.tokenizer.pad_id  # the embedding has room for it
