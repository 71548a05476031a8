"""Hugging Face export/import: import(export(params)) is the identity (library and command lines,
bfloat16 and sharded checkpoints); what our model cannot compute is refused before any weight is
read; exported tokenizers encode like ours (through tokenizers, and AutoTokenizer). With torch and
transformers installed, the exported model's logits equal ours, rotary scaling included (skipped
without them: see docs/use.md to run it)."""
import dataclasses
import json
import os
import subprocess
import sys

from flax.linen import meta
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file
from safetensors.numpy import save_file

from jax_pretrain import config as config_lib
from jax_pretrain import hf
from jax_pretrain import model as model_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.checkpoint import CheckpointError
from jax_pretrain.data import corpus
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data import tokenizer_json
from tests.conftest import ROOT
from tests.conftest import run_cli
from tests.conftest import subprocess_env

LLAMA3_ROPE = dict(rope_scaling='llama3', rope_theta=500000.0, rope_factor=32.0,
                   rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=64)
TEXTS = ['The for statement:\n\tfor x in ünïcödé 日本 🙂', ' leading  spaces',
         '3.14159 x\n\n', corpus.embedded_documents()[60][:2000]]


def preset_config(**overrides) -> model_lib.ModelConfig:
  config, _ = config_lib.resolve(config_lib.preset('test'), num_devices=1, backend='cpu')
  return dataclasses.replace(config.model, **overrides)


def random_params(c: model_lib.ModelConfig, seed=0):
  """Random float32 params, norm scales included (init sets them to 1), as numpy arrays."""
  abstract = jax.eval_shape(model_lib.Transformer(c).init, jax.random.key(0),
                            jnp.zeros((1, 1), jnp.int32))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(meta.unbox(abstract['params']))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      np.asarray((path[-1].key == 'scale') + 0.1 * jax.random.normal(k, x.shape))
      for k, (path, x) in zip(keys, leaves)])


def with_fields(c: model_lib.ModelConfig, fields: dict) -> model_lib.ModelConfig:
  """c with config.model fields read from a checkpoint, but max_position_embeddings (what the
  export stated, not the model's shape)."""
  return dataclasses.replace(
      c, **{k: v for k, v in fields.items() if k != 'max_position_embeddings'})


def assert_same_params(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.parametrize('tie', [True, False])
def test_import_of_export_is_identity(tmp_path, tie):
  c = preset_config(tie_embeddings=tie, **LLAMA3_ROPE)
  params = random_params(c)
  hf.save(str(tmp_path), params, c, max_position_embeddings=32)
  config = hf.read_config(str(tmp_path))
  assert config['architectures'] == ['LlamaForCausalLM']
  assert config['rope_parameters']['rope_type'] == 'llama3'
  tensors = load_file(str(tmp_path / 'model.safetensors'))
  assert ('lm_head.weight' in tensors) == (not tie)
  assert tensors['model.layers.1.self_attn.q_proj.weight'].shape == (
      c.num_heads * c.head_dim, c.d_model)
  assert with_fields(c, hf.model_fields(config)) == c
  assert_same_params(hf.read_params(str(tmp_path), c), params)
  # How a step runs the layers does not change the params read, nor the export.
  unrolled = dataclasses.replace(c, layers='unroll')
  assert_same_params(hf.read_params(str(tmp_path), unrolled), params)
  out = hf.to_hf(params, unrolled)
  assert out.keys() == tensors.keys() and all(np.array_equal(out[k], tensors[k]) for k in out)


def test_bfloat16_shards_are_read_in_their_dtype_and_converted(tmp_path):
  c = preset_config()
  tensors = hf.to_hf(random_params(c), c)
  names = sorted(tensors)
  shards = {'a.safetensors': names[:5], 'b.safetensors': names[5:]}
  for file, part in shards.items():
    save_file({k: tensors[k].astype(ml_dtypes.bfloat16) for k in part}, str(tmp_path / file))
  with open(tmp_path / 'model.safetensors.index.json', 'w', encoding='utf-8') as f:
    json.dump({'weight_map': {k: file for file, part in shards.items() for k in part}}, f)
  params = hf.read_params(str(tmp_path), c)
  rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in tensors.items()}
  for name, arrays in (('rounded', rounded), ('float32', tensors)):
    os.makedirs(tmp_path / name)
    save_file(arrays, str(tmp_path / name / 'model.safetensors'))
  assert_same_params(params, hf.read_params(str(tmp_path / 'rounded'), c))
  assert not np.array_equal(params['embedding'],
                            hf.read_params(str(tmp_path / 'float32'), c)['embedding'])


def test_model_fields_refuses_what_our_model_cannot_compute():
  base = hf.hf_config(preset_config(), max_position_embeddings=32, bos_id=1, eos_id=2, pad_id=3)
  for change, named in (
      ({'attention_bias': True}, 'attention_bias=True'),
      ({'hidden_act': 'gelu'}, "hidden_act='gelu'"),
      ({'model_type': 'gpt2'}, "model_type='gpt2'"),
      ({'quantization_config': {'bits': 4}}, 'quantization_config'),
      ({'rope_parameters': None, 'rope_scaling': {'type': 'dynamic', 'factor': 2.0}},
       "rope_scaling.rope_type='dynamic'"),
      ({'rope_parameters': {'rope_type': 'yarn', 'factor': 4.0, 'rope_theta': 1e4}},
       "rope_parameters.rope_type='yarn'"),
      ({'partial_rotary_factor': 0.5}, 'partial_rotary_factor=0.5'),
      ({'rope_parameters': {'rope_type': 'llama3', 'factor': 8.0}}, 'needs factor, low_freq')):
    with pytest.raises(CheckpointError, match=named.replace('(', r'\(')):
      hf.model_fields({**base, **change})
  # Older configs state rotary scaling in rope_scaling, with 'type' or 'rope_type'.
  old = {**base, 'rope_parameters': None, 'rope_theta': 5e5,
         'rope_scaling': {'type': 'linear', 'factor': 4.0}}
  assert hf.model_fields(old)['rope_scaling'] == 'linear'
  assert hf.model_fields(old)['rope_factor'] == 4.0 and hf.model_fields(old)['rope_theta'] == 5e5


def test_rotary_scaling_fields_are_checked(tmp_path):
  c = config_lib.preset('test')
  c.model.rope_scaling = 'yarn'
  with pytest.raises(config_lib.ConfigError, match="model.rope_scaling='yarn'"):
    config_lib.resolve(c, num_devices=1, backend='cpu')
  c.model.rope_scaling, c.model.rope_low_freq_factor = 'llama3', 8.0
  with pytest.raises(config_lib.ConfigError, match='0 < low < high'):
    config_lib.resolve(c, num_devices=1, backend='cpu')


def import_cli(hf_dir, workdir, *overrides):
  """scripts/import_hf.py in a subprocess: (exit status, stdout, stderr)."""
  out = subprocess.run([sys.executable, 'scripts/import_hf.py', f'--hf={hf_dir}',
                        f'--workdir={workdir}', '--config=configs/test.py', *overrides], cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
  return out.returncode, out.stdout, out.stderr


def test_import_refuses_before_reading_any_weight(tmp_path):
  c = preset_config()
  hf.save(str(tmp_path), random_params(c), c, max_position_embeddings=32,
          tokenizer=tokenizer_lib.ByteTokenizer())
  with open(tmp_path / 'model.safetensors', 'wb') as f:
    f.write(b'not a safetensors file: reading any weight would fail differently')
  config = hf.read_config(str(tmp_path))
  config['rope_parameters'] = {'rope_type': 'yarn', 'factor': 4.0, 'rope_theta': 1e4}
  with open(tmp_path / 'config.json', 'w', encoding='utf-8') as f:
    json.dump(config, f)
  status, _, err = import_cli(tmp_path, tmp_path / 'run')
  assert status == 1 and err.startswith('error: ') and 'Traceback' not in err, err
  assert "rope_parameters.rope_type='yarn' is not supported" in err
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints')


def test_import_checks_tensor_names_and_shapes_from_the_headers(tmp_path):
  c = preset_config()
  tensors = hf.to_hf(random_params(c), c)
  tensors['model.layers.1.mlp.up_proj.weight'] = tensors['model.layers.1.mlp.up_proj.weight'][:64]
  save_file(tensors, str(tmp_path / 'model.safetensors'))
  with pytest.raises(CheckpointError, match=r'up_proj.weight has shape \(64, 64\); config.json '
                     r'implies \(128, 64\)'):
    hf.read_params(str(tmp_path), c)
  del tensors['model.norm.weight']
  tensors['model.layers.0.self_attn.q_proj.bias'] = np.zeros(64, np.float32)
  save_file(tensors, str(tmp_path / 'model.safetensors'))
  with pytest.raises(CheckpointError, match='lacks model.norm.weight'):
    hf.read_params(str(tmp_path), c)


def test_command_lines_import_then_export_give_back_the_same_files(tmp_path):
  c = preset_config(tie_embeddings=False)
  hf.save(str(tmp_path / 'hf'), random_params(c), c, max_position_embeddings=32,
          tokenizer=tokenizer_lib.ByteTokenizer())
  generation = {'eos_token_id': [257, 10], 'temperature': 0.6, 'top_p': 0.9,
                'max_new_tokens': 32, 'do_sample': True}  # (an instruct model's)
  with open(tmp_path / 'hf' / 'generation_config.json', 'w', encoding='utf-8') as f:
    json.dump(generation, f)
  out = run_cli('scripts/import_hf.py', f'--hf={tmp_path / "hf"}', f'--workdir={tmp_path / "run"}',
                '--config=configs/test.py')
  assert 'continue pretraining' in out and 'tokenizer: 259 ids' in out
  assert {'config.json', 'config.py', 'checkpoints'} <= set(os.listdir(tmp_path / 'run'))
  run_cli('scripts/export_hf.py', f'--workdir={tmp_path / "run"}', f'--out={tmp_path / "back"}')
  a = load_file(str(tmp_path / 'hf' / 'model.safetensors'))
  b = load_file(str(tmp_path / 'back' / 'model.safetensors'))
  assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
  with open(tmp_path / 'back' / 'config.json', encoding='utf-8') as f:
    assert with_fields(c, hf.model_fields(json.load(f))) == c
  assert workdir_lib.generation_config(str(tmp_path / 'run')) == workdir_lib.GenerationConfig(
      temperature=0.6, top_p=0.9, max_new_tokens=32, eos_ids=(257, 10))
  for name in ('tokenizer.json', 'tokenizer_config.json', 'generation_config.json'):
    with open(tmp_path / 'hf' / name, 'rb') as x, open(tmp_path / 'back' / name, 'rb') as y:
      assert x.read() == y.read(), name
  # A checkpoint without tokenizer files is refused, naming the setting that fixes it.
  os.remove(tmp_path / 'hf' / 'tokenizer.json')
  status, _, err = import_cli(tmp_path / 'hf', tmp_path / 'run2')
  assert status == 1 and 'no tokenizer.json or tokenizer.model' in err and 'Traceback' not in err
  assert import_cli(tmp_path / 'hf', tmp_path / 'run2', '--config.data.tokenizer=byte')[0] == 0


def our_tokenizers(tmp_path) -> dict:
  """Each kind of text tokenizer we have, trained here where it needs training."""
  docs = corpus.embedded_documents()[:100]
  return {
      'byte': tokenizer_lib.ByteTokenizer(),
      'sentencepiece-bpe': tokenizer_lib.train_sentencepiece(
          docs, str(tmp_path / 'bpe.model'), 512),
      'sentencepiece-unigram': tokenizer_lib.train_sentencepiece(
          docs, str(tmp_path / 'uni.model'), 512, model_type='unigram'),
      'bpe-bytelevel': tokenizer_lib.train_bytelevel_bpe(
          docs, str(tmp_path / 'bl' / 'tokenizer.json'), 600)}


def test_exported_tokenizers_encode_like_ours_without_transformers(tmp_path):
  for name, tok in our_tokenizers(tmp_path).items():
    assert tokenizer_json.write(str(tmp_path / name), tok) == [], name
    assert sorted(os.listdir(tmp_path / name)) == ['tokenizer.json', 'tokenizer_config.json']
    back = tokenizer_lib.load(str(tmp_path / name))  # read with the tokenizers library
    assert (back.bos_id, back.eos_id, back.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id), name
    for text in TEXTS:
      assert back.encode(text).tolist() == tok.encode(text).tolist(), (name, text)
      assert back.decode(tok.encode(text)) == text, (name, text)


def test_transformers_tokenizers_encode_and_decode_like_ours(tmp_path):
  transformers = pytest.importorskip('transformers')
  for name, tok in our_tokenizers(tmp_path).items():
    tokenizer_json.write(str(tmp_path / name), tok)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / name))
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (tok.eos_id, tok.pad_id), name
    for text in TEXTS:
      assert hf_tok(text)['input_ids'] == tok.encode(text).tolist(), (name, text)
      assert hf_tok.decode(tok.encode(text).tolist(), skip_special_tokens=True) == text


@pytest.mark.parametrize('tie,rope', [(True, 'none'), (False, 'none'), (True, 'linear'),
                                      (False, 'llama3')])
def test_transformers_logits_match_ours(tmp_path, tie, rope):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  scaling = {'none': {}, 'linear': dict(rope_scaling='linear', rope_factor=4.0),
             'llama3': LLAMA3_ROPE}[rope]
  c = preset_config(tie_embeddings=tie, **scaling)
  params = random_params(c, seed=1)
  hf.save(str(tmp_path), params, c, max_position_embeddings=128)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  assert type(model).__name__ == 'LlamaForCausalLM'
  tokens_BxT = np.random.default_rng(0).integers(0, c.vocab_size, (2, 32))
  with jax.default_matmul_precision('float32'):
    ours = np.asarray(model_lib.Transformer(c).apply({'params': params}, tokens_BxT))
    unscaled = np.asarray(model_lib.Transformer(dataclasses.replace(c, rope_scaling='none')).apply(
        {'params': params}, tokens_BxT))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens_BxT)).logits.numpy()
  rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
  print(f'relative logits difference (tie={tie}, rope={rope}): {rel:.2e}')
  assert rel < 1e-4
  if rope != 'none':  # the scaling matters at these positions: the test would see it missing
    assert np.linalg.norm(unscaled - theirs) / np.linalg.norm(theirs) > 1e-3


@pytest.mark.parametrize('rope', ['linear', 'llama3'])
def test_rotary_frequencies_equal_transformers(rope):
  pytest.importorskip('torch')
  rope_utils = pytest.importorskip('transformers.modeling_rope_utils')
  transformers = pytest.importorskip('transformers')
  c = preset_config(**(LLAMA3_ROPE if rope == 'llama3' else dict(rope_scaling='linear',
                                                                rope_factor=4.0)))
  config = transformers.LlamaConfig(**{k: v for k, v in hf.hf_config(
      c, max_position_embeddings=128, bos_id=1, eos_id=2, pad_id=3).items()
      if k != 'rope_scaling'})
  theirs, _ = rope_utils.ROPE_INIT_FUNCTIONS[rope](config, 'cpu')
  np.testing.assert_allclose(np.asarray(model_lib.rope_frequencies(c)), theirs.numpy(), rtol=1e-6)


@pytest.mark.parametrize('content, message', [
    ('{"top_p": 2}', '"top_p" is 2; it must be a number in (0, 1]'),
    ('{"eos_token_id": "</s>"}', '"eos_token_id" is \'</s>\'; it must be a token id or a list'),
    ('{"temperature": true}', '"temperature" is True; it must be a number >= 0'),
    ('[1]', 'not a JSON object'),
    ('{', 'invalid JSON')])
def test_a_bad_generation_config_is_one_error_naming_the_field(tmp_path, content, message):
  (tmp_path / 'generation_config.json').write_text(content)
  with pytest.raises(workdir_lib.WorkdirError) as e:
    workdir_lib.generation_config(str(tmp_path))
  assert str(e.value).startswith(f'{tmp_path / "generation_config.json"}: ') and message in str(
      e.value)
  assert workdir_lib.generation_config(str(tmp_path / 'none')) == workdir_lib.GenerationConfig()
