"""Hugging Face Llama <-> our params: one name/layout mapping, used in both directions.

Our layout (model.py) keeps heads as separate axes and puts the input axis first: wq [L, D, N, H],
wo [L, N, H, D], w_gate [L, D, F], lm_head [D, V]. A torch nn.Linear weight is [out, in] with the
heads flattened: q_proj [N·H, D]. So every linear weight maps by flattening our input axes and our
output axes and transposing. RoPE needs no permutation: model.apply_rope rotates the pairs
(i, i + H/2), the rotate_half convention of transformers' Llama, so q_proj/k_proj rows are in the
same order as ours. RMSNorm, SwiGLU (down(silu(gate(x)) · up(x))), no biases and the 1/sqrt(H)
attention scale are the same equations. A tied model has no lm_head.weight (transformers ties it).

`export(workdir, out_dir)` and `import_run(hf_dir, workdir, config)` are what scripts/export_hf.py
and scripts/import_hf.py run. Needs safetensors; transformers only to write
the tokenizer files (skipped, with a note, when it is not installed); never torch.
"""
import dataclasses
import json
import os
import shutil

from flax.linen import meta
import jax
import jax.numpy as jnp
import numpy as np

from jax_pretrain import model as model_lib
from jax_pretrain.data import tokenizer as tokenizer_lib

# (HF name, our path under the layer (or root), number of leading input axes; 0: copied as is)
_LAYER = [
    ('input_layernorm.weight', ('attn_norm', 'scale'), 0),
    ('self_attn.q_proj.weight', ('attn', 'wq'), 1),       # [D, N, H]
    ('self_attn.k_proj.weight', ('attn', 'wk'), 1),       # [D, K, H]
    ('self_attn.v_proj.weight', ('attn', 'wv'), 1),       # [D, K, H]
    ('self_attn.o_proj.weight', ('attn', 'wo'), 2),       # [N, H, D]
    ('post_attention_layernorm.weight', ('mlp_norm', 'scale'), 0),
    ('mlp.gate_proj.weight', ('mlp', 'w_gate'), 1),       # [D, F]
    ('mlp.up_proj.weight', ('mlp', 'w_up'), 1),           # [D, F]
    ('mlp.down_proj.weight', ('mlp', 'w_down'), 1),       # [F, D]
]
_ROOT = [
    ('model.embed_tokens.weight', ('embedding',), 0),     # [V, D]: an embedding, not a linear
    ('model.norm.weight', ('final_norm', 'scale'), 0),
    ('lm_head.weight', ('lm_head',), 1),                  # [D, V], untied models only
]


def _entries(c: model_lib.ModelConfig):
  """(HF name, path in our params, leading input axes, layer index or None) of every weight."""
  for name, path, n_in in _ROOT:
    if not (c.tie_embeddings and path == ('lm_head',)):
      yield name, path, n_in, None
  for i in range(c.num_layers):
    for name, path, n_in in _LAYER:
      yield f'model.layers.{i}.{name}', path, n_in, i


def _ours_to_hf(x: np.ndarray, n_in: int) -> np.ndarray:
  if n_in == 0:
    return x
  return np.ascontiguousarray(x.reshape(int(np.prod(x.shape[:n_in])), -1).T)


def _hf_to_ours(name: str, w: np.ndarray, n_in: int, shape: tuple[int, ...]) -> np.ndarray:
  hf_shape = shape if n_in == 0 else (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))
  if w.shape != hf_shape:
    raise ValueError(f'{name} has shape {w.shape}; config.json implies {hf_shape}.')
  return w if n_in == 0 else w.T.reshape(shape)


def _layer_root(params, i: int):
  """Layer i's subtree and the index into it: scanned params stack layers on axis 0."""
  return (params['layers'], i) if 'layers' in params else (params[f'layers_{i}'], None)


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def to_hf(params, c: model_lib.ModelConfig) -> dict[str, np.ndarray]:
  """Our params (scanned or not) -> {HF name: float32 array}."""
  out = {}
  for name, path, n_in, layer in _entries(c):
    if layer is None:
      x = np.asarray(_get(params, path), np.float32)
    else:
      root, index = _layer_root(params, layer)
      x = np.asarray(_get(root, path), np.float32)
      x = x[index] if index is not None else x
    out[name] = _ours_to_hf(x, n_in)
  return out


def from_hf(tensors, c: model_lib.ModelConfig) -> dict:
  """{HF name: array} (any float dtype) -> our float32 params, in c.scan_layers' layout."""
  shapes = _param_shapes(c)
  missing = [name for name, *_ in _entries(c) if name not in tensors]
  if missing:
    raise KeyError(f'the checkpoint lacks {missing[:3]}{" ..." if len(missing) > 3 else ""}')
  params: dict = {}
  layers: dict = {}  # path -> [per-layer arrays]
  for name, path, n_in, layer in _entries(c):
    w = np.asarray(tensors[name], np.float32)
    if layer is None:
      x = _hf_to_ours(name, w, n_in, shapes[path])
      _set(params, path, x)
    else:
      x = _hf_to_ours(name, w, n_in, shapes[('layers',) + path][1:])
      layers.setdefault(path, []).append(x)
  for path, per_layer in layers.items():
    if c.scan_layers:
      _set(params, ('layers',) + path, np.stack(per_layer))
    else:
      for i, x in enumerate(per_layer):
        _set(params, (f'layers_{i}',) + path, x)
  return params


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _param_shapes(c: model_lib.ModelConfig) -> dict[tuple, tuple[int, ...]]:
  """Shapes of our (scanned) params, from the model itself: no second copy of the layout.

  Attention and remat do not change the params; the plain ones are traced, since the config may
  not be resolved yet (model.attention and model.remat 'auto' are decided on the run's devices).
  """
  model = model_lib.Transformer(dataclasses.replace(c, scan_layers=True, attention='xla',
                                                    remat='none'))
  abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  leaves = jax.tree_util.tree_leaves_with_path(meta.unbox(abstract['params']))
  return {tuple(k.key for k in path): tuple(x.shape) for path, x in leaves}


# config.json

def hf_config(c: model_lib.ModelConfig, *, max_position_embeddings: int, bos_id: int | None,
              eos_id: int | None, pad_id: int | None) -> dict:
  return {
      'architectures': ['LlamaForCausalLM'],
      'model_type': 'llama',
      'vocab_size': c.vocab_size,
      'hidden_size': c.d_model,
      'intermediate_size': c.mlp_dim,
      'num_hidden_layers': c.num_layers,
      'num_attention_heads': c.num_heads,
      'num_key_value_heads': c.num_kv_heads,
      'head_dim': c.head_dim,
      'hidden_act': 'silu',
      'max_position_embeddings': max_position_embeddings,
      'rms_norm_eps': c.norm_eps,
      'rope_theta': c.rope_theta,  # transformers < 5
      'rope_parameters': {'rope_type': 'default', 'rope_theta': c.rope_theta},  # >= 5
      'rope_scaling': None,
      'tie_word_embeddings': c.tie_embeddings,
      'attention_bias': False,
      'mlp_bias': False,
      'attention_dropout': 0.0,
      'initializer_range': c.init_std,
      'bos_token_id': bos_id,
      'eos_token_id': eos_id,
      'pad_token_id': pad_id,
      'torch_dtype': 'float32',
      'use_cache': True,
  }


def model_fields(hf: dict) -> dict:
  """Our config.model fields from a Llama config.json; refuses what our model cannot compute."""
  kind = hf.get('model_type')
  if kind not in ('llama', 'mistral'):
    raise ValueError(f'model_type {kind!r}: only Llama-architecture checkpoints are supported '
                     '(model_type llama, or mistral without sliding windows).')
  rope = hf.get('rope_parameters') or {}
  scaling = hf.get('rope_scaling') or {}
  rope_type = rope.get('rope_type', scaling.get('rope_type', scaling.get('type', 'default')))
  problems = [
      (hf.get('hidden_act', 'silu') != 'silu', f'hidden_act={hf.get("hidden_act")!r} (need silu)'),
      (hf.get('attention_bias', False) or hf.get('mlp_bias', False), 'biases'),
      (rope_type != 'default', f'rope scaling {rope_type!r}'),
      (hf.get('sliding_window') is not None and kind == 'mistral', 'sliding-window attention'),
  ]
  bad = [what for is_bad, what in problems if is_bad]
  if bad:
    raise ValueError(f'unsupported in this checkpoint: {", ".join(bad)}.')
  heads = hf['num_attention_heads']
  return {
      'num_layers': hf['num_hidden_layers'],
      'd_model': hf['hidden_size'],
      'num_heads': heads,
      'num_kv_heads': hf.get('num_key_value_heads') or heads,
      'head_dim': hf.get('head_dim') or hf['hidden_size'] // heads,
      'mlp_dim': hf['intermediate_size'],
      'vocab_size': hf['vocab_size'],
      'tie_embeddings': bool(hf.get('tie_word_embeddings', False)),
      'rope_theta': float(rope.get('rope_theta', hf.get('rope_theta', 10000.0))),
      'norm_eps': float(hf.get('rms_norm_eps', 1e-6)),
  }


# Files

def save(out_dir: str, params, c: model_lib.ModelConfig, *, max_position_embeddings: int,
         tokenizer=None) -> list[str]:
  """Writes config.json, model.safetensors and, where it can, the tokenizer; returns notes."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  os.makedirs(out_dir, exist_ok=True)
  ids = {k: getattr(tokenizer, k, None) for k in ('bos_id', 'eos_id', 'pad_id')}
  config = hf_config(c, max_position_embeddings=max_position_embeddings, **ids)
  with open(os.path.join(out_dir, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2)
    f.write('\n')
  save_file(to_hf(params, c), os.path.join(out_dir, 'model.safetensors'),
            metadata={'format': 'pt'})
  return [] if tokenizer is None else save_tokenizer(out_dir, tokenizer)


def load(hf_dir: str) -> tuple[dict, dict]:
  """(config.json as a dict, {name: array}) of a local checkpoint: model.safetensors or the shards
  that model.safetensors.index.json names. bfloat16 tensors load through jax (numpy has none)."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  with open(os.path.join(hf_dir, 'config.json'), encoding='utf-8') as f:
    config = json.load(f)
  index = os.path.join(hf_dir, 'model.safetensors.index.json')
  if os.path.isfile(index):
    with open(index, encoding='utf-8') as f:
      files = sorted(set(json.load(f)['weight_map'].values()))
  elif os.path.isfile(os.path.join(hf_dir, 'model.safetensors')):
    files = ['model.safetensors']
  else:
    raise FileNotFoundError(f'{hf_dir}: no model.safetensors (or index); convert a PyTorch .bin '
                            'checkpoint to safetensors first.')
  tensors = {}
  for name in files:
    with safe_open(os.path.join(hf_dir, name), framework='flax') as f:
      for key in f.keys():
        tensors[key] = np.asarray(f.get_tensor(key).astype('float32'))
  return config, tensors


def save_tokenizer(out_dir: str, tokenizer) -> list[str]:
  """Tokenizer files that AutoTokenizer loads, encoding text to the same ids as ours; returns
  notes. Needs transformers; without it, the model is exported alone (and a note says so)."""
  try:
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError:
    return ['transformers is not installed: exported the model without a tokenizer. '
            '`pip install transformers` and export again for the tokenizer files.']
  convert = {tokenizer_lib.ByteTokenizer: _byte_tokenizer,
             tokenizer_lib.SentencePieceTokenizer: _sentencepiece_tokenizer}.get(type(tokenizer))
  if convert is None:
    return [f'the run has no text tokenizer ({type(tokenizer).__name__}): exported the model '
            'without one.']
  hf_tok = convert(transformers, tokenizer, out_dir)
  hf_tok.save_pretrained(out_dir)
  probe = ' Two  spaces,\ttabs\nand ünïcödé 日本 🙂 3.14159 '
  if hf_tok(probe)['input_ids'] != [int(i) for i in tokenizer.encode(probe)]:
    return [f'the exported tokenizer encodes {probe!r} differently from ours: check it.']
  return []


def _sentencepiece_tokenizer(transformers, tokenizer, out_dir: str):
  """transformers' conversion of the .model's pieces (BPE or unigram), with sentencepiece's own
  normalization rebuilt from the model's spec: the converted tokenizer prepends no '▁' before a
  leading space (sentencepiece's dummy prefix always does) and keeps repeated spaces that
  remove_extra_whitespaces collapses."""
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=g-import-not-at-top
  from tokenizers import Regex, decoders, normalizers  # pylint: disable=g-import-not-at-top
  shutil.copyfile(tokenizer.path, os.path.join(out_dir, 'tokenizer.model'))
  converted = transformers.AutoTokenizer.from_pretrained(out_dir)
  backend = converted.backend_tokenizer
  proto = sentencepiece_model_pb2.ModelProto()
  with open(tokenizer.path, 'rb') as f:
    proto.ParseFromString(f.read())
  spec = proto.normalizer_spec
  steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
  if spec.remove_extra_whitespaces:
    steps += [normalizers.Strip(), normalizers.Replace(Regex(' {2,}'), ' ')]
  steps.append(normalizers.Replace(' ', '▁'))
  if spec.add_dummy_prefix:
    steps.append(normalizers.Prepend('▁'))
  backend.normalizer = normalizers.Sequence(steps)
  backend.pre_tokenizer = None
  backend.decoder = decoders.Sequence(
      [decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse()]
      + ([decoders.Strip(' ', 1, 0)] if spec.add_dummy_prefix else []))
  name = converted.convert_ids_to_tokens
  specials = {'bos_token': name(tokenizer.bos_id), 'eos_token': name(tokenizer.eos_id)}
  if proto.trainer_spec.unk_id >= 0:
    specials['unk_token'] = name(proto.trainer_spec.unk_id)
  hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
  # A pad the sentencepiece model lacks was appended after its pieces: append it likewise.
  if tokenizer.pad_id < tokenizer.num_pieces:
    hf_tok.pad_token = name(tokenizer.pad_id)
  else:
    hf_tok.add_special_tokens({'pad_token': '<pad>'})
  assert hf_tok.pad_token_id == tokenizer.pad_id, (hf_tok.pad_token_id, tokenizer.pad_id)
  return hf_tok


def _byte_tokenizer(transformers, tokenizer, out_dir: str):
  del out_dir  # nothing to copy
  """Our UTF-8 byte tokenizer as a fast tokenizer: ids 0..255 are bytes, then <s>, </s>, <pad>."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  to_char = _bytes_to_unicode()  # the printable stand-in of each byte that ByteLevel emits
  assert set(to_char.values()) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  vocab = {to_char[b]: b for b in range(256)}
  vocab.update({'<s>': tokenizer.bos_id, '</s>': tokenizer.eos_id, '<pad>': tokenizer.pad_id})
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))  # no merges: bytes
  tok.pre_tokenizer = byte_level
  tok.decoder = tokenizers.decoders.ByteLevel()
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token='<s>', eos_token='</s>', pad_token='<pad>')


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
  bs = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1))
        + list(range(ord('®'), ord('ÿ') + 1)))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {b: chr(c) for b, c in zip(bs, cs)}


# Runs

def export(workdir: str, out_dir: str, step: int | None = None) -> list[str]:
  """A run's checkpoint as a LlamaForCausalLM directory; returns notes for the user."""
  from jax_pretrain import config as config_lib  # pylint: disable=g-import-not-at-top
  from jax_pretrain import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  run = workdir_lib.load(workdir, step, devices=jax.devices()[:1])
  return save(out_dir, jax.device_get(run.params), config_lib.model_config(run.config),
              max_position_embeddings=run.config.data.seq_len, tokenizer=run.tokenizer)


def import_run(hf_dir: str, workdir: str, config):
  """A new run in workdir, at step 0, from a local Llama checkpoint; `config` gives everything but
  the model (which comes from the checkpoint) and is written as the run's config, with
  checkpoint.restore_from=workdir so that training from it starts from these params."""
  from jax_pretrain import config as config_lib  # pylint: disable=g-import-not-at-top
  from jax_pretrain import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  hf_config, tensors = load(hf_dir)
  config.model.update(model_fields(hf_config))
  sp_model = os.path.join(hf_dir, 'tokenizer.model')
  if config.data.tokenizer:
    tokenizer = tokenizer_lib.load(config.data.tokenizer)
  elif os.path.isfile(sp_model):
    tokenizer = tokenizer_lib.load(sp_model)
  else:
    tokenizer = tokenizer_lib.ByteTokenizer()
  # The run's tokenizer is kept in the workdir (workdir.save_tokenizer); training from it reads it.
  config.data.tokenizer = os.path.join(os.path.abspath(workdir), workdir_lib.TOKENIZER_DIR)
  config.checkpoint.restore_from = os.path.abspath(workdir)
  params = from_hf(tensors, config_lib.model_config(config))
  if tokenizer.vocab_size > config.model.vocab_size:
    # A pad id that the sentencepiece model lacks is appended after its pieces: give the embedding
    # room for it (zero rows: pad is only ever an ignored target; sampling never picks it).
    params = grow_vocab(params, -(-tokenizer.vocab_size // 128) * 128)
    config.model.vocab_size = params['embedding'].shape[0]
  return workdir_lib.create(workdir, config, params, tokenizer)


def grow_vocab(params, vocab_size: int):
  """The embedding (and untied lm_head) padded with zero rows up to vocab_size."""
  def grow(x, axis):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, vocab_size - x.shape[axis])
    return np.pad(x, pad)
  params = dict(params, embedding=grow(params['embedding'], 0))
  if 'lm_head' in params:
    params['lm_head'] = grow(params['lm_head'], 1)
  return params
