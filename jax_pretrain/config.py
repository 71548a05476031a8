"""The config: every field declared once, and its resolution and validation.

Each group is a table of `Field`s, one line each: its name, default, resume policy and one line of
doc (and its former name, where it moved). `defaults()`, the moved-name map `MOVED`, the resume
policy (`resume_changes`) and the typed, frozen view of each group after resolution (`OptimConfig`,
...) are all derived from these tables. Presets (configs/*.py) start from `defaults()` and override
what differs. `resolve` fills in every value a user may leave to be derived (0 or -1 below), checks
the whole config group by group (the `_resolve_*` functions), and returns a locked copy; errors
name the field and the numbers that disagree. Everything downstream reads the resolved config (or
its views) and never re-derives.
"""
import dataclasses
import importlib.util
import json
import math
import os
from typing import Any, Callable

import jax
import ml_collections

from jax_pretrain import PRESETS_DIR
from jax_pretrain import model as model_lib
from jax_pretrain import sharding
from jax_pretrain.errors import UserError
from jax_pretrain.kernels import attention

# Resume policies. A field is safe to change when a run resumes (the change is accepted and
# printed), or refused with the reason: the checkpoint's state or data position depends on it.
SAFE = ''
SHAPE = 'the checkpoint holds parameters and optimizer state of the old shape, layout or dtype'
TRAINED = 'the parameters were trained with the old value'
STREAM = ("the checkpoint's data position counts batches of the old data stream, and "
          'train/tokens counts tokens of the old batch shape')
_LOSS_SCALE = ("a float16 run's train state holds its dynamic loss scale, other dtypes' do not "
               '(to resume on another card, give the old dtype: --config.model.dtype=OLD)')
_AUTO_DTYPE = 'auto'
def _float16_toggled(before, after) -> str:
  """model.dtype: float16 on or off changes the train state (it gains or loses its loss scale)."""
  toggled = (before == 'float16') != (after == 'float16') and _AUTO_DTYPE not in (before, after)
  return _LOSS_SCALE if toggled else SAFE


def _clipping_toggled(before, after) -> str:
  """optim.grad_clip: its value is safe to change; turning clipping on or off is another state."""
  return SHAPE if (before > 0) != (after > 0) else SAFE


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field. resume: SAFE, the reason a resumed run refuses a change, or a function of
  (old value, new value) giving one of those; was: its former 'group.name' (older configs and
  config.json files that use it still load)."""
  name: str
  default: Any
  resume: str | Callable[[Any, Any], str]
  doc: str
  was: str = ''

  def refusal(self, before, after) -> str:
    """Why a resumed run refuses changing this field from before to after ('' : it accepts)."""
    return self.resume(before, after) if callable(self.resume) else self.resume


F = Field

MODEL = (
    F('num_layers', 12, SHAPE, 'transformer blocks'),
    F('d_model', 512, SHAPE, 'residual stream width'),
    F('num_heads', 8, SHAPE, 'query heads'),
    F('num_kv_heads', 8, SHAPE, 'key/value heads (grouped-query attention); divides num_heads'),
    F('head_dim', 0, SHAPE, '0: d_model // num_heads'),
    F('mlp_dim', 1408, SHAPE, 'SwiGLU hidden width (about 8/3 d_model, a multiple of 128)'),
    F('vocab_size', 32768, SHAPE, "embedding rows; >= the tokenizer's vocabulary"),
    F('tie_embeddings', True, SHAPE, 'share the input embedding with the output projection'),
    F('rope_theta', 10000.0, TRAINED, 'rotary embedding base'),
    F('rope_scaling', 'none', TRAINED, "'none' | 'linear' | 'llama3': rescaled rotary frequencies"),
    F('rope_factor', 1.0, TRAINED, 'linear, llama3: low frequencies (all, for linear) divided by '
      'this'),
    F('rope_low_freq_factor', 1.0, TRAINED, 'llama3: wavelengths > original_max_len / this are '
      'scaled'),
    F('rope_high_freq_factor', 4.0, TRAINED, 'llama3: wavelengths < original_max_len / this are '
      'kept'),
    F('rope_original_max_len', 8192, TRAINED, 'llama3: the context length the model was '
      'pretrained at'),
    F('max_position_embeddings', 0, SAFE, 'context length a Hugging Face export states (0: '
      "data.seq_len); an import keeps its checkpoint's"),
    F('norm_eps', 1e-5, TRAINED, 'RMSNorm epsilon'),
    F('init_std', 0.02, SAFE, 'normal init std (output projections scaled by 1/sqrt(2*layers)); '
      'used only at initialization'),
    F('attention', 'auto', SAFE, "'auto' (cuDNN where it runs, else XLA) | 'xla' | 'cudnn' | "
      "'pallas'"),
    F('remat', 'auto', SAFE, "'auto' (dots with fused attention, else full; full where the fit "
      "needs it: memory.fit_micro_batch) | 'none' | 'full' | 'dots' | 'dots_no_batch' | 'minimal'"),
    F('scan_layers', True, SHAPE, 'scan over stacked layers (compile time independent of depth)'),
    F('dtype', _AUTO_DTYPE, _float16_toggled, "compute dtype: 'auto' (bfloat16 on TPUs and NVIDIA "
      'sm_80+, float16 with loss scaling on older NVIDIA GPUs, float32 on the CPU) | '
      "'bfloat16' | 'float16' | 'float32'; params and optimizer state stay float32"),
    F('param_dtype', 'float32', SHAPE, 'master parameter dtype'),
    F('fp8', False, SAFE, 'attention and MLP projections in FP8 (Hopper/Ada GPUs; simulated on '
      'the CPU): per-tensor current scaling, jax_pretrain/fp8.py'),
)

DATA = (
    F('seq_len', 2048, STREAM, 'tokens per training sequence'),
    F('format', 'text', STREAM, "'text': documents (pretraining) | 'sft': JSONL prompt/completion "
      'or chat messages, packed, loss on completions (docs/data.md)'),
    F('train', '', STREAM, "required: 'SOURCE[#field][:weight],...' (docs/data.md)"),
    F('val', '', STREAM, "eval sources; '' carves val_ratio from the training data"),
    F('val_ratio', 0.05, STREAM, "share of the training data held out for eval when val is ''"),
    F('tokenizer', '', STREAM, "'': from the data (else bytes); 'byte'; a sentencepiece .model; "
      'a tokenizer.json, or a directory with one (docs/data.md)'),
    F('text_field', 'text', STREAM, 'JSONL key, Parquet column or TFDS feature that holds the '
      'text'),
    F('tfds_data_dir', '', SAFE, "TFDS data_dir for tfds:NAME sources ('': "
      '~/tensorflow_datasets)'),
    F('on_bad_record', 'error', SAFE, "bad raw-text lines: 'error' | 'skip' (counted, reported per "
      'file)'),
    F('num_workers', 0, SAFE, 'grain worker processes for batches (0: threads in this process)'),
    F('read_threads', 2, SAFE, 'threads assembling batches in each process'),
    F('prefetch', 4, SAFE, 'batches buffered ahead of the trainer'),
)

TRAIN = (
    F('steps', 0, SAFE, 'optimizer steps; 0: derive from total_tokens'),
    F('total_tokens', 0, SAFE, 'run length in tokens (alternative to steps)'),
    F('batch_size', 64, STREAM, 'global batch, in sequences'),
    F('micro_batch_size', 0, SAFE, 'sequences per data-parallel device per forward/backward; 0: '
      'on a GPU the largest that fits (compiled at start-up, printed), else batch_size / '
      'data-parallel devices (no accumulation)'),
    F('seed', 0, STREAM, 'parameter init and data order'),
    F('log_every', 10, SAFE, 'steps between logged scalars'),
    F('eval_every', 500, SAFE, 'steps between evals (and at the end)'),
    F('eval_steps', 20, SAFE, 'eval batches per eval'),
    F('eval_batch_size', 0, SAFE, '0: micro_batch_size × data-parallel devices (one pass, no '
      'OOM)'),
    F('peak_flops', 0.0, SAFE, 'device peak dense bf16 FLOP/s for MFU; 0: look up by device kind'),
    F('on_nonfinite', 'halt', SAFE, "non-finite loss or grad norm: 'halt' (checkpoints intact) | "
      "'skip'"),
    F('max_consecutive_skips', 10, SAFE, "with 'skip': halt after this many non-finite steps in a "
      'row'),
    F('sample_prompt', 'The ', SAFE, "prompt of the continuation printed at the end ('' "
      'disables)'),
    F('sample_tokens', 64, SAFE, 'tokens generated for that continuation'),
    # Downstream evals during training through lm-evaluation-harness (jax_pretrain/lm_eval.py).
    F('lm_eval_tasks', '', SAFE, "tasks, comma-separated ('' : none), logged as "
      'lm_eval/TASK/METRIC'),
    F('lm_eval_every', 0, SAFE, 'steps between them; 0: at every eval (eval_every) and the end'),
    F('lm_eval_include_path', '', SAFE, "a folder of extra task YAMLs (lm_eval's --include_path)"),
    F('lm_eval_limit', 0, SAFE, 'examples per task at most; 0: all'),
    F('wandb_project', '', SAFE, "Weights & Biases project: the scalars go there too ('': off)"),
    F('wandb_entity', '', SAFE, "its team or user ('': your default entity)"),
    F('wandb_run_name', '', SAFE, "the run's name there ('': the workdir's name)"),
    F('profile_steps', '', SAFE, "'START:STOP': trace those steps (jax.profiler) to "
      'WORKDIR/profile'),
)

OPTIM = (
    F('learning_rate', 3e-4, SAFE, 'peak learning rate', was='train.learning_rate'),
    F('min_learning_rate', 3e-5, SAFE, 'end of the cosine decay', was='train.min_learning_rate'),
    F('warmup_steps', 0, SAFE, 'linear warmup; 0: derive from warmup_tokens',
      was='train.warmup_steps'),
    F('warmup_tokens', 0, SAFE, 'warmup in tokens (alternative to warmup_steps)',
      was='train.warmup_tokens'),
    F('b1', 0.9, SAFE, 'AdamW beta1', was='train.b1'),
    F('b2', 0.95, SAFE, 'AdamW beta2', was='train.b2'),
    F('eps', 1e-8, SAFE, 'AdamW epsilon', was='train.eps'),
    F('weight_decay', 0.1, SAFE, 'decoupled weight decay (not applied to norms or other 1-D '
      'params)', was='train.weight_decay'),
    F('grad_clip', 1.0, _clipping_toggled, 'clip by global norm; 0 disables',
      was='train.grad_clip'),
    F('mu_dtype', 'float32', SHAPE, "AdamW first-moment dtype; 'bfloat16' halves its memory"),
)

MESH = (  # safe to change: checkpoints restore onto any mesh
    F('data', -1, SAFE, 'data-parallel axis size; -1: all remaining devices'),
    F('fsdp', sharding.AUTO_FSDP, SAFE, 'parameter-sharded data-parallel axis size; 0: 1 '
      '(plain data parallelism) unless the state does not fit that way (a GPU and '
      'train.micro_batch_size=0 try more: memory.fit_micro_batch), or the devices data and tensor '
      'leave when neither is -1'),
    F('tensor', 1, SAFE, 'tensor-parallel axis size (heads, MLP, vocab)'),
)

CHECKPOINT = (
    F('restore_from', '', SAFE, "another run's workdir: start from its params (new optimizer, "
      'data); used only when the workdir has no checkpoint'),
    F('every_steps', 1000, SAFE, 'steps between (asynchronous) saves; 0: only the final save'),
    F('keep', 2, SAFE, 'keep the latest this many checkpoints'),
    F('keep_best', 3, SAFE, 'and also the best this many by eval loss (0: none)'),
    F('async_save', True, SAFE, 'write in the background while training continues'),
    F('save_final', True, SAFE, 'save the state at the end of training'),
)

# The trainer's groups: every config has them.
GROUPS = {'model': MODEL, 'data': DATA, 'train': TRAIN, 'optim': OPTIM, 'mesh': MESH,
          'checkpoint': CHECKPOINT}
FIELDS = {f'{group}.{f.name}': f for group, fields in GROUPS.items() for f in fields}

# Fields that moved between groups: configs and config.json files written before still load.
MOVED = {tuple(f.was.split('.')): tuple(name.split('.')) for name, f in FIELDS.items() if f.was}


@dataclasses.dataclass(frozen=True)
class Group:
  """A program's own config group (e.g. grpo's, jax_pretrain/grpo/config.py): its fields and the
  check of its resolved values. A config has it only where the program's config adds it
  (defaults(group)); resolve checks it there."""
  name: str
  fields: tuple[Field, ...]
  resolve: Callable[[ml_collections.ConfigDict], None]


_PROGRAM_GROUPS: dict[str, Group] = {}  # registered by the modules that define them


def register(group: Group) -> Group:
  """Makes a program's group known to from_dict, resolve and resume_changes."""
  _PROGRAM_GROUPS[group.name] = group
  return group


def _fields(group: str) -> tuple[Field, ...]:
  return GROUPS[group] if group in GROUPS else _PROGRAM_GROUPS[group].fields


def defaults(*groups: Group) -> ml_collections.ConfigDict:
  """Every field of the trainer's groups (and of the programs' `groups`) at its default, as the
  tables declare them."""
  tables = {**GROUPS, **{g.name: g.fields for g in groups}}
  return ml_collections.ConfigDict(
      {group: {f.name: f.default for f in fields} for group, fields in tables.items()})


def view_class(group: str, fields: tuple[Field, ...], doc: str) -> type:
  """A frozen dataclass of the group's fields (their types those of the defaults), built from
  the resolved group by from_config."""
  cls = dataclasses.make_dataclass(
      f'{group.capitalize()}Config', [(f.name, type(f.default)) for f in fields],
      frozen=True, namespace={'from_config': classmethod(
          lambda cls, g: cls(**{f.name: g[f.name] for f in dataclasses.fields(cls)}))})
  cls.__doc__ = doc
  cls.__module__ = __name__
  return cls


# Typed, frozen views of the resolved groups (the model group's is model.ModelConfig).
DataConfig = view_class('data', GROUPS['data'], 'The resolved data group.')
TrainConfig = view_class('train', GROUPS['train'], 'The resolved train group.')
OptimConfig = view_class('optim', GROUPS['optim'], 'The resolved optim group.')
MeshConfig = view_class('mesh', GROUPS['mesh'],
                        'The resolved mesh group: every axis size is known.')
CheckpointConfig = view_class('checkpoint', GROUPS['checkpoint'], 'The resolved checkpoint group.')


def model_config(config: ml_collections.ConfigDict) -> model_lib.ModelConfig:
  return model_lib.ModelConfig.from_config(config.model)


def data_config(config: ml_collections.ConfigDict) -> DataConfig:
  return DataConfig.from_config(config.data)


def train_config(config: ml_collections.ConfigDict) -> TrainConfig:
  return TrainConfig.from_config(config.train)


def optim_config(config: ml_collections.ConfigDict) -> OptimConfig:
  return OptimConfig.from_config(config.optim)


def mesh_config(config: ml_collections.ConfigDict) -> MeshConfig:
  return MeshConfig.from_config(config.mesh)


def checkpoint_config(config: ml_collections.ConfigDict) -> CheckpointConfig:
  return CheckpointConfig.from_config(config.checkpoint)


def from_dict(saved: dict, strict: bool = False,
              groups: tuple[Group, ...] = ()) -> ml_collections.ConfigDict:
  """A config from a (possibly older) dict, over today's defaults: fields it lacks keep their
  defaults and moved fields go to their new group. It has the trainer's groups, `groups`, and the
  registered program groups that `saved` has (another program's group in a run's config.json,
  e.g. grpo's, is dropped where its module is not loaded). Unknown fields are dropped (a
  config.json of another version), or with strict=True refused, naming the field (a typo in a
  config file)."""
  c = defaults(*groups, *(g for name, g in _PROGRAM_GROUPS.items() if name in saved))
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


def fine_tune(c: ml_collections.ConfigDict, run: str, config_file: str) -> None:
  """c (changed in place) fine-tunes a trained run: its model group and seq_len are the run's
  (its config.json) and checkpoint.restore_from is the run. `run` may also name a preset
  (configs/NAME.py, e.g. 'xlarge'): its model and seq_len, no params (to plan a run: python -m
  jax_pretrain.plan --grpo --config=configs/grpo.py:xlarge). config_file: how the user named it,
  for the message when the run has no config.json."""
  path = os.path.join(run, 'config.json')
  if not os.path.isdir(run) and os.path.isfile(os.path.join(PRESETS_DIR, f'{run}.py')):
    saved = preset(run)
  elif not os.path.isfile(path):
    raise ConfigError(f"--config={config_file}:{run}: {path} not found (a run's workdir holds "
                      'it; or name a preset, e.g. xlarge).')
  else:
    with open(path, encoding='utf-8') as f:
      saved = from_dict(json.load(f))
    c.checkpoint.restore_from = run
  c.model, c.data.seq_len = saved.model, saved.data.seq_len


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
  # Optimizer updates per loop step (train.Program.updates_per_step: GRPO's num_iterations, else
  # 1). The schedule counts updates; train.steps and optim.warmup_steps count loop steps.
  updates_per_step: int = 1


_DTYPES = ('float32', 'bfloat16', 'float16')


def check(ok: bool, message: str) -> None:
  """Raises ConfigError(message) unless ok: a group's check (resolve, a program's group)."""
  if not ok:
    raise ConfigError(message)


def choice(group: ml_collections.ConfigDict, where: str, field: str, choices) -> None:
  """Raises ConfigError naming where.field unless its value is one of choices."""
  check(group[field] in choices, f'{where}.{field}={group[field]!r}: choose one of '
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
  for group in c:
    if group in _PROGRAM_GROUPS:
      _PROGRAM_GROUPS[group].resolve(c[group])
  c.lock()
  return c, RunShape(mesh_shape=mesh_shape, grad_accum_steps=accum,
                     tokens_per_step=tokens_per_step, choices=tuple(choices))



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
  choice(m, 'model', 'attention', attention.IMPLEMENTATIONS + (attention.AUTO,))
  choice(m, 'model', 'remat', tuple(model_lib.REMAT_POLICIES) + (model_lib.AUTO_REMAT,))
  choice(m, 'model', 'dtype', _DTYPES + (_AUTO_DTYPE,))
  choice(m, 'model', 'param_dtype', _DTYPES)
  for field in ('num_layers', 'd_model', 'num_heads', 'num_kv_heads', 'mlp_dim', 'vocab_size'):
    check(m[field] > 0, f'model.{field} must be positive, got {m[field]}.')
  check(m.num_heads % m.num_kv_heads == 0,
         f'model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}.')
  if m.head_dim == 0:
    check(m.d_model % m.num_heads == 0,
           f'model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; '
           'set model.head_dim explicitly.')
    m.head_dim = m.d_model // m.num_heads
  check(m.head_dim % 2 == 0, f'model.head_dim={m.head_dim} must be even (rotary embeddings).')
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
  check(reason is None, reason)
  if m.remat == model_lib.AUTO_REMAT:
    # 'dots' keeps every matmul output for the backward pass and recomputes only the cheap rest.
    # With XLA's attention, the T×T attention scores are matmul outputs too: 'dots' would keep
    # them for every layer (xlarge, one H100, micro-batch 8: 116 GiB against 50 with cuDNN), so
    # there 'full' recomputes each layer instead (1.25× the matmul FLOPs).
    m.remat = 'full' if m.attention == 'xla' else 'dots'
    choices.append(f'remat {m.remat} (auto: attention {m.attention})')
  if m.fp8 and backend == 'gpu':
    capability = getattr(device, 'compute_capability', None)
    check(capability is None or tuple(int(x) for x in capability.split('.')[:2]) >= (8, 9),
           f'model.fp8=True needs FP8 matmuls (an NVIDIA GPU of compute capability >= 8.9: '
           f'Hopper, Ada); this {getattr(device, "device_kind", "GPU")} has {capability}. '
           'Leave model.fp8 off.')
  choice(m, 'model', 'rope_scaling', model_lib.ROPE_SCALINGS)
  if m.rope_scaling != 'none':
    check(m.rope_factor > 0, f'model.rope_factor={m.rope_factor} must be positive.')
  if m.rope_scaling == 'llama3':
    check(0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
           f'model.rope_low_freq_factor={m.rope_low_freq_factor} and model.rope_high_freq_factor='
           f'{m.rope_high_freq_factor} must satisfy 0 < low < high.')
    check(m.rope_original_max_len > 0,
           f'model.rope_original_max_len={m.rope_original_max_len} must be positive.')
  check(m.vocab_size >= tokenizer_vocab_size,
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
  check(m.num_heads % tp == 0 and m.num_kv_heads % tp == 0,
         f'mesh.tensor={tp} must divide model.num_heads={m.num_heads} and '
         f'model.num_kv_heads={m.num_kv_heads}.')
  check(m.mlp_dim % tp == 0, f'mesh.tensor={tp} must divide model.mlp_dim={m.mlp_dim}.')
  check(m.vocab_size % tp == 0,
         f'mesh.tensor={tp} must divide model.vocab_size={m.vocab_size} (pad the vocabulary up).')
  check(m.d_model % c.mesh.fsdp == 0,
         f'mesh.fsdp={c.mesh.fsdp} must divide model.d_model={m.d_model}.')
  return mesh_shape


def _resolve_batch(c: ml_collections.ConfigDict) -> tuple[int, int]:
  """Derives micro_batch_size and eval_batch_size; returns (accumulation steps, tokens per step)."""
  t = c.train
  dp = c.mesh.data * c.mesh.fsdp
  check(c.data.seq_len > 0, f'data.seq_len must be positive, got {c.data.seq_len}.')
  check(t.batch_size > 0 and t.micro_batch_size >= 0,
         f'train.batch_size={t.batch_size} must be positive and train.micro_batch_size='
         f'{t.micro_batch_size} non-negative.')
  if t.micro_batch_size == 0:
    check(t.batch_size % dp == 0,
           f'train.batch_size={t.batch_size} is not a multiple of the {dp} data-parallel devices '
           '(mesh data×fsdp).')
    t.micro_batch_size = t.batch_size // dp
  per_pass = t.micro_batch_size * dp
  check(t.batch_size % per_pass == 0,
         f'train.batch_size={t.batch_size} is not a multiple of train.micro_batch_size='
         f'{t.micro_batch_size} × {dp} data-parallel devices (mesh data×fsdp) = {per_pass}. '
         f'Use a batch_size that is a multiple of {per_pass}, or change micro_batch_size.')
  if t.eval_batch_size == 0:
    t.eval_batch_size = per_pass  # eval runs without accumulation: one micro-batch per device
  check(t.eval_batch_size % dp == 0,
         f'train.eval_batch_size={t.eval_batch_size} must be a multiple of the {dp} '
         'data-parallel devices.')
  return t.batch_size // per_pass, t.batch_size * c.data.seq_len


def _resolve_schedule(t: ml_collections.ConfigDict, o: ml_collections.ConfigDict,
                      tokens_per_step: int) -> None:
  """Run length and warmup: steps win when given; otherwise derived from tokens (rounded up)."""
  if t.steps > 0:
    t.total_tokens = t.steps * tokens_per_step
  else:
    check(t.total_tokens > 0, 'set train.steps or train.total_tokens (both are 0).')
    t.steps = math.ceil(t.total_tokens / tokens_per_step)
    t.total_tokens = t.steps * tokens_per_step
  if o.warmup_steps > 0:
    o.warmup_tokens = o.warmup_steps * tokens_per_step
  else:
    o.warmup_steps = math.ceil(o.warmup_tokens / tokens_per_step)
    o.warmup_tokens = o.warmup_steps * tokens_per_step
  check(o.warmup_steps < t.steps,
         f'optim.warmup_steps={o.warmup_steps} must be smaller than train.steps={t.steps}.')
  check(o.learning_rate > 0, f'optim.learning_rate={o.learning_rate} must be positive.')
  check(0 <= o.min_learning_rate <= o.learning_rate,
         f'optim.min_learning_rate={o.min_learning_rate} must lie in [0, optim.learning_rate='
         f'{o.learning_rate}].')
  check(o.grad_clip >= 0, f'optim.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping).')
  choice(o, 'optim', 'mu_dtype', _DTYPES)


def _resolve_rest(c: ml_collections.ConfigDict) -> None:
  t = c.train
  choice(t, 'train', 'on_nonfinite', ('halt', 'skip'))
  for field in ('log_every', 'eval_every'):
    check(t[field] > 0, f'train.{field} must be positive, got {t[field]}.')
  for field in ('lm_eval_every', 'lm_eval_limit'):
    check(t[field] >= 0, f'train.{field} must be >= 0, got {t[field]}.')
  check(c.checkpoint.every_steps >= 0, 'checkpoint.every_steps must be >= 0.')
  profile_steps(t)
  choice(c.data, 'data', 'on_bad_record', ('error', 'skip'))
  choice(c.data, 'data', 'format', ('text', 'sft'))
  check(c.data.format != 'sft' or c.model.attention in ('xla', 'cudnn'),
         f"model.attention={c.model.attention!r} cannot keep packed SFT examples apart "
         "(data.format='sft' needs a segment mask); use --config.model.attention=xla (any "
         "device) or cudnn (NVIDIA GPUs), or auto.")
  check(not t.wandb_project or importlib.util.find_spec('wandb') is not None,
         f'train.wandb_project={t.wandb_project!r} needs wandb: `pip install wandb` (or leave '
         'train.wandb_project empty).')


def unescape(text: str) -> str:
  """A config string with its backslash escapes read ('\\n' -> a newline); other characters,
  non-ASCII ones too, as they are. Raises ValueError on a broken escape."""
  return text.encode('latin-1', 'backslashreplace').decode('unicode_escape')


def profile_steps(t: ml_collections.ConfigDict) -> tuple[int, int] | None:
  """train.profile_steps 'START:STOP' -> (START, STOP), the steps traced, both included; '' ->
  None. Raises ConfigError on anything else."""
  if not t.profile_steps:
    return None
  start, sep, stop = t.profile_steps.partition(':')
  check(sep and start.strip().isdigit() and stop.strip().isdigit()
         and 0 < int(start) <= int(stop),
         f'train.profile_steps={t.profile_steps!r}: expected START:STOP with 0 < START <= STOP '
         "(e.g. 10:15), or '' for no profile.")
  return int(start), int(stop)


def resume_changes(saved: dict, config: ml_collections.ConfigDict) -> dict[str, tuple]:
  """{'group.field': (checkpoint's value, this config's)} of every resolved field that differs
  from the checkpoint's config (saved: its dict). Raises ConfigError listing the refused ones."""
  old = from_dict(saved, groups=tuple(_PROGRAM_GROUPS[g] for g in config if g in _PROGRAM_GROUPS))
  changes, refused = {}, {}  # reason -> the fields it refuses
  for group in config:
    fields = {f.name: f for f in _fields(group)}
    for name in config[group]:
      field, before, after = f'{group}.{name}', old[group][name], config[group][name]
      if before == after:
        continue
      changes[field] = (before, after)
      reason = fields[name].refusal(before, after)
      if reason:
        refused.setdefault(reason, []).append(f'{field} {before!r} -> {after!r}')
  if refused:
    raise ConfigError(
        'cannot resume with this config: ' + '; '.join(
            f'{", ".join(fields)} ({reason})' for reason, fields in refused.items())
        + '. Resume with the old values, or start a new run from these params: '
        '--config.checkpoint.restore_from=WORKDIR --workdir=NEW (fresh optimizer and data order).')
  return changes

