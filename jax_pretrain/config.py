"""Resolving and validating the config, once, at start-up and before anything compiles.

`resolve` fills in every value that a user may leave to be derived (0 or -1 in configs/base.py),
checks that the whole config is consistent, and returns a locked copy. Errors name the field and
the numbers that disagree. Everything else reads the resolved config and never re-derives.
"""
import dataclasses
import math

import jax
import ml_collections

from jax_pretrain import model as model_lib
from jax_pretrain import sharding
from jax_pretrain.kernels import attention

_DTYPES = ('float32', 'bfloat16', 'float16')


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RunShape:
  """Values derived from the resolved config that are not config fields themselves."""
  mesh_shape: tuple[int, int, int]
  grad_accum_steps: int  # micro-batches per optimizer step
  tokens_per_step: int
  choices: tuple[str, ...] = ()  # what 'auto' fields resolved to and why, for the start-up lines


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def resolve(config: ml_collections.ConfigDict, num_devices: int, backend: str | None = None,
            device=None) -> tuple[ml_collections.ConfigDict, RunShape]:
  """Returns (resolved locked copy of config, RunShape); raises ConfigError on any inconsistency.

  device: one of the devices the run uses (a jax Device, real or compile-only); it decides
  model.attention='auto' and gives the backend. Without it, backend alone decides ('gpu' is taken
  to be a recent NVIDIA GPU).
  """
  c = ml_collections.ConfigDict(config.to_dict())  # a copy; the caller's config is untouched
  m, d, t = c.model, c.data, c.train
  choices = []
  if device is not None:
    backend = device.platform

  # Model.
  _check(m.attention in attention.IMPLEMENTATIONS + (attention.AUTO,),
         f'model.attention={m.attention!r}: choose one of '
         f'{attention.IMPLEMENTATIONS + (attention.AUTO,)}.')
  _check(m.remat in tuple(model_lib.REMAT_POLICIES) + (model_lib.AUTO_REMAT,),
         f'model.remat={m.remat!r}: choose one of '
         f'{tuple(model_lib.REMAT_POLICIES) + (model_lib.AUTO_REMAT,)}.')
  for field in ('dtype', 'param_dtype'):
    _check(m[field] in _DTYPES, f'model.{field}={m[field]!r}: choose one of {_DTYPES}.')
  _check(c.optim.mu_dtype in _DTYPES,
         f'optim.mu_dtype={c.optim.mu_dtype!r}: choose one of {_DTYPES}.')
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
  if m.attention == attention.AUTO:
    if device is None and backend is None:
      device = jax.devices()[0]
      backend = device.platform
    kind = device.device_kind if device is not None else (
        'NVIDIA GPU' if backend == 'gpu' else backend)
    m.attention, why = attention.choose(backend, kind, getattr(device, 'compute_capability', None),
                                        m.dtype, m.head_dim)
    choices.append(f'attention {m.attention} (auto: {why})')
  attention.check_available(m.attention, backend)
  if m.remat == model_lib.AUTO_REMAT:
    # 'dots' keeps every matmul output for the backward pass and recomputes only the cheap rest.
    # With XLA's attention, the T×T attention scores are matmul outputs too: 'dots' would keep
    # them for every layer (xlarge, one H100, micro-batch 8: 116 GiB against 50 with cuDNN), so
    # there 'full' recomputes each layer instead (1.25× the matmul FLOPs).
    m.remat = 'full' if m.attention == 'xla' else 'dots'
    choices.append(f'remat {m.remat} (auto: attention {m.attention})')

  # Mesh.
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

  # Batch and accumulation.
  dp = c.mesh.data * c.mesh.fsdp
  _check(d.seq_len > 0, f'data.seq_len must be positive, got {d.seq_len}.')
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
  accum = t.batch_size // per_pass
  if t.eval_batch_size == 0:
    t.eval_batch_size = per_pass  # eval runs without accumulation: one micro-batch per device
  _check(t.eval_batch_size % dp == 0,
         f'train.eval_batch_size={t.eval_batch_size} must be a multiple of the {dp} '
         'data-parallel devices.')
  tokens_per_step = t.batch_size * d.seq_len

  # Run length: steps win when given; otherwise derived from tokens (rounded up).
  if t.steps > 0:
    t.total_tokens = t.steps * tokens_per_step
  else:
    _check(t.total_tokens > 0, 'set train.steps or train.total_tokens (both are 0).')
    t.steps = math.ceil(t.total_tokens / tokens_per_step)
    t.total_tokens = t.steps * tokens_per_step
  if t.warmup_steps > 0:
    t.warmup_tokens = t.warmup_steps * tokens_per_step
  else:
    t.warmup_steps = math.ceil(t.warmup_tokens / tokens_per_step)
    t.warmup_tokens = t.warmup_steps * tokens_per_step
  _check(t.warmup_steps < t.steps,
         f'train.warmup_steps={t.warmup_steps} must be smaller than train.steps={t.steps}.')
  _check(0 <= t.min_learning_rate <= t.learning_rate,
         f'train.min_learning_rate={t.min_learning_rate} must lie in [0, train.learning_rate='
         f'{t.learning_rate}].')
  _check(t.on_nonfinite in ('halt', 'skip'),
         f"train.on_nonfinite={t.on_nonfinite!r}: choose 'halt' or 'skip'.")
  _check(c.checkpoint.every_steps >= 0, 'checkpoint.every_steps must be >= 0.')
  for field in ('log_every', 'eval_every'):
    _check(t[field] > 0, f'train.{field} must be positive, got {t[field]}.')

  c.lock()
  return c, RunShape(mesh_shape=mesh_shape, grad_accum_steps=accum,
                     tokens_per_step=tokens_per_step, choices=tuple(choices))


def model_config(config: ml_collections.ConfigDict) -> model_lib.ModelConfig:
  return model_lib.ModelConfig.from_config(config.model)

