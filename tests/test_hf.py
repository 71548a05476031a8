"""Hugging Face export/import: import(export(params)) is the identity (library and command lines);
with torch and transformers installed, the exported model's logits equal ours and its tokenizer
gives our ids (skipped without them: see docs/use.md to run it)."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from flax.linen import meta
import numpy as np
import pytest
from safetensors.numpy import load_file

from jax_pretrain import config as config_lib
from jax_pretrain import hf
from jax_pretrain import model as model_lib
from jax_pretrain.data import corpus
from jax_pretrain.data import tokenizer as tokenizer_lib
from tests.conftest import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def preset_config(**overrides) -> model_lib.ModelConfig:
  config, _ = config_lib.resolve(config_lib.preset('test'), num_devices=1, backend='cpu')
  return dataclasses.replace(config_lib.model_config(config), **overrides)


def random_params(c: model_lib.ModelConfig, seed=0):
  """Random float32 params, norm scales included (init sets them to 1), as numpy arrays."""
  abstract = jax.eval_shape(model_lib.Transformer(c).init, jax.random.key(0),
                            jnp.zeros((1, 1), jnp.int32))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(meta.unbox(abstract['params']))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      np.asarray((path[-1].key == 'scale') + 0.1 * jax.random.normal(k, x.shape))
      for k, (path, x) in zip(keys, leaves)])


def assert_same_params(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.parametrize('tie', [True, False])
def test_import_of_export_is_identity(tmp_path, tie):
  c = preset_config(tie_embeddings=tie)
  params = random_params(c)
  hf.save(str(tmp_path), params, c, max_position_embeddings=32)
  config, tensors = hf.load(str(tmp_path))
  assert config['architectures'] == ['LlamaForCausalLM']
  assert ('lm_head.weight' in tensors) == (not tie)
  assert tensors['model.layers.1.self_attn.q_proj.weight'].shape == (
      c.num_heads * c.head_dim, c.d_model)
  fields = hf.model_fields(config)
  assert dataclasses.replace(c, **fields) == c
  assert_same_params(hf.from_hf(tensors, c), params)
  # The unscanned layout (layers_0, layers_1, ...) maps to the same tensors and back.
  unscanned = hf.from_hf(tensors, dataclasses.replace(c, scan_layers=False))
  assert set(unscanned) >= {'layers_0', 'layers_1'} and 'layers' not in unscanned
  out = hf.to_hf(unscanned, c)
  assert out.keys() == tensors.keys() and all(np.array_equal(out[k], tensors[k]) for k in out)


def test_model_fields_refuses_what_our_model_cannot_compute():
  base = hf.hf_config(preset_config(), max_position_embeddings=32, bos_id=1, eos_id=2, pad_id=3)
  for change in ({'attention_bias': True}, {'hidden_act': 'gelu'}, {'model_type': 'gpt2'},
                 {'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0}, 'rope_parameters': None}):
    with pytest.raises(ValueError):
      hf.model_fields({**base, **change})


def test_command_lines_import_then_export_give_back_the_same_files(tmp_path):
  c = preset_config(tie_embeddings=False)
  hf.save(str(tmp_path / 'hf'), random_params(c), c, max_position_embeddings=32)
  out = run_cli('scripts/import_hf.py', f'--hf={tmp_path / "hf"}', f'--workdir={tmp_path / "run"}',
                '--config=configs/test.py')
  assert 'continue pretraining' in out
  assert {'config.json', 'config.py', 'checkpoints'} <= set(os.listdir(tmp_path / 'run'))
  run_cli('scripts/export_hf.py', f'--workdir={tmp_path / "run"}', f'--out={tmp_path / "back"}')
  a = load_file(str(tmp_path / 'hf' / 'model.safetensors'))
  b = load_file(str(tmp_path / 'back' / 'model.safetensors'))
  assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
  with open(tmp_path / 'back' / 'config.json', encoding='utf-8') as f:
    assert dataclasses.replace(c, **hf.model_fields(json.load(f))) == c


@pytest.mark.parametrize('tie', [True, False])
def test_transformers_logits_match_ours(tmp_path, tie):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  c = preset_config(tie_embeddings=tie)
  params = random_params(c, seed=1)
  hf.save(str(tmp_path), params, c, max_position_embeddings=32)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  assert type(model).__name__ == 'LlamaForCausalLM'
  tokens_BxT = np.random.default_rng(0).integers(0, c.vocab_size, (2, 32))
  with jax.default_matmul_precision('float32'):
    ours = np.asarray(model_lib.Transformer(c).apply({'params': params}, tokens_BxT))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens_BxT)).logits.numpy()
  rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
  print(f'relative logits difference (tie={tie}): {rel:.2e}')
  assert rel < 1e-4


def test_transformers_tokenizers_encode_and_decode_like_ours(tmp_path):
  transformers = pytest.importorskip('transformers')
  docs = corpus.embedded_documents()
  texts = ['The for statement:\n\tfor x in ünïcödé 日本 🙂', ' leading  spaces',
           docs[60][:2000]]
  byte_tok = tokenizer_lib.ByteTokenizer()
  sp_tok = tokenizer_lib.train_sentencepiece(docs[:100], str(tmp_path / 'sp.model'),
                                             vocab_size=512)
  for name, tok in (('byte', byte_tok), ('sp', sp_tok)):
    os.makedirs(tmp_path / name)
    assert hf.save_tokenizer(str(tmp_path / name), tok) == []
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / name))
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (tok.eos_id, tok.pad_id)
    for text in texts:
      assert hf_tok(text)['input_ids'] == tok.encode(text).tolist()
      assert hf_tok.decode(tok.encode(text).tolist()) == text
