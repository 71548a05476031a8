"""The config: one frozen dataclass per group, every field declared once, and its resolution and
validation.

Each group is a frozen dataclass (ModelConfig, DataConfig, TrainConfig, OptimConfig, MeshConfig,
CheckpointConfig; a program may add its own, e.g. grpo's GrpoConfig in jax_pretrain/grpo/config.py)
whose fields are each declared once, with `field(default, resume policy, doc)` (and their former
name, where they moved); `Config` holds the groups (levanter's TrainLmConfig is the model).
`defaults()`, `FIELDS`, the moved-name map `MOVED` and the resume policy (`resume_changes`) are
derived from these classes: there is no other table.

ml_collections ConfigDicts live only where configs are written: config files (configs/*.py start
from `defaults()` and override what differs), `--config.GROUP.FIELD=` overrides (cli.py) and a
run's config.json (`from_dict`). `resolve` takes one (or a `Config`), fills in every value a user
may leave to be derived (0, -1 or 'auto' below), checks the whole config group by group (the
`_resolve_*` functions), and returns a `Config` with every value decided; errors name the field
and the numbers that disagree. Everything downstream reads that `Config` (the model its
ModelConfig: model.Transformer) and never re-derives.
"""
import dataclasses
import importlib.util
import json
import math
import os
import typing
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jax_pretrain import PRESETS_DIR
from jax_pretrain import fp8
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
_FP8_STATE = ("an FP8 run's train state holds its projections' amax histories, other runs' do "
              'not')
_AUTO_DTYPE = 'auto'
AUTO_REMAT = 'auto'  # resolved by resolve: 'dots' with fused attention, else 'full'
# model.layers: 'scan' runs one layer's program L times (compile time independent of depth, but
# XLA copies the stacked activations and weight gradients in and out of the loop every
# micro-batch); 'unroll' compiles every layer (no such copies; compile time grows with depth).
# 'auto' unrolls on a GPU up to UNROLL_MAX_LAYERS layers (BENCHMARKS.md: the compiled steps and
# compile times), else scans; the trainer's fit (memory.fit_micro_batch) scans where no unrolled
# step fits one sequence per device (an unrolled step holds more at once).
AUTO_LAYERS = 'auto'
LAYERS = ('scan', 'unroll')
UNROLL_MAX_LAYERS = 48
# Fields that no longer exist, and what replaced them: a config file or override naming one is
# told; a run's config.json that has one still loads (the field is dropped).
RETIRED = {('model', 'scan_layers'): "model.layers='scan'|'unroll'|'auto' replaced it (the "
           'params and checkpoints are the same either way)'}
# model.remat's policies: what the backward pass keeps of each block (the rest is recomputed).
# 'dots' and 'dots_no_batch' keep the fused attention kernel's output and softmax statistics too
# (attention.forward_saveable): without them the backward ran the attention forward again.
# With model.fp8 a projection's matmul output is float32, scaled and cast after it (fp8.py): they
# keep that cast output (fp8.OUTPUT), and the float32 one is then not kept.
_policies = jax.checkpoint_policies
_WITH_FP8 = _policies.save_from_both_policies(attention.forward_saveable,
                                              _policies.save_only_these_names(fp8.OUTPUT))
_DOTS = _policies.save_from_both_policies(_policies.dots_saveable, _WITH_FP8)
REMAT_POLICIES = {
    'none': None,  # keep every activation
    'full': _policies.nothing_saveable,  # recompute the whole block in backward
    'dots': _DOTS,  # keep matmul outputs (and fused attention's), recompute the rest
    'dots_no_batch': _policies.save_from_both_policies(  # projections only (and fused attention)
        _policies.dots_with_no_batch_dims_saveable, _WITH_FP8),
    'minimal': _policies.save_only_these_names('attn_out', 'mlp_hidden'),
}
# What 'dots' keeps besides, with the layers unrolled: the values whose recomputation in the
# backward costs passes of their own (model.py names them: the norms' outputs, the rotated
# queries and keys, SwiGLU's product, the residual between attention and MLP; with FP8, the
# projections' quantized operands instead of their inputs). Scanned, each kept value is one more
# stacked residual that XLA copies every micro-batch, and the step is slower (BENCHMARKS.md).
_DOTS_UNROLLED = {
    False: _policies.save_from_both_policies(_DOTS, _policies.save_only_these_names(
        'normed', 'rotated', 'mlp_hidden', 'residual')),
    True: _policies.save_from_both_policies(_DOTS, _policies.save_only_these_names(
        'rotated', 'residual', fp8.QUANTIZED)),
}
ROPE_SCALINGS = ('none', 'linear', 'llama3')  # model.rope_scaling (model.rope_frequencies)
_DTYPES = ('float32', 'bfloat16', 'float16')
_FP8_GRADIENTS = fp8.GRADIENT_FORMAT  # (in ModelConfig, `fp8` names its field)

Resume = str | Callable[[Any, Any], str]


def _float16_toggled(before, after) -> str:
  """model.dtype: float16 on or off changes the train state (it gains or loses its loss scale)."""
  toggled = (before == 'float16') != (after == 'float16') and _AUTO_DTYPE not in (before, after)
  return _LOSS_SCALE if toggled else SAFE


def _fp8_toggled(before, after) -> str:
  """model.fp8: on or off changes the train state (it gains or loses the amax histories)."""
  return _FP8_STATE if before != after else SAFE


def _clipping_toggled(before, after) -> str:
  """optim.grad_clip: its value is safe to change; turning clipping on or off is another state."""
  return SHAPE if (before > 0) != (after > 0) else SAFE


def field[T](default: T, resume: Resume, doc: str, was: str = '') -> T:
  """A config field: its default, its resume policy (SAFE, the reason a resumed run refuses a
  change, or a function of (old value, new value) giving one of those), one line of doc, and its
  former 'group.name' (older configs and config.json files that use it still load)."""
  return dataclasses.field(default=default, metadata={'resume': resume, 'doc': doc, 'was': was})


@dataclasses.dataclass(frozen=True)
class Field:
  """A group's field as `field` declared it (fields(group) lists them)."""
  name: str
  default: Any
  resume: Resume
  doc: str
  was: str = ''

  def refusal(self, before, after) -> str:
    """Why a resumed run refuses changing this field from before to after ('' : it accepts)."""
    return self.resume(before, after) if callable(self.resume) else self.resume


def fields(group: Any) -> tuple[Field, ...]:
  """The fields of a group's dataclass (or of a group), as `field` declared them."""
  return tuple(Field(f.name, f.default, f.metadata['resume'], f.metadata['doc'],
                     f.metadata['was']) for f in dataclasses.fields(group))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model group: the transformer's shape and numerics, as model.Transformer reads it."""
  num_layers: int = field(12, SHAPE, 'transformer blocks')
  d_model: int = field(512, SHAPE, 'residual stream width')
  num_heads: int = field(8, SHAPE, 'query heads')
  num_kv_heads: int = field(8, SHAPE, 'key/value heads (grouped-query attention); divides '
      'num_heads')
  head_dim: int = field(0, SHAPE, '0: d_model // num_heads')
  mlp_dim: int = field(1408, SHAPE, 'SwiGLU hidden width (about 8/3 d_model, a multiple of 128)')
  vocab_size: int = field(32768, SHAPE, "embedding rows; >= the tokenizer's vocabulary")
  tie_embeddings: bool = field(True, SHAPE, 'share the input embedding with the output projection')
  rope_theta: float = field(10000.0, TRAINED, 'rotary embedding base')
  rope_scaling: str = field('none', TRAINED, "'none' | 'linear' | 'llama3': rescaled rotary "
      'frequencies')
  rope_factor: float = field(1.0, TRAINED, 'linear, llama3: low frequencies (all, for linear) '
      'divided by this')
  rope_low_freq_factor: float = field(1.0, TRAINED, 'llama3: wavelengths > original_max_len / this '
      'are scaled')
  rope_high_freq_factor: float = field(4.0, TRAINED, 'llama3: wavelengths < original_max_len / '
      'this are kept')
  rope_original_max_len: int = field(8192, TRAINED, 'llama3: the context length the model was '
      'pretrained at')
  max_position_embeddings: int = field(0, SAFE, 'context length a Hugging Face export states (0: '
      "data.seq_len); an import keeps its checkpoint's")
  norm_eps: float = field(1e-5, TRAINED, 'RMSNorm epsilon')
  init_std: float = field(0.02, SAFE, 'normal init std (output projections scaled by '
      '1/sqrt(2*layers)); used only at initialization')
  attention: str = field('auto', SAFE, "'auto' (cuDNN where it runs, else XLA) | 'xla' | 'cudnn' | "
      "'pallas'")
  remat: str = field('auto', SAFE, "'auto' (dots with fused attention, else full; full where the "
      "fit needs it: memory.fit_micro_batch) | 'none' | 'full' | 'dots' | 'dots_no_batch' | "
      "'minimal'")
  layers: str = field(AUTO_LAYERS, SAFE, "'auto' (unroll on a GPU up to UNROLL_MAX_LAYERS layers, "
      "else scan; scan where no unrolled step fits: memory.fit_micro_batch) | 'scan' | 'unroll': "
      'how a step runs the layers; the params are the same')
  dtype: str = field(_AUTO_DTYPE, _float16_toggled, "compute dtype: 'auto' (bfloat16 on TPUs and "
      'NVIDIA sm_80+, float16 with loss scaling on older NVIDIA GPUs, float32 on the CPU) | '
      "'bfloat16' | 'float16' | 'float32'; params and optimizer state stay float32")
  param_dtype: str = field('float32', SHAPE, 'master parameter dtype')
  fp8: bool = field(False, _fp8_toggled, 'attention and MLP projections in FP8 (Hopper/Ada GPUs; '
      'simulated on the CPU): per-tensor delayed scaling, jax_pretrain/fp8.py')
  fp8_gradients: str = field(_FP8_GRADIENTS, SAFE, "with model.fp8, the gradients' format: "
      "'e4m3' (3 mantissa bits, up to 448) | 'e5m2' (2 bits, up to 57344); BENCHMARKS.md compares "
      'them')

  @property
  def compute_dtype(self) -> np.dtype:
    """model.dtype as the dtype the model computes in (resolved: not 'auto')."""
    return jnp.dtype(self.dtype)

  @property
  def master_dtype(self) -> np.dtype:
    """model.param_dtype as the dtype the parameters are kept in."""
    return jnp.dtype(self.param_dtype)

  @property
  def scan_layers(self) -> bool:
    """Whether the model scans its layers (resolved model.layers 'scan'), else runs them
    unrolled; either way the params stack the layers on a leading axis (model.py)."""
    return self.layers == 'scan'

  @property
  def remat_policy(self):
    """model.remat's jax checkpoint policy (None: 'none', nothing recomputed); 'dots' keeps more
    with the layers unrolled (_DOTS_UNROLLED)."""
    if self.remat == 'dots' and not self.scan_layers:
      return _DOTS_UNROLLED[self.fp8]
    return REMAT_POLICIES[self.remat]


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The data group: what the trainer reads and how (docs/data.md)."""
  seq_len: int = field(2048, STREAM, 'tokens per training sequence')
  format: str = field('text', STREAM, "'text': documents (pretraining) | 'sft': JSONL "
      'prompt/completion or chat messages, packed, loss on completions (docs/data.md)')
  train: str = field('', STREAM, "required: 'SOURCE[#field][:weight],...' (docs/data.md)")
  val: str = field('', STREAM, "eval sources; '' carves val_ratio from the training data")
  val_ratio: float = field(0.05, STREAM, 'share of the training data held out for eval when val is '
      "''")
  tokenizer: str = field('', STREAM, "'': from the data (else bytes); 'byte'; a sentencepiece "
      '.model; a tokenizer.json, or a directory with one (docs/data.md)')
  text_field: str = field('text', STREAM, 'JSONL key, Parquet column or TFDS feature that holds '
      'the text')
  tfds_data_dir: str = field('', SAFE, "TFDS data_dir for tfds:NAME sources ('': "
      '~/tensorflow_datasets)')
  on_bad_record: str = field('error', SAFE, "bad raw-text lines: 'error' | 'skip' (counted, "
      'reported per file)')
  num_workers: int = field(0, SAFE, 'grain worker processes for batches (0: threads in this '
      'process)')
  read_threads: int = field(2, SAFE, 'threads assembling batches in each process')
  prefetch: int = field(4, SAFE, 'batches buffered ahead of the trainer')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The train group: the run's length, batch, cadences and what it reports."""
  steps: int = field(0, SAFE, 'optimizer steps; 0: derive from total_tokens')
  total_tokens: int = field(0, SAFE, 'run length in tokens (alternative to steps)')
  batch_size: int = field(64, STREAM, 'global batch, in sequences')
  micro_batch_size: int = field(0, SAFE, 'sequences per data-parallel device per forward/backward; '
      '0: on a GPU the largest that fits (compiled at start-up, printed), else batch_size / '
      'data-parallel devices (no accumulation)')
  seed: int = field(0, STREAM, 'parameter init and data order')
  log_every: int = field(10, SAFE, 'steps between logged scalars')
  eval_every: int = field(500, SAFE, 'steps between evals (and at the end)')
  eval_steps: int = field(20, SAFE, 'eval batches per eval')
  eval_batch_size: int = field(0, SAFE, '0: micro_batch_size × data-parallel devices (one pass, no '
      'OOM)')
  peak_flops: float = field(0.0, SAFE, 'device peak dense bf16 FLOP/s for MFU; 0: look up by '
      'device kind')
  on_nonfinite: str = field('halt', SAFE, "non-finite loss or grad norm: 'halt' (checkpoints "
      "intact) | 'skip'")
  max_consecutive_skips: int = field(10, SAFE, "with 'skip': halt after this many non-finite steps "
      'in a row')
  sample_prompt: str = field('The ', SAFE, "prompt of the continuation printed at the end ('' "
      'disables)')
  sample_tokens: int = field(64, SAFE, 'tokens generated for that continuation')
  # Downstream evals during training through lm-evaluation-harness (jax_pretrain/lm_eval.py).
  lm_eval_tasks: str = field('', SAFE, "tasks, comma-separated ('' : none), logged as "
      'lm_eval/TASK/METRIC')
  lm_eval_every: int = field(0, SAFE, 'steps between them; 0: at every eval (eval_every) and the '
      'end')
  lm_eval_include_path: str = field('', SAFE, "a folder of extra task YAMLs (lm_eval's "
      '--include_path)')
  lm_eval_limit: int = field(0, SAFE, 'examples per task at most; 0: all')
  wandb_project: str = field('', SAFE, "Weights & Biases project: the scalars go there too ('': "
      'off)')
  wandb_entity: str = field('', SAFE, "its team or user ('': your default entity)")
  wandb_run_name: str = field('', SAFE, "the run's name there ('': the workdir's name)")
  profile_steps: str = field('', SAFE, "'START:STOP': trace those steps (jax.profiler) to "
      'WORKDIR/profile')


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """The optim group: AdamW, its schedule and clipping (optim.py)."""
  learning_rate: float = field(3e-4, SAFE, 'peak learning rate', was='train.learning_rate')
  min_learning_rate: float = field(3e-5, SAFE, 'end of the cosine '
      'decay', was='train.min_learning_rate')
  warmup_steps: int = field(0, SAFE, 'linear warmup; 0: derive from '
      'warmup_tokens', was='train.warmup_steps')
  warmup_tokens: int = field(0, SAFE, 'warmup in tokens (alternative to '
      'warmup_steps)', was='train.warmup_tokens')
  b1: float = field(0.9, SAFE, 'AdamW beta1', was='train.b1')
  b2: float = field(0.95, SAFE, 'AdamW beta2', was='train.b2')
  eps: float = field(1e-8, SAFE, 'AdamW epsilon', was='train.eps')
  weight_decay: float = field(0.1, SAFE, 'decoupled weight decay (not applied to norms or other '
      '1-D params)', was='train.weight_decay')
  grad_clip: float = field(1.0, _clipping_toggled, 'clip by global norm; 0 '
      'disables', was='train.grad_clip')
  mu_dtype: str = field('float32', SHAPE, "AdamW first-moment dtype; 'bfloat16' halves its memory")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The mesh group; resolved, every axis size is known. Safe to change on resume: checkpoints
  restore onto any mesh."""
  data: int = field(-1, SAFE, 'data-parallel axis size; -1: all remaining devices')
  fsdp: int = field(sharding.AUTO_FSDP, SAFE, 'parameter-sharded data-parallel axis size; 0: 1 '
      '(plain data parallelism) unless the state does not fit that way (a GPU and '
      'train.micro_batch_size=0 try more: memory.fit_micro_batch), or the devices data and tensor '
      'leave when neither is -1')
  tensor: int = field(1, SAFE, 'tensor-parallel axis size (heads, MLP, vocab)')


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """The checkpoint group: where a run starts from, and what it saves."""
  restore_from: str = field('', SAFE, "another run's workdir: start from its params (new "
      'optimizer, data); used only when the workdir has no checkpoint')
  every_steps: int = field(1000, SAFE, 'steps between (asynchronous) saves; 0: only the final save')
  keep: int = field(2, SAFE, 'keep the latest this many checkpoints')
  keep_best: int = field(3, SAFE, 'and also the best this many by eval loss (0: none)')
  async_save: bool = field(True, SAFE, 'write in the background while training continues')
  save_final: bool = field(True, SAFE, 'save the state at the end of training')
  start_over: bool = field(False, SAFE, 'train from step 0 in a workdir whose history '
      '(metrics.jsonl, config_history.jsonl, tensorboard/) records steps but that holds no '
      'checkpoint; its metrics so far move to metrics.discarded.jsonl (False: such a workdir stops '
      'the run, as its checkpoints may be missing)')


@dataclasses.dataclass(frozen=True)
class Config:
  """A whole config: the trainer's groups (a program's Config adds its own: Group). `resolve`
  returns one with every value decided; its defaults are the fields' declared ones."""
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

  def groups(self) -> dict[str, Any]:
    """{name: group} of every group this config has, in order."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# The trainer's groups: every config has them.
GROUPS: dict[str, type] = typing.get_type_hints(Config)
FIELDS = {f'{group}.{f.name}': f for group, cls in GROUPS.items() for f in fields(cls)}

# Fields that moved between groups: configs and config.json files written before still load.
MOVED = {tuple(f.was.split('.')): tuple(name.split('.')) for name, f in FIELDS.items() if f.was}


@dataclasses.dataclass(frozen=True)
class Group:
  """A program's own config group (e.g. grpo's, jax_pretrain/grpo/config.py): `config`, the
  program's Config (a subclass of Config with the group as its field `name`), and `resolve`, the
  check of the group's resolved values. A config has the group only where the program's config
  adds it (defaults(group)); resolve checks it there. `config_file` and `program` say where the
  group comes from (an override of its fields on another config names them)."""
  name: str
  config: type[Config]
  resolve: Callable[[Any], None]
  config_file: str = ''  # e.g. 'configs/grpo.py:PRESET'
  program: str = ''  # e.g. 'python -m jax_pretrain.grpo'

  @property
  def cls(self) -> type:
    """The group's dataclass."""
    return typing.get_type_hints(self.config)[self.name]


_PROGRAM_GROUPS: dict[str, Group] = {}  # registered by the modules that define them


def register(group: Group) -> Group:
  """Makes a program's group known to from_dict, resolve and resume_changes."""
  _PROGRAM_GROUPS[group.name] = group
  return group


def program_group(name: str) -> Group | None:
  """The program group of this name, its module (jax_pretrain/NAME/config.py, which registers
  it) loaded if it was not; None when no program has such a group."""
  module = os.path.join(os.path.dirname(os.path.abspath(__file__)), name, 'config.py')
  if name not in _PROGRAM_GROUPS and name.isidentifier() and os.path.isfile(module):
    importlib.import_module(f'jax_pretrain.{name}.config')
  return _PROGRAM_GROUPS.get(name)


def defaults(*groups: Group) -> ml_collections.ConfigDict:
  """Every field of the trainer's groups (and of the programs' `groups`) at its default, as the
  dataclasses declare them: what config files start from."""
  classes = {**GROUPS, **{g.name: g.cls for g in groups}}
  return ml_collections.ConfigDict(
      {name: dataclasses.asdict(cls()) for name, cls in classes.items()})


def from_dict(saved: dict, strict: bool = False,
              groups: tuple[Group, ...] = ()) -> ml_collections.ConfigDict:
  """A config from a (possibly older) dict, over today's defaults: fields it lacks keep their
  defaults and moved fields go to their new group. It has the trainer's groups, `groups`, and the
  registered program groups that `saved` has (another program's group in a run's config.json,
  e.g. grpo's, is dropped where its module is not loaded). Unknown fields are dropped (a
  config.json of another version), or with strict=True refused, naming the field (a typo in a
  config file)."""
  c = defaults(*groups, *(g for name, g in _PROGRAM_GROUPS.items() if name in saved))
  for group, values in saved.items():
    for name, value in (values.items() if isinstance(values, dict) else [('', values)]):
      new_group, new_name = MOVED.get((group, name), (group, name))
      if new_group in c and new_name in c[new_group]:
        c[new_group][new_name] = value
      elif strict:
        hint = RETIRED.get((group, name), 'all fields, with their defaults, are in '
                           'jax_pretrain/config.py')
        raise ConfigError(f'{group}.{name}: no such config field ({hint}).')
  return c


def typed(config: Config | ml_collections.ConfigDict) -> Config:
  """A ConfigDict (a config file's, the command line's, a config.json's) as its Config, values as
  given (resolve decides the rest); an unknown field is refused, naming it. A Config is returned
  as it is. A config with a program's group is that program's Config (Group.config)."""
  if isinstance(config, Config):
    return config
  c = from_dict(config.to_dict(), strict=True).to_dict()
  programs = [g for name, g in _PROGRAM_GROUPS.items() if name in c]
  check(len(programs) <= 1, f'one program\'s group at most, not {[g.name for g in programs]}.')
  cls = programs[0].config if programs else Config
  classes = typing.get_type_hints(cls)
  return cls(**{name: classes[name](**values) for name, values in c.items()})


def load_file(path: str) -> ml_collections.ConfigDict:
  """get_config() of a config file (a preset, or a run's config.py), as --config loads it."""
  if not os.path.isfile(path):
    raise ConfigError(f'{path}: no such config file (presets are in {PRESETS_DIR}).')
  spec = importlib.util.spec_from_file_location('_jax_pretrain_config_file', path)
  assert spec is not None and spec.loader is not None
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


def as_dict(config: Config) -> dict:
  """Plain JSON types, as config.json holds them: {group: {field: value}}."""
  return {name: dataclasses.asdict(group) for name, group in config.groups().items()}


def to_json(config: Config) -> str:
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


def check(ok: bool, message: str) -> None:
  """Raises ConfigError(message) unless ok: a group's check (resolve, a program's group)."""
  if not ok:
    raise ConfigError(message)


def choice(group: Any, where: str, name: str, choices) -> None:
  """Raises ConfigError naming where.name unless the group's value is one of choices."""
  value = getattr(group, name)
  check(value in choices, f'{where}.{name}={value!r}: choose one of {tuple(choices)}.')


def resolve(config: Config | ml_collections.ConfigDict, num_devices: int,
            backend: str | None = None, tokenizer_vocab_size: int = 0,
            device=None) -> tuple[Config, RunShape]:
  """Returns (the resolved Config, RunShape); raises ConfigError on any inconsistency.

  config: a ConfigDict (a config file's, with the command line's overrides: typed) or a Config.
  tokenizer_vocab_size: the tokenizer's ids, which the embedding must hold (0: not checked).
  device: one of the devices the run uses (a jax Device, real or compile-only); it decides
  model.attention='auto' and gives the backend. Without it, backend alone decides ('gpu' is taken
  to be a recent NVIDIA GPU).
  """
  c = typed(config)
  model, choices = _resolve_model(c.model, backend, tokenizer_vocab_size, device)
  mesh = _resolve_mesh(c.mesh, model, num_devices)
  train, accum, tokens_per_step = resolve_batch(c.train, c.data.seq_len, mesh)
  train, optim = _resolve_schedule(train, c.optim, tokens_per_step)
  c = dataclasses.replace(c, model=model, mesh=mesh, train=train, optim=optim)
  _resolve_rest(c)
  for name, group in c.groups().items():
    if name in _PROGRAM_GROUPS:
      _PROGRAM_GROUPS[name].resolve(group)
  return c, RunShape(mesh_shape=(mesh.data, mesh.fsdp, mesh.tensor), grad_accum_steps=accum,
                     tokens_per_step=tokens_per_step, choices=tuple(choices))


def _auto_dtype(backend: str, device, capability: tuple[int, int] | None) -> tuple[str, str]:
  """What model.dtype='auto' means on this device (real or compile-only): (dtype, the reason)."""
  kind = getattr(device, 'device_kind', '') or backend
  if backend == 'tpu':
    return 'bfloat16', f'{kind} computes in bfloat16'
  if backend != 'gpu':
    return 'float32', f'{kind}: no fast bfloat16 matmuls on the {backend}'
  # A GPU that states no capability is judged by its name, like attention.choose.
  stated = f'compute capability {attention.capability_text(capability)}'
  if attention.is_ampere_or_newer(kind, capability):
    return 'bfloat16', f'{kind}, {stated} has bfloat16'
  return 'float16', f'{kind}, {stated} has no bfloat16: float16 with dynamic loss scaling'


def _auto_layers(backend: str, num_layers: int) -> tuple[str, str]:
  """What model.layers='auto' means for this backend and depth: (layers, the reason)."""
  if backend != 'gpu':
    return 'scan', f'{backend}: compile time dominates there'
  if num_layers > UNROLL_MAX_LAYERS:
    return 'scan', (f'{num_layers} layers > {UNROLL_MAX_LAYERS}: an unrolled step would take '
                    'many minutes to compile')
  return 'unroll', ("GPU: no copies of the scan's stacked activations and weight gradients; "
                    f'compiled once per program, {num_layers} layers, cached for a resumed run')


def _resolve_model(m: ModelConfig, backend: str | None, tokenizer_vocab_size: int,
                   device) -> tuple[ModelConfig, list[str]]:
  """Checks the model group and decides its 'auto' fields; returns it resolved, and what they
  became, and why."""
  choices = []
  if device is not None:
    backend = device.platform
  choice(m, 'model', 'attention', attention.IMPLEMENTATIONS + (attention.AUTO,))
  choice(m, 'model', 'remat', tuple(REMAT_POLICIES) + (AUTO_REMAT,))
  choice(m, 'model', 'layers', LAYERS + (AUTO_LAYERS,))
  choice(m, 'model', 'dtype', _DTYPES + (_AUTO_DTYPE,))
  choice(m, 'model', 'param_dtype', _DTYPES)
  for name in ('num_layers', 'd_model', 'num_heads', 'num_kv_heads', 'mlp_dim', 'vocab_size'):
    check(getattr(m, name) > 0, f'model.{name} must be positive, got {getattr(m, name)}.')
  check(m.num_heads % m.num_kv_heads == 0,
        f'model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}.')
  if m.head_dim == 0:
    check(m.d_model % m.num_heads == 0,
          f'model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; '
          'set model.head_dim explicitly.')
    m = dataclasses.replace(m, head_dim=m.d_model // m.num_heads)
  check(m.head_dim % 2 == 0, f'model.head_dim={m.head_dim} must be even (rotary embeddings).')
  if (m.attention == attention.AUTO or m.dtype == _AUTO_DTYPE) and device is None and (
      backend is None):
    device = jax.devices()[0]
    backend = device.platform
  backend = backend or jax.default_backend()
  capability = attention.compute_capability(device)  # (None: not stated, or no device)
  if m.dtype == _AUTO_DTYPE:
    dtype, why = _auto_dtype(backend, device, capability)
    m = dataclasses.replace(m, dtype=dtype)
    choices.append(f'dtype {m.dtype} (auto: {why})')
  if m.attention == attention.AUTO:
    kind = device.device_kind if device is not None else (
        'NVIDIA GPU' if backend == 'gpu' else backend)
    implementation, why = attention.choose(backend, kind, capability, m.dtype, m.head_dim)
    m = dataclasses.replace(m, attention=implementation)
    choices.append(f'attention {m.attention} (auto: {why})')
  reason = attention.unavailable_reason(m.attention, backend)
  check(reason is None, reason or '')
  if m.remat == AUTO_REMAT:
    # 'dots' keeps every matmul output for the backward pass and recomputes only the cheap rest.
    # With XLA's attention, the T×T attention scores are matmul outputs too: 'dots' would keep
    # them for every layer (xlarge, one H100, micro-batch 8: 116 GiB against 50 with cuDNN), so
    # there 'full' recomputes each layer instead (1.25× the matmul FLOPs).
    m = dataclasses.replace(m, remat='full' if m.attention == 'xla' else 'dots')
    choices.append(f'remat {m.remat} (auto: attention {m.attention})')
  if m.layers == AUTO_LAYERS:
    layers, why = _auto_layers(backend, m.num_layers)
    m = dataclasses.replace(m, layers=layers)
    choices.append(f'layers {m.layers} (auto: {why})')
  if m.fp8 and backend == 'gpu':
    check(capability is None or capability >= (8, 9),
          f'model.fp8=True needs FP8 matmuls (an NVIDIA GPU of compute capability >= 8.9: '
          f'Hopper, Ada); this {getattr(device, "device_kind", "GPU")} has '
          f'{attention.capability_text(capability)}. Leave model.fp8 off.')
  choice(m, 'model', 'fp8_gradients', tuple(fp8.GRADIENT_DTYPES))
  choice(m, 'model', 'rope_scaling', ROPE_SCALINGS)
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
  return m, choices


def _resolve_mesh(mesh: MeshConfig, m: ModelConfig, num_devices: int) -> MeshConfig:
  try:
    data, fsdp, tp = sharding.resolve_mesh_shape(mesh.data, mesh.fsdp, mesh.tensor, num_devices)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  check(m.num_heads % tp == 0 and m.num_kv_heads % tp == 0,
        f'mesh.tensor={tp} must divide model.num_heads={m.num_heads} and '
        f'model.num_kv_heads={m.num_kv_heads}.')
  check(m.mlp_dim % tp == 0, f'mesh.tensor={tp} must divide model.mlp_dim={m.mlp_dim}.')
  check(m.vocab_size % tp == 0,
        f'mesh.tensor={tp} must divide model.vocab_size={m.vocab_size} (pad the vocabulary up).')
  check(m.d_model % fsdp == 0, f'mesh.fsdp={fsdp} must divide model.d_model={m.d_model}.')
  return MeshConfig(data=data, fsdp=fsdp, tensor=tp)


def resolve_batch(t: TrainConfig, seq_len: int,
                  mesh: MeshConfig) -> tuple[TrainConfig, int, int]:
  """Derives micro_batch_size and eval_batch_size (where 0) for the resolved mesh; returns (the
  train group with them, accumulation steps, tokens per step). memory.with_micro_batch re-derives
  them with it for the micro-batch its fit chose."""
  dp = mesh.data * mesh.fsdp
  check(seq_len > 0, f'data.seq_len must be positive, got {seq_len}.')
  check(t.batch_size > 0 and t.micro_batch_size >= 0,
        f'train.batch_size={t.batch_size} must be positive and train.micro_batch_size='
        f'{t.micro_batch_size} non-negative.')
  if t.micro_batch_size == 0:
    check(t.batch_size % dp == 0,
          f'train.batch_size={t.batch_size} is not a multiple of the {dp} data-parallel devices '
          '(mesh data×fsdp).')
    t = dataclasses.replace(t, micro_batch_size=t.batch_size // dp)
  per_pass = t.micro_batch_size * dp
  check(t.batch_size % per_pass == 0,
        f'train.batch_size={t.batch_size} is not a multiple of train.micro_batch_size='
        f'{t.micro_batch_size} × {dp} data-parallel devices (mesh data×fsdp) = {per_pass}. '
        f'Use a batch_size that is a multiple of {per_pass}, or change micro_batch_size.')
  if t.eval_batch_size == 0:  # eval runs without accumulation: one micro-batch per device
    t = dataclasses.replace(t, eval_batch_size=per_pass)
  check(t.eval_batch_size % dp == 0,
        f'train.eval_batch_size={t.eval_batch_size} must be a multiple of the {dp} '
        'data-parallel devices.')
  return t, t.batch_size // per_pass, t.batch_size * seq_len


def _resolve_schedule(t: TrainConfig, o: OptimConfig,
                      tokens_per_step: int) -> tuple[TrainConfig, OptimConfig]:
  """Run length and warmup: steps win when given; otherwise derived from tokens (rounded up)."""
  if t.steps <= 0:
    check(t.total_tokens > 0, 'set train.steps or train.total_tokens (both are 0).')
    t = dataclasses.replace(t, steps=math.ceil(t.total_tokens / tokens_per_step))
  t = dataclasses.replace(t, total_tokens=t.steps * tokens_per_step)
  if o.warmup_steps <= 0:
    o = dataclasses.replace(o, warmup_steps=math.ceil(o.warmup_tokens / tokens_per_step))
  o = dataclasses.replace(o, warmup_tokens=o.warmup_steps * tokens_per_step)
  check(o.warmup_steps < t.steps,
        f'optim.warmup_steps={o.warmup_steps} must be smaller than train.steps={t.steps}.')
  check(o.learning_rate > 0, f'optim.learning_rate={o.learning_rate} must be positive.')
  check(0 <= o.min_learning_rate <= o.learning_rate,
        f'optim.min_learning_rate={o.min_learning_rate} must lie in [0, optim.learning_rate='
        f'{o.learning_rate}].')
  check(o.grad_clip >= 0, f'optim.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping).')
  choice(o, 'optim', 'mu_dtype', _DTYPES)
  return t, o


def _resolve_rest(c: Config) -> None:
  t = c.train
  choice(t, 'train', 'on_nonfinite', ('halt', 'skip'))
  for name in ('log_every', 'eval_every'):
    check(getattr(t, name) > 0, f'train.{name} must be positive, got {getattr(t, name)}.')
  for name in ('lm_eval_every', 'lm_eval_limit'):
    check(getattr(t, name) >= 0, f'train.{name} must be >= 0, got {getattr(t, name)}.')
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


def stop_strings(text: str) -> tuple[str, ...]:
  """A stop-string setting (grpo.stop, evaluate --stop) as the engine takes it: its escapes read
  ('\\n' -> a newline); () for ''."""
  return (unescape(text),) if text else ()


def profile_steps(t: TrainConfig) -> tuple[int, int] | None:
  """train.profile_steps 'START:STOP' -> (START, STOP), the steps traced, both included; '' ->
  None. Raises ConfigError on anything else."""
  if not t.profile_steps:
    return None
  start, sep, stop = t.profile_steps.partition(':')
  check(bool(sep) and start.strip().isdigit() and stop.strip().isdigit()
        and 0 < int(start) <= int(stop),
        f'train.profile_steps={t.profile_steps!r}: expected START:STOP with 0 < START <= STOP '
        "(e.g. 10:15), or '' for no profile.")
  return int(start), int(stop)


def resume_changes(saved: dict, config: Config) -> dict[str, tuple]:
  """{'group.field': (checkpoint's value, this config's)} of every resolved field that differs
  from the checkpoint's config (saved: its dict). Raises ConfigError listing the refused ones."""
  groups = config.groups()
  old = typed(from_dict(saved, groups=tuple(
      _PROGRAM_GROUPS[g] for g in groups if g in _PROGRAM_GROUPS))).groups()
  changes: dict[str, tuple] = {}
  refused: dict[str, list[str]] = {}  # reason -> the fields it refuses
  for group, values in groups.items():
    for f in fields(values):
      name = f'{group}.{f.name}'
      before, after = getattr(old[group], f.name), getattr(values, f.name)
      if before == after:
        continue
      changes[name] = (before, after)
      reason = f.refusal(before, after)
      if reason:
        refused.setdefault(reason, []).append(f'{name} {before!r} -> {after!r}')
  if refused:
    raise ConfigError(
        'cannot resume with this config: ' + '; '.join(
            f'{", ".join(names)} ({reason})' for reason, names in refused.items())
        + '. Resume with the old values, or start a new run from these params: '
        '--config.checkpoint.restore_from=WORKDIR --workdir=NEW (fresh optimizer and data order).')
  return changes
