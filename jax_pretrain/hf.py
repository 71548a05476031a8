"""Hugging Face Llama <-> our params: one name/layout mapping, used in both directions.

Our layout (model.py) keeps heads as separate axes and puts the input axis first: wq [L, D, N, H],
wo [L, N, H, D], w_gate [L, D, F], lm_head [D, V]. A torch nn.Linear weight is [out, in] with the
heads flattened: q_proj [N·H, D]. So every linear weight maps by flattening our input axes and our
output axes and transposing. RoPE needs no permutation: model.apply_rope rotates the pairs
(i, i + H/2), the rotate_half convention of transformers' Llama, so q_proj/k_proj rows are in the
same order as ours. RMSNorm, SwiGLU (down(silu(gate(x)) · up(x))), no biases and the 1/sqrt(H)
attention scale are the same equations; rotary scaling 'linear' and 'llama3' are
model.rope_frequencies. A tied model has no lm_head.weight (transformers ties it).

`import_run(hf_dir, workdir, config)` (scripts/import_hf.py) checks everything it can before it
reads a weight: config.json (`model_fields` refuses what our model cannot compute, naming the
field and value), the tokenizer, the run config, and every tensor's name, shape and dtype from the
safetensors headers. Then it streams: tensors are read one at a time in their stored dtype and
converted into their place in float32 params allocated once, so peak host memory is about one
float32 copy of the params. `export(workdir, out_dir)` (scripts/export_hf.py) writes config.json,
model.safetensors and the tokenizer as tokenizer.json + tokenizer_config.json (with the run's chat
template; data/tokenizer_json.py), which AutoTokenizer loads and which encode text to our ids. An
import keeps the checkpoint's chat template (chat_template.jinja, tokenizer_config.json) with the
tokenizer in the run's tokenizer/. Needs
safetensors and tokenizers; never transformers or torch.
"""
from collections.abc import Callable
from collections.abc import Iterable
import dataclasses
import json
import os
import shutil
from typing import Any

from flax.linen import meta
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (numpy's bfloat16, which safetensors reads)
import numpy as np

from jax_pretrain import model as model_lib
from jax_pretrain import state as state_lib
from jax_pretrain.checkpoint import CheckpointError
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data import tokenizer_json

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


_VOCAB_ROWS = (('embedding',), ('lm_head',))  # their HF tensors are [V, D]: V may be < ours
_FLOAT_DTYPES = {'F32': 'float32', 'F16': 'float16', 'BF16': 'bfloat16', 'F64': 'float64'}


def _hf_view(x: np.ndarray, n_in: int) -> np.ndarray:
  """Our array x seen in the HF layout, as a view: a linear weight is [out, in]."""
  return x if n_in == 0 else x.reshape(int(np.prod(x.shape[:n_in])), -1).T


def _hf_shape(shape: tuple[int, ...], n_in: int) -> tuple[int, ...]:
  return shape if n_in == 0 else (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _ours(params, path, layer) -> np.ndarray:
  """Our array of one HF tensor: a root param, or one layer's slice of a layer param."""
  if layer is None:
    return _get(params, path)
  return _get(params['layers'], path)[layer]  # (the layers stacked on axis 0: model.py)


def to_hf(params, c: model_lib.ModelConfig) -> dict[str, np.ndarray]:
  """Our params -> {HF name: float32 array}."""
  return {name: np.ascontiguousarray(_hf_view(np.asarray(_ours(params, path, layer), np.float32),
                                              n_in))
          for name, path, n_in, layer in _entries(c)}


def _param_shapes(c: model_lib.ModelConfig) -> dict[tuple, tuple[int, ...]]:
  """Shapes of our (scanned) params, from the model itself: no second copy of the layout.

  Attention and remat do not change the params; the plain ones are traced, since the config may
  not be resolved yet (model.attention and model.remat 'auto' are decided on the run's devices).
  """
  model = model_lib.Transformer(dataclasses.replace(c, layers='scan', attention='xla',
                                                    remat='none'))
  abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  leaves = jax.tree_util.tree_leaves_with_path(meta.unbox(abstract['params']))
  return {tuple(k.key for k in path): tuple(x.shape) for path, x in leaves}


def expected_tensors(c: model_lib.ModelConfig, hf_vocab: int) -> dict[str, tuple[int, ...]]:
  """{HF name: shape} of every tensor c needs; hf_vocab: the checkpoint's rows of the embedding
  (and lm_head), which may be fewer than ours (a pad appended after the tokenizer's ids)."""
  shapes = _param_shapes(c)
  out = {}
  for name, path, n_in, layer in _entries(c):
    shape = _hf_shape(shapes[path] if layer is None else shapes[('layers',) + path][1:], n_in)
    out[name] = (hf_vocab,) + shape[1:] if path in _VOCAB_ROWS else shape
  return out


def _check_tensors(found: dict[str, tuple[tuple[int, ...], str]], c: model_lib.ModelConfig,
                   hf_vocab: int, where: str) -> None:
  """found: {name: (shape, dtype name)}, read from headers. Names the first thing that differs
  from what c needs, before any weight is read."""
  expected = expected_tensors(c, hf_vocab)
  missing = [name for name in expected if name not in found]
  if missing:
    raise CheckpointError(f'{where}: lacks {_some(missing)} ({len(missing)} of the '
                          f'{len(expected)} tensors config.json implies).')
  for name, shape in expected.items():
    if tuple(found[name][0]) != shape:
      raise CheckpointError(f'{where}: {name} has shape {tuple(found[name][0])}; config.json '
                            f'implies {shape}.')
    if found[name][1] not in _FLOAT_DTYPES.values():
      raise CheckpointError(f'{where}: {name} is {found[name][1]}; only float32, float16 and '
                            'bfloat16 weights are read (not quantized ones).')
  ignored = ('lm_head.weight',) if c.tie_embeddings else ()  # transformers ties it, as we do
  extra = [name for name in found if name not in expected and name not in ignored
           and not name.endswith('rotary_emb.inv_freq')]  # a buffer older checkpoints saved
  if extra:
    raise CheckpointError(f'{where}: holds {_some(extra)}, which a Llama model of this '
                          'config.json does not have.')


def _some(names: list[str]) -> str:
  return ', '.join(names[:3]) + (' ...' if len(names) > 3 else '')


def _fill(c: model_lib.ModelConfig, hf_vocab: int, names: Iterable[str],
          read: Callable[[str], np.ndarray]) -> dict:
  """Our float32 params, allocated once (zeros: embedding rows past hf_vocab stay 0), each tensor
  of `names` read and converted straight into its place: one tensor in flight at a time."""
  params: dict = {}
  for path, shape in _param_shapes(c).items():
    _set(params, path, state_lib.host_zeros(shape, np.float32))  # saved without a copy (create)
  places = {name: (path, n_in, layer) for name, path, n_in, layer in _entries(c)}
  for name in names:
    if name in places:
      path, n_in, layer = places[name]
      target = _hf_view(_ours(params, path, layer), n_in)
      if path in _VOCAB_ROWS:
        target = target[:hf_vocab]
      target[...] = read(name)  # cast to float32 on assignment, straight into the params
  return params


def _tensor_files(hf_dir: str) -> list[str]:
  """model.safetensors, or the shards that model.safetensors.index.json names."""
  index = os.path.join(hf_dir, 'model.safetensors.index.json')
  if os.path.isfile(index):
    with open(index, encoding='utf-8') as f:
      files = sorted(set(json.load(f)['weight_map'].values()))
    return [os.path.join(hf_dir, name) for name in files]
  if os.path.isfile(os.path.join(hf_dir, 'model.safetensors')):
    return [os.path.join(hf_dir, 'model.safetensors')]
  raise CheckpointError(f'{hf_dir}: no model.safetensors (or model.safetensors.index.json); '
                        'convert a PyTorch .bin checkpoint to safetensors first.')


def read_params(hf_dir: str, c: model_lib.ModelConfig, hf_vocab: int | None = None) -> dict:
  """Our float32 params from a local checkpoint, streamed. Every tensor's name, shape and dtype
  are checked from the safetensors headers first; then each tensor is read in its stored dtype
  and converted into its place, shard by shard. hf_vocab: config.json's vocab_size (default:
  c.vocab_size)."""
  from safetensors import safe_open  # noqa: PLC0415
  found, file_of = {}, {}
  for path in _tensor_files(hf_dir):
    with safe_open(path, framework='numpy') as f:
      for name in f.keys():
        info = f.get_slice(name)
        found[name] = (tuple(info.get_shape()), _FLOAT_DTYPES.get(info.get_dtype(),
                                                                   info.get_dtype()))
        file_of[name] = path
  hf_vocab = c.vocab_size if hf_vocab is None else hf_vocab
  _check_tensors(found, c, hf_vocab, hf_dir)

  def read(name: str) -> np.ndarray:
    # Opened per tensor: safetensors memory-maps the file, and the pages read stay resident (the
    # process's memory) until it is closed; a whole shard would stay on top of the params.
    with safe_open(file_of[name], framework='numpy') as f:
      return f.get_tensor(name)

  return _fill(c, hf_vocab, found, read)


# config.json

# config.json's rope_type -> model.rope_scaling
_ROPE_TYPES = {'default': 'none', 'linear': 'linear', 'llama3': 'llama3'}


def _rope_config(c: model_lib.ModelConfig) -> dict:
  """config.json's rotary fields: rope_parameters (transformers >= 5), rope_scaling and rope_theta
  (older versions)."""
  scaling: dict[str, Any] = {
      'rope_type': {ours: hf for hf, ours in _ROPE_TYPES.items()}[c.rope_scaling]}
  if c.rope_scaling != 'none':
    scaling['factor'] = c.rope_factor
  if c.rope_scaling == 'llama3':
    scaling.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor,
                   original_max_position_embeddings=c.rope_original_max_len)
  return {'rope_theta': c.rope_theta, 'rope_parameters': {**scaling, 'rope_theta': c.rope_theta},
          'rope_scaling': scaling if c.rope_scaling != 'none' else None}


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
      **_rope_config(c),
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


def _rope_fields(hf: dict, where: str) -> dict:
  """Our rotary fields from config.json's rope_parameters (transformers >= 5) or rope_scaling
  (older: its kind under 'rope_type' or 'type')."""
  field = 'rope_parameters' if hf.get('rope_parameters') else 'rope_scaling'
  rope = hf.get(field) or {}
  kind = rope.get('rope_type', rope.get('type', 'default'))
  if kind not in _ROPE_TYPES:
    raise CheckpointError(f'{where}: {field}.rope_type={kind!r} is not supported (supported: '
                          f'{", ".join(_ROPE_TYPES)}).')
  partial = rope.get('partial_rotary_factor', hf.get('partial_rotary_factor', 1.0))
  if partial != 1.0:
    raise CheckpointError(f'{where}: partial_rotary_factor={partial} is not supported (rotary '
                          'embeddings on the whole head only).')
  keys = {'linear': ('factor',),
          'llama3': ('factor', 'low_freq_factor', 'high_freq_factor')}.get(kind, ())
  if any(k not in rope for k in keys):
    raise CheckpointError(f'{where}: {field} of rope_type {kind!r} needs {", ".join(keys)}.')
  fields = {'rope_theta': float(rope.get('rope_theta', hf.get('rope_theta', 10000.0))),
            'rope_scaling': _ROPE_TYPES[kind]}
  if kind != 'default':
    fields['rope_factor'] = float(rope['factor'])
  if kind == 'llama3':
    fields.update(rope_low_freq_factor=float(rope['low_freq_factor']),
                  rope_high_freq_factor=float(rope['high_freq_factor']),
                  rope_original_max_len=int(rope.get('original_max_position_embeddings',
                                                     hf.get('max_position_embeddings', 8192))))
  return fields


def model_fields(hf: dict, where: str = 'config.json') -> dict:
  """Our config.model fields from a Llama config.json. Refuses what our model cannot compute with
  a CheckpointError that names each such field and its value."""
  kind = hf.get('model_type')
  problems = [
      (kind not in ('llama', 'mistral'), f'model_type={kind!r} (only Llama-architecture '
       'checkpoints: llama, or mistral without sliding windows)'),
      (hf.get('hidden_act', 'silu') != 'silu', f'hidden_act={hf.get("hidden_act")!r} (need silu)'),
      (bool(hf.get('attention_bias')), f'attention_bias={hf.get("attention_bias")!r} (no biases)'),
      (bool(hf.get('mlp_bias')), f'mlp_bias={hf.get("mlp_bias")!r} (no biases)'),
      (kind == 'mistral' and hf.get('sliding_window') is not None,
       f'sliding_window={hf.get("sliding_window")!r} (no sliding-window attention)'),
      ('quantization_config' in hf, 'quantization_config (quantized weights are not read)'),
  ]
  bad = [what for is_bad, what in problems if is_bad]
  if bad:
    raise CheckpointError(f'{where}: unsupported: {"; ".join(bad)}.')
  missing = [k for k in ('num_hidden_layers', 'hidden_size', 'num_attention_heads',
                         'intermediate_size', 'vocab_size') if k not in hf]
  if missing:
    raise CheckpointError(f'{where}: lacks {", ".join(missing)}.')
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
      'norm_eps': float(hf.get('rms_norm_eps', 1e-6)),
      'max_position_embeddings': int(hf.get('max_position_embeddings', 0)),
      **_rope_fields(hf, where),
  }


def read_config(hf_dir: str) -> dict:
  """A checkpoint's config.json."""
  path = os.path.join(hf_dir, 'config.json')
  if not os.path.isfile(path):
    raise CheckpointError(f'{path} not found: is {hf_dir!r} a Hugging Face model directory?')
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f'{path}: invalid JSON ({e}).') from None


# Files

def save(out_dir: str, params, c: model_lib.ModelConfig, *, max_position_embeddings: int,
         tokenizer=None) -> list[str]:
  """Writes config.json, model.safetensors and the tokenizer (if given); returns notes."""
  from safetensors.numpy import save_file  # noqa: PLC0415
  os.makedirs(out_dir, exist_ok=True)
  ids = {k: getattr(tokenizer, k, None) for k in ('bos_id', 'eos_id', 'pad_id')}
  config = hf_config(c, max_position_embeddings=max_position_embeddings, **ids)
  with open(os.path.join(out_dir, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2)
    f.write('\n')
  save_file(to_hf(params, c), os.path.join(out_dir, 'model.safetensors'),
            metadata={'format': 'pt'})
  return [] if tokenizer is None else tokenizer_json.write(out_dir, tokenizer)


# Runs

def export(workdir: str, out_dir: str, step: int | None = None) -> list[str]:
  """A run's checkpoint as a LlamaForCausalLM directory; returns notes for the user."""
  from jax_pretrain import workdir as workdir_lib  # noqa: PLC0415
  run = workdir_lib.load(workdir, step, devices=jax.devices()[:1])
  length = max(run.config.model.max_position_embeddings, run.config.data.seq_len)
  notes = save(out_dir, jax.device_get(run.params), run.config.model,
               max_position_embeddings=length, tokenizer=run.tokenizer)
  _copy_generation_config(workdir, out_dir)
  if run.config.model.fp8:
    notes.append(FP8_NOTE)
  return notes


# What an export of a model.fp8 run holds (a note of export's, which scripts/export_hf.py prints).
FP8_NOTE = ('the run trained its projections in FP8 (model.fp8): model.safetensors holds its '
            'float32 master weights, not quantized, and not its FP8 scales (the amax histories); '
            'transformers runs them in the dtype it loads them in, whose logits differ from FP8 '
            "inference's (the engine's, at the training's delayed scales) by FP8's rounding.")


def import_run(hf_dir: str, workdir: str, config):
  """A new run in workdir, at step 0, from a local Llama checkpoint; `config` gives everything but
  the model (which comes from the checkpoint) and is written as the run's config, with
  checkpoint.restore_from=workdir so that training from it starts from these params.

  Everything that can be wrong is checked before a weight is read (see the module docstring).
  The tokenizer is data.tokenizer if set, else the checkpoint's tokenizer.json (or
  tokenizer.model); the run keeps it in WORKDIR/tokenizer/, and the checkpoint's
  generation_config.json (its sampling defaults and EOS ids, for the server) in WORKDIR.
  """
  from jax_pretrain import config as config_lib  # noqa: PLC0415
  from jax_pretrain import workdir as workdir_lib  # noqa: PLC0415
  workdir_lib.check_new(workdir)
  hf_config = read_config(hf_dir)
  config.model.update(model_fields(hf_config, os.path.join(hf_dir, 'config.json')))
  kinds = (tokenizer_lib.HfTokenizer, tokenizer_lib.SentencePieceTokenizer)
  if not config.data.tokenizer and not any(
      os.path.isfile(os.path.join(hf_dir, kind.file_name)) for kind in kinds):
    raise CheckpointError(f'{hf_dir}: no tokenizer.json or tokenizer.model; give the tokenizer the '
                          'model was trained with: --config.data.tokenizer=PATH (or byte).')
  tokenizer = tokenizer_lib.load(config.data.tokenizer or hf_dir)
  hf_vocab = config.model.vocab_size
  if getattr(tokenizer, 'num_pieces', tokenizer.vocab_size) > hf_vocab:
    raise CheckpointError(f'the tokenizer ({tokenizer.path}) has {tokenizer.vocab_size} ids but '
                          f'{hf_dir} has vocab_size {hf_vocab}: is it the model\'s tokenizer?')
  if tokenizer.vocab_size > hf_vocab:
    # A pad id that the tokenizer lacks is appended after its ids: give the embedding room for it
    # (zero rows: pad is only ever an ignored target; sampling never picks it).
    config.model.vocab_size = -(-tokenizer.vocab_size // 128) * 128
  # The run's tokenizer is kept in the workdir (workdir.save_tokenizer); training from it reads it.
  config.data.tokenizer = os.path.join(os.path.abspath(workdir), workdir_lib.TOKENIZER_DIR)
  config.checkpoint.restore_from = os.path.abspath(workdir)
  resolved, _ = config_lib.resolve(config, num_devices=1, backend=jax.devices()[0].platform,
                                   tokenizer_vocab_size=tokenizer.vocab_size)
  workdir_lib.generation_config(hf_dir)  # (a bad one refused before the weights are read)
  params = read_params(hf_dir, resolved.model, hf_vocab)
  trained = workdir_lib.create(workdir, config, params, tokenizer)
  _copy_generation_config(hf_dir, workdir)
  return trained


def _copy_generation_config(source: str, target: str) -> None:
  """source's generation_config.json (a model's sampling defaults and EOS ids, which the server
  reads) into target, if it has one."""
  from jax_pretrain import workdir as workdir_lib  # noqa: PLC0415
  path = os.path.join(source, workdir_lib.GENERATION_CONFIG_FILE)
  if os.path.isfile(path):
    shutil.copyfile(path, os.path.join(target, workdir_lib.GENERATION_CONFIG_FILE))
