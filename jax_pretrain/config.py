"""The config: every default (one line of comment each), and its resolution and validation.

`defaults()` is the one place defaults live; presets (configs/*.py) start from it and override what
differs. `resolve` fills in every value a user may leave to be derived (0 or -1 below), checks the
whole config group by group, and returns a locked copy; errors name the field and the numbers that
disagree. Everything downstream reads the resolved config and never re-derives.
"""
import dataclasses
import importlib.util
import json
import math
import os

import jax
import ml_collections

from jax_pretrain import PRESETS_DIR
from jax_pretrain import model as model_lib
from jax_pretrain import sharding
from jax_pretrain.errors import UserError
from jax_pretrain.kernels import attention


def defaults() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  c.model = m = ml_collections.ConfigDict()
  m.num_layers = 12            # transformer blocks
  m.d_model = 512              # residual stream width
  m.num_heads = 8              # query heads
  m.num_kv_heads = 8           # key/value heads (grouped-query attention); divides num_heads
  m.head_dim = 0               # 0: d_model // num_heads
  m.mlp_dim = 1408             # SwiGLU hidden width (about 8/3 d_model, a multiple of 128)
  m.vocab_size = 32768         # embedding rows; >= the tokenizer's vocabulary
  m.tie_embeddings = True      # share the input embedding with the output projection
  m.rope_theta = 10000.0       # rotary embedding base
  m.rope_scaling = 'none'      # 'none' | 'linear' | 'llama3': rescaled rotary frequencies
  m.rope_factor = 1.0          # linear, llama3: low frequencies (all, for linear) divided by this
  m.rope_low_freq_factor = 1.0   # llama3: wavelengths > original_max_len / this are scaled
  m.rope_high_freq_factor = 4.0  # llama3: wavelengths < original_max_len / this are kept
  m.rope_original_max_len = 8192  # llama3: the context length the model was pretrained at
  m.max_position_embeddings = 0  # context length a Hugging Face export states (0: data.seq_len);
                               # an import keeps its checkpoint's
  m.norm_eps = 1e-5            # RMSNorm epsilon
  m.init_std = 0.02            # normal init std (output projections scaled by 1/sqrt(2*layers))
  m.attention = 'auto'         # 'auto' (cuDNN where it runs, else XLA) | 'xla' | 'cudnn' | 'pallas'
  m.remat = 'auto'             # 'auto' (dots with fused attention, else full) | 'none' | 'full' |
                               # 'dots' | 'dots_no_batch' | 'minimal'
  m.scan_layers = True         # scan over stacked layers (compile time independent of depth)
  m.dtype = 'auto'             # compute dtype: 'auto' (bfloat16 on TPUs and NVIDIA sm_80+,
                               # float16 with loss scaling on older NVIDIA GPUs, float32 on the
                               # CPU) | 'bfloat16' | 'float16' | 'float32'; params and optimizer
                               # state stay float32
  m.param_dtype = 'float32'    # master parameter dtype
  m.fp8 = False                # attention and MLP projections in FP8 (Hopper/Ada GPUs; simulated
                               # on the CPU): per-tensor current scaling, jax_pretrain/fp8.py

  c.data = d = ml_collections.ConfigDict()
  d.seq_len = 2048             # tokens per training sequence
  d.format = 'text'            # 'text': documents (pretraining) | 'sft': JSONL prompt/completion
                               # or chat messages, packed, loss on completions (docs/data.md)
  d.train = ''                 # required: 'SOURCE[#field][:weight],...' (docs/data.md)
  d.val = ''                   # eval sources; '' carves val_ratio from the training data
  d.val_ratio = 0.05           # share of the training data held out for eval when val is ''
  d.tokenizer = ''             # '': from the data (else bytes); 'byte'; a sentencepiece .model;
                               # a tokenizer.json, or a directory with one (docs/data.md)
  d.text_field = 'text'        # JSONL key, Parquet column or TFDS feature that holds the text
  d.tfds_data_dir = ''         # TFDS data_dir for tfds:NAME sources ('' : ~/tensorflow_datasets)
  d.on_bad_record = 'error'    # bad raw-text lines: 'error' | 'skip' (counted, reported per file)
  d.num_workers = 0            # grain worker processes for batches (0: threads in this process)
  d.read_threads = 2           # threads assembling batches in each process
  d.prefetch = 4               # batches buffered ahead of the trainer

  c.train = t = ml_collections.ConfigDict()
  t.steps = 0                  # optimizer steps; 0: derive from total_tokens
  t.total_tokens = 0           # run length in tokens (alternative to steps)
  t.batch_size = 64            # global batch, in sequences
  t.micro_batch_size = 0       # sequences per data-parallel device per forward/backward; 0: on a
                               # GPU the largest that fits (compiled at start-up, printed), else
                               # batch_size / data-parallel devices (no accumulation)
  t.seed = 0                   # parameter init and data order
  t.log_every = 10             # steps between logged scalars
  t.eval_every = 500           # steps between evals (and at the end)
  t.eval_steps = 20            # eval batches per eval
  t.eval_batch_size = 0        # 0: micro_batch_size × data-parallel devices (one pass, no OOM)
  t.peak_flops = 0.0           # device peak dense bf16 FLOP/s for MFU; 0: look up by device kind
  t.on_nonfinite = 'halt'      # non-finite loss or grad norm: 'halt' (checkpoints intact) | 'skip'
  t.max_consecutive_skips = 10  # with 'skip': halt after this many non-finite steps in a row
  t.sample_prompt = 'The '     # prompt of the continuation printed at the end ('' disables)
  t.sample_tokens = 64         # tokens generated for that continuation
  # Downstream evals during training through lm-evaluation-harness (jax_pretrain/lm_eval.py).
  t.lm_eval_tasks = ''         # tasks, comma-separated ('' : none), logged as lm_eval/TASK/METRIC
  t.lm_eval_every = 0          # steps between them; 0: at every eval (eval_every) and the end
  t.lm_eval_include_path = ''  # a folder of extra task YAMLs (lm_eval's --include_path)
  t.lm_eval_limit = 0          # examples per task at most; 0: all
  t.wandb_project = ''         # Weights & Biases project: the scalars go there too ('': off)
  t.wandb_entity = ''          # its team or user ('': your default entity)
  t.wandb_run_name = ''        # the run's name there ('': the workdir's name)
  t.profile_steps = ''         # 'START:STOP': trace those steps (jax.profiler) to WORKDIR/profile

  c.optim = o = ml_collections.ConfigDict()
  o.learning_rate = 3e-4       # peak learning rate
  o.min_learning_rate = 3e-5   # end of the cosine decay
  o.warmup_steps = 0           # linear warmup; 0: derive from warmup_tokens
  o.warmup_tokens = 0          # warmup in tokens (alternative to warmup_steps)
  o.b1 = 0.9                   # AdamW beta1
  o.b2 = 0.95                  # AdamW beta2
  o.eps = 1e-8                 # AdamW epsilon
  o.weight_decay = 0.1         # decoupled weight decay (not applied to norms or other 1-D params)
  o.grad_clip = 1.0            # clip by global norm; 0 disables
  o.mu_dtype = 'float32'       # AdamW first-moment dtype; 'bfloat16' halves its memory

  c.mesh = mesh = ml_collections.ConfigDict()
  mesh.data = -1               # data-parallel axis size; -1: all remaining devices
  mesh.fsdp = 1                # parameter-sharded data-parallel axis size
  mesh.tensor = 1              # tensor-parallel axis size (heads, MLP, vocab)

  c.checkpoint = ck = ml_collections.ConfigDict()
  ck.every_steps = 1000        # steps between (asynchronous) saves; 0: only the final save
  ck.keep = 2                  # keep the latest this many checkpoints
  ck.keep_best = 3             # and also the best this many by eval loss (0: none)
  ck.async_save = True         # write in the background while training continues
  ck.save_final = True         # save the state at the end of training
  ck.restore_from = ''         # another run's workdir: start from its params (new optimizer, data)
  return c


# Fields that moved between groups: configs and config.json files written before still load.
MOVED = {('train', name): ('optim', name) for name in (
    'learning_rate', 'min_learning_rate', 'warmup_steps', 'warmup_tokens', 'b1', 'b2', 'eps',
    'weight_decay', 'grad_clip')}


def from_dict(saved: dict, strict: bool = False) -> ml_collections.ConfigDict:
  """A config from a (possibly older) dict, over today's defaults: fields it lacks keep their
  defaults and moved fields go to their new group. Unknown fields are dropped (a config.json of
  another version), or with strict=True refused, naming the field (a typo in a config file)."""
  c = defaults()
  for group, fields in saved.items():
    for name, value in (fields.items() if isinstance(fields, dict) else [(None, fields)]):
      new_group, new_name = MOVED.get((group, name), (group, name))
      if new_group in c and new_name in c[new_group]:
        c[new_group][new_name] = value
      elif strict:
        raise ConfigError(f'{group}.{name}: no such config field (all fields, with their '
                          'defaults, are in jax_pretrain/config.py).')
  return c


def load_file(path: str) -> ml_collections.ConfigDict:
  """get_config() of a config file (a preset, or a run's config.py), as --config loads it."""
  if not os.path.isfile(path):
    raise ConfigError(f'{path}: no such config file (presets are in {PRESETS_DIR}).')
  spec = importlib.util.spec_from_file_location('_jax_pretrain_config_file', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def preset(name: str) -> ml_collections.ConfigDict:
  """configs/NAME.py's config, e.g. preset('test')."""
  return load_file(os.path.join(PRESETS_DIR, f'{name}.py'))


def as_dict(config: ml_collections.ConfigDict) -> dict:
  """Plain JSON types (dtypes and other objects as strings), as config.json holds them."""
  return json.loads(config.to_json_best_effort())


def to_json(config: ml_collections.ConfigDict) -> str:
  return json.dumps(as_dict(config), indent=2, sort_keys=True) + '\n'


class ConfigError(UserError):
  """A config value that cannot work; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RunShape:
  """Values derived from the resolved config that are not config fields themselves."""
  mesh_shape: tuple[int, int, int]
  grad_accum_steps: int  # micro-batches per optimizer step
  tokens_per_step: int
  choices: tuple[str, ...] = ()  # what 'auto' fields resolved to and why, for the start-up lines


_DTYPES = ('float32', 'bfloat16', 'float16')


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def _choice(group: ml_collections.ConfigDict, where: str, field: str, choices) -> None:
  _check(group[field] in choices, f'{where}.{field}={group[field]!r}: choose one of '
         f'{tuple(choices)}.')


def resolve(config: ml_collections.ConfigDict, num_devices: int, backend: str | None = None,
            tokenizer_vocab_size: int = 0,
            device=None) -> tuple[ml_collections.ConfigDict, RunShape]:
  """Returns (resolved locked copy of config, RunShape); raises ConfigError on any inconsistency.

  tokenizer_vocab_size: the tokenizer's ids, which the embedding must hold (0: not checked).
  device: one of the devices the run uses (a jax Device, real or compile-only); it decides
  model.attention='auto' and gives the backend. Without it, backend alone decides ('gpu' is taken
  to be a recent NVIDIA GPU).
  """
  c = from_dict(config.to_dict(), strict=True)  # a copy in today's layout; the caller's unchanged
  choices = _resolve_model(c.model, backend, tokenizer_vocab_size, device)
  mesh_shape = _resolve_mesh(c, num_devices)
  accum, tokens_per_step = _resolve_batch(c)
  _resolve_schedule(c.train, c.optim, tokens_per_step)
  _resolve_rest(c)
  c.lock()
  return c, RunShape(mesh_shape=mesh_shape, grad_accum_steps=accum,
                     tokens_per_step=tokens_per_step, choices=tuple(choices))


_AUTO_DTYPE = 'auto'


def _auto_dtype(backend: str, device) -> tuple[str, str]:
  """What model.dtype='auto' means on this device (real or compile-only): (dtype, the reason)."""
  kind = getattr(device, 'device_kind', '') or backend
  if backend == 'tpu':
    return 'bfloat16', f'{kind} computes in bfloat16'
  if backend != 'gpu':
    return 'float32', f'{kind}: no fast bfloat16 matmuls on the {backend}'
  capability = getattr(device, 'compute_capability', None)
  if capability is not None:
    ampere = tuple(int(x) for x in str(capability).split('.')[:2]) >= (8, 0)
  else:  # a GPU that states no capability: judged by its name, like attention.choose
    ampere = not any(name in kind for name in attention.PRE_AMPERE)
    capability = 'unknown'
  if ampere:
    return 'bfloat16', f'{kind}, compute capability {capability} has bfloat16'
  return 'float16', (f'{kind}, compute capability {capability} has no bfloat16: float16 with '
                     'dynamic loss scaling')


def _resolve_model(m: ml_collections.ConfigDict, backend: str | None, tokenizer_vocab_size: int,
                   device) -> list[str]:
  """Checks the model group and decides its 'auto' fields; returns what they became, and why."""
  choices = []
  if device is not None:
    backend = device.platform
  _choice(m, 'model', 'attention', attention.IMPLEMENTATIONS + (attention.AUTO,))
  _choice(m, 'model', 'remat', tuple(model_lib.REMAT_POLICIES) + (model_lib.AUTO_REMAT,))
  _choice(m, 'model', 'dtype', _DTYPES + (_AUTO_DTYPE,))
  _choice(m, 'model', 'param_dtype', _DTYPES)
  for field in ('num_layers', 'd_model', 'num_heads', 'num_kv_heads', 'mlp_dim', 'vocab_size'):
    _check(m[field] > 0, f'model.{field} must be positive, got {m[field]}.')
  _check(m.num_heads % m.num_kv_heads == 0,
         f'model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}.')
  if m.head_dim == 0:
    _check(m.d_model % m.num_heads == 0,
           f'model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; '
           'set model.head_dim explicitly.')
    m.head_dim = m.d_model // m.num_heads
  _check(m.head_dim % 2 == 0, f'model.head_dim={m.head_dim} must be even (rotary embeddings).')
  if (m.attention == attention.AUTO or m.dtype == _AUTO_DTYPE) and device is None and (
      backend is None):
    device = jax.devices()[0]
    backend = device.platform
  if m.dtype == _AUTO_DTYPE:
    m.dtype, why = _auto_dtype(backend, device)
    choices.append(f'dtype {m.dtype} (auto: {why})')
  if m.attention == attention.AUTO:
    kind = device.device_kind if device is not None else (
        'NVIDIA GPU' if backend == 'gpu' else backend)
    m.attention, why = attention.choose(backend, kind, getattr(device, 'compute_capability', None),
                                        m.dtype, m.head_dim)
    choices.append(f'attention {m.attention} (auto: {why})')
  reason = attention.unavailable_reason(m.attention, backend)
  _check(reason is None, reason)
  if m.remat == model_lib.AUTO_REMAT:
    # 'dots' keeps every matmul output for the backward pass and recomputes only the cheap rest.
    # With XLA's attention, the T×T attention scores are matmul outputs too: 'dots' would keep
    # them for every layer (xlarge, one H100, micro-batch 8: 116 GiB against 50 with cuDNN), so
    # there 'full' recomputes each layer instead (1.25× the matmul FLOPs).
    m.remat = 'full' if m.attention == 'xla' else 'dots'
    choices.append(f'remat {m.remat} (auto: attention {m.attention})')
  if m.fp8 and backend == 'gpu':
    capability = getattr(device, 'compute_capability', None)
    _check(capability is None or tuple(int(x) for x in capability.split('.')[:2]) >= (8, 9),
           f'model.fp8=True needs FP8 matmuls (an NVIDIA GPU of compute capability >= 8.9: '
           f'Hopper, Ada); this {getattr(device, "device_kind", "GPU")} has {capability}. '
           'Leave model.fp8 off.')
  _choice(m, 'model', 'rope_scaling', model_lib.ROPE_SCALINGS)
  if m.rope_scaling != 'none':
    _check(m.rope_factor > 0, f'model.rope_factor={m.rope_factor} must be positive.')
  if m.rope_scaling == 'llama3':
    _check(0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
           f'model.rope_low_freq_factor={m.rope_low_freq_factor} and model.rope_high_freq_factor='
           f'{m.rope_high_freq_factor} must satisfy 0 < low < high.')
    _check(m.rope_original_max_len > 0,
           f'model.rope_original_max_len={m.rope_original_max_len} must be positive.')
  _check(m.vocab_size >= tokenizer_vocab_size,
         f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's vocabulary "
         f'({tokenizer_vocab_size}); set model.vocab_size to at least that (a multiple of '
         '128 is fastest).')
  return choices


def _resolve_mesh(c: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int, int]:
  m = c.model
  try:
    mesh_shape = sharding.resolve_mesh_shape(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, num_devices)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh_shape
  tp = c.mesh.tensor
  _check(m.num_heads % tp == 0 and m.num_kv_heads % tp == 0,
         f'mesh.tensor={tp} must divide model.num_heads={m.num_heads} and '
         f'model.num_kv_heads={m.num_kv_heads}.')
  _check(m.mlp_dim % tp == 0, f'mesh.tensor={tp} must divide model.mlp_dim={m.mlp_dim}.')
  _check(m.vocab_size % tp == 0,
         f'mesh.tensor={tp} must divide model.vocab_size={m.vocab_size} (pad the vocabulary up).')
  _check(m.d_model % c.mesh.fsdp == 0,
         f'mesh.fsdp={c.mesh.fsdp} must divide model.d_model={m.d_model}.')
  return mesh_shape


def _resolve_batch(c: ml_collections.ConfigDict) -> tuple[int, int]:
  """Derives micro_batch_size and eval_batch_size; returns (accumulation steps, tokens per step)."""
  t = c.train
  dp = c.mesh.data * c.mesh.fsdp
  _check(c.data.seq_len > 0, f'data.seq_len must be positive, got {c.data.seq_len}.')
  _check(t.batch_size > 0 and t.micro_batch_size >= 0,
         f'train.batch_size={t.batch_size} must be positive and train.micro_batch_size='
         f'{t.micro_batch_size} non-negative.')
  if t.micro_batch_size == 0:
    _check(t.batch_size % dp == 0,
           f'train.batch_size={t.batch_size} is not a multiple of the {dp} data-parallel devices '
           '(mesh data×fsdp).')
    t.micro_batch_size = t.batch_size // dp
  per_pass = t.micro_batch_size * dp
  _check(t.batch_size % per_pass == 0,
         f'train.batch_size={t.batch_size} is not a multiple of train.micro_batch_size='
         f'{t.micro_batch_size} × {dp} data-parallel devices (mesh data×fsdp) = {per_pass}. '
         f'Use a batch_size that is a multiple of {per_pass}, or change micro_batch_size.')
  if t.eval_batch_size == 0:
    t.eval_batch_size = per_pass  # eval runs without accumulation: one micro-batch per device
  _check(t.eval_batch_size % dp == 0,
         f'train.eval_batch_size={t.eval_batch_size} must be a multiple of the {dp} '
         'data-parallel devices.')
  return t.batch_size // per_pass, t.batch_size * c.data.seq_len


def _resolve_schedule(t: ml_collections.ConfigDict, o: ml_collections.ConfigDict,
                      tokens_per_step: int) -> None:
  """Run length and warmup: steps win when given; otherwise derived from tokens (rounded up)."""
  if t.steps > 0:
    t.total_tokens = t.steps * tokens_per_step
  else:
    _check(t.total_tokens > 0, 'set train.steps or train.total_tokens (both are 0).')
    t.steps = math.ceil(t.total_tokens / tokens_per_step)
    t.total_tokens = t.steps * tokens_per_step
  if o.warmup_steps > 0:
    o.warmup_tokens = o.warmup_steps * tokens_per_step
  else:
    o.warmup_steps = math.ceil(o.warmup_tokens / tokens_per_step)
    o.warmup_tokens = o.warmup_steps * tokens_per_step
  _check(o.warmup_steps < t.steps,
         f'optim.warmup_steps={o.warmup_steps} must be smaller than train.steps={t.steps}.')
  _check(o.learning_rate > 0, f'optim.learning_rate={o.learning_rate} must be positive.')
  _check(0 <= o.min_learning_rate <= o.learning_rate,
         f'optim.min_learning_rate={o.min_learning_rate} must lie in [0, optim.learning_rate='
         f'{o.learning_rate}].')
  _check(o.grad_clip >= 0, f'optim.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping).')
  _choice(o, 'optim', 'mu_dtype', _DTYPES)


def _resolve_rest(c: ml_collections.ConfigDict) -> None:
  t = c.train
  _choice(t, 'train', 'on_nonfinite', ('halt', 'skip'))
  for field in ('log_every', 'eval_every'):
    _check(t[field] > 0, f'train.{field} must be positive, got {t[field]}.')
  for field in ('lm_eval_every', 'lm_eval_limit'):
    _check(t[field] >= 0, f'train.{field} must be >= 0, got {t[field]}.')
  _check(c.checkpoint.every_steps >= 0, 'checkpoint.every_steps must be >= 0.')
  profile_steps(t)
  _choice(c.data, 'data', 'on_bad_record', ('error', 'skip'))
  _choice(c.data, 'data', 'format', ('text', 'sft'))
  _check(c.data.format != 'sft' or c.model.attention in ('xla', 'cudnn'),
         f"model.attention={c.model.attention!r} cannot keep packed SFT examples apart "
         "(data.format='sft' needs a segment mask); use --config.model.attention=xla (any "
         "device) or cudnn (NVIDIA GPUs), or auto.")
  _check(not t.wandb_project or importlib.util.find_spec('wandb') is not None,
         f'train.wandb_project={t.wandb_project!r} needs wandb: `pip install wandb` (or leave '
         'train.wandb_project empty).')


def profile_steps(t: ml_collections.ConfigDict) -> tuple[int, int] | None:
  """train.profile_steps 'START:STOP' -> (START, STOP), the steps traced, both included; '' ->
  None. Raises ConfigError on anything else."""
  if not t.profile_steps:
    return None
  start, sep, stop = t.profile_steps.partition(':')
  _check(sep and start.strip().isdigit() and stop.strip().isdigit()
         and 0 < int(start) <= int(stop),
         f'train.profile_steps={t.profile_steps!r}: expected START:STOP with 0 < START <= STOP '
         "(e.g. 10:15), or '' for no profile.")
  return int(start), int(stop)


# Resuming a run with a changed config. Every field is one of: safe to change (accepted, one line
# each), or refused with the reason (the checkpoint's state or data position depends on it).
_SHAPE = ('the checkpoint holds parameters and optimizer state of the old shape, layout or dtype')
_TRAINED_WITH = 'the parameters were trained with the old value'
_STREAM = ('the checkpoint\'s data position counts batches of the old data stream, and '
           'train/tokens counts tokens of the old batch shape')
_LOSS_SCALE = ("a float16 run's train state holds its dynamic loss scale, other dtypes' do not "
               '(to resume on another card, give the old dtype: --config.model.dtype=OLD)')
RESUME_REFUSED = {
    **{f'model.{f}': _SHAPE for f in ('num_layers', 'd_model', 'num_heads', 'num_kv_heads',
                                      'head_dim', 'mlp_dim', 'vocab_size', 'tie_embeddings',
                                      'scan_layers', 'param_dtype')},
    'model.rope_theta': _TRAINED_WITH, 'model.norm_eps': _TRAINED_WITH,
    **{f'model.{f}': _TRAINED_WITH for f in ('rope_scaling', 'rope_factor', 'rope_low_freq_factor',
                                             'rope_high_freq_factor', 'rope_original_max_len')},
    'optim.mu_dtype': _SHAPE,
    **{f: _STREAM for f in ('train.batch_size', 'train.seed', 'data.seq_len', 'data.train',
                            'data.val', 'data.val_ratio', 'data.tokenizer', 'data.text_field',
                            'data.format')},
}
RESUME_SAFE = {
    'model.init_std',  # used only at initialization
    'model.max_position_embeddings',  # what a Hugging Face export states
    'model.attention', 'model.remat', 'model.dtype', 'model.fp8',  # how it is computed
    'data.tfds_data_dir', 'data.on_bad_record', 'data.num_workers', 'data.read_threads',
    'data.prefetch',
    'train.steps', 'train.total_tokens', 'train.micro_batch_size', 'train.log_every',
    'train.eval_every', 'train.eval_steps', 'train.eval_batch_size', 'train.peak_flops',
    'train.on_nonfinite', 'train.max_consecutive_skips', 'train.sample_prompt',
    'train.sample_tokens', 'train.lm_eval_tasks', 'train.lm_eval_every',
    'train.lm_eval_include_path', 'train.lm_eval_limit', 'train.wandb_project',
    'train.wandb_entity', 'train.wandb_run_name', 'train.profile_steps',
    'optim.learning_rate', 'optim.min_learning_rate', 'optim.warmup_steps', 'optim.warmup_tokens',
    'optim.b1', 'optim.b2', 'optim.eps', 'optim.weight_decay',
    'optim.grad_clip',  # its value; turning clipping on or off changes the optimizer state
    'mesh.data', 'mesh.fsdp', 'mesh.tensor',  # checkpoints restore onto any mesh
    'checkpoint.every_steps', 'checkpoint.keep', 'checkpoint.keep_best', 'checkpoint.async_save',
    'checkpoint.save_final',
    'checkpoint.restore_from',  # used only when the workdir has no checkpoint
}


def resume_changes(saved: dict, config: ml_collections.ConfigDict) -> dict[str, tuple]:
  """{'group.field': (checkpoint's value, this config's)} of every resolved field that differs
  from the checkpoint's config (saved: its dict). Raises ConfigError listing the refused ones."""
  old = from_dict(saved)
  changes, refused = {}, {}  # reason -> the fields it refuses
  for group in config:
    for name in config[group]:
      field, before, after = f'{group}.{name}', old[group][name], config[group][name]
      if before == after:
        continue
      changes[field] = (before, after)
      reason = RESUME_REFUSED.get(field)
      if field == 'optim.grad_clip' and (before > 0) != (after > 0):
        reason = _SHAPE  # clipping on or off: another optimizer state
      if (field == 'model.dtype' and (before == 'float16') != (after == 'float16')
          and _AUTO_DTYPE not in (before, after)):
        reason = _LOSS_SCALE  # float16 on or off: the train state gains or loses its loss scale
      if reason:
        refused.setdefault(reason, []).append(f'{field} {before!r} -> {after!r}')
  if refused:
    raise ConfigError(
        'cannot resume with this config: ' + '; '.join(
            f'{", ".join(fields)} ({reason})' for reason, fields in refused.items())
        + '. Resume with the old values, or start a new run from these params: '
        '--config.checkpoint.restore_from=WORKDIR --workdir=NEW (fresh optimizer and data order).')
  return changes


def model_config(config: ml_collections.ConfigDict) -> model_lib.ModelConfig:
  return model_lib.ModelConfig.from_config(config.model)
