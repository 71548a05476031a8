"""Config: presets load, overrides apply, bad fields and inconsistent values fail clearly."""
import dataclasses
import os
import re

from absl import flags
import jax.numpy as jnp
from ml_collections import config_flags
import pytest

from jax_pretrain import cli
from jax_pretrain import config as config_lib
from jax_pretrain import model as model_lib
from jax_pretrain.grpo import config as grpo_config
from jax_pretrain.kernels import attention
from tests.conftest import ROOT

PRESETS = ('default', 'test', 'tiny', 'small', 'medium', 'medium_large', 'large', 'xlarge')


def parse(*args):
  fv = flags.FlagValues()
  # config_flags learns which --config.x overrides exist from the argv it is given at definition.
  config_flags.DEFINE_config_file('config', os.path.join(ROOT, 'configs', 'default.py'),
                                  flag_values=fv, lock_config=True, sys_argv=['prog', *args])
  fv(['prog', *args])
  return fv.config


def test_overrides_apply():
  c = parse(f'--config={ROOT}/configs/test.py', '--config.train.steps=7',
            '--config.model.attention=xla', '--config.optim.learning_rate=0.01')
  assert c.train.steps == 7 and c.model.attention == 'xla' and c.optim.learning_rate == 0.01


def test_default_config_is_the_embedded_default():
  assert parse().data.train == 'embedded'


def test_unknown_field_names_the_field():
  with pytest.raises(Exception, match='num_layerz'):
    parse('--config.model.num_layerz=3')


def test_wrong_type_names_the_field():
  with pytest.raises(Exception, match='train.steps'):
    parse('--config.train.steps=many')


@pytest.mark.parametrize('preset', PRESETS)
def test_every_preset_resolves(preset):
  c = parse(f'--config={ROOT}/configs/{preset}.py')
  resolved, run = config_lib.resolve(c, num_devices=8, backend='cpu' if preset in (
      'default', 'test') else 'gpu')
  assert resolved.train.steps > 0 and resolved.model.head_dim > 0
  assert run.tokens_per_step == resolved.train.batch_size * resolved.data.seq_len


def test_eval_batch_defaults_to_one_pass_without_accumulation():
  c = parse(f'--config={ROOT}/configs/test.py', '--config.train.batch_size=64',
            '--config.train.micro_batch_size=2')
  r, run = config_lib.resolve(c, num_devices=8, backend='cpu')
  assert run.grad_accum_steps == 4 and r.train.eval_batch_size == 16  # 2 per device × 8


def test_tokens_derive_steps_and_both_are_kept():
  c = parse(f'--config={ROOT}/configs/test.py', '--config.train.steps=0',
            '--config.train.total_tokens=10000', '--config.optim.warmup_steps=0',
            '--config.optim.warmup_tokens=1000')
  r, run = config_lib.resolve(c, num_devices=1, backend='cpu')
  assert run.tokens_per_step == 16 * 32
  assert r.train.steps == 20 and r.train.total_tokens == 20 * 512  # rounded up to whole steps
  assert r.optim.warmup_steps == 2 and r.optim.warmup_tokens == 1024


@pytest.mark.parametrize('overrides, devices, message', [
    (('--config.train.batch_size=20', '--config.train.micro_batch_size=4'), 8,
     r'batch_size=20 is not a multiple of train.micro_batch_size=4 × 8 data-parallel'),
    (('--config.mesh.data=3', '--config.mesh.fsdp=-1'), 8, r'data=3.*cannot fill 8 devices'),
    (('--config.mesh.data=2', '--config.mesh.fsdp=2', '--config.mesh.tensor=1'), 8,
     r'uses 4 devices but 8 are present'),
    (('--config.mesh.data=3',), 8, r'data=3, fsdp=0, tensor=1 cannot fill 8 devices'),
    (('--config.mesh.data=-1', '--config.mesh.fsdp=-2'), 8, r'positive or -1 \(fsdp also 0'),
    (('--config.mesh.data=1', '--config.mesh.tensor=8'), 8,
     r'mesh.tensor=8 must divide model.num_heads=4'),
    (('--config.model.num_kv_heads=3',), 1, r'num_kv_heads=3 must divide model.num_heads=4'),
    (('--config.mesh.data=4', '--config.mesh.tensor=2', '--config.model.vocab_size=385'), 8,
     r'mesh.tensor=2 must divide model.vocab_size=385'),
    (('--config.mesh.data=1', '--config.mesh.fsdp=8', '--config.model.d_model=68',
      '--config.model.head_dim=16'), 8, r'mesh.fsdp=8 must divide model.d_model=68'),
    (('--config.model.attention=flash',), 1, r"attention='flash'"),
    (('--config.model.remat=some',), 1, r"remat='some'"),
    (('--config.optim.warmup_steps=50',), 1,
     r'warmup_steps=50 must be smaller than train.steps=20'),
    (('--config.grpo.num_iterations=0',), 1, r'grpo.num_iterations=0 must be >= 1'),
])
def test_inconsistent_values_fail_with_the_numbers(overrides, devices, message):
  preset = 'grpo.py:test' if overrides[0].startswith('--config.grpo.') else 'test.py'
  c = parse(f'--config={ROOT}/configs/{preset}', *overrides)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.resolve(c, num_devices=devices, backend='cpu')


@pytest.mark.parametrize('overrides, devices, mesh', [
    ((), 8, (8, 1, 1)),  # automatic: plain data parallelism (the GPU fit may shard more)
    (('--config.mesh.tensor=2',), 8, (4, 1, 2)),
    (('--config.mesh.data=2',), 8, (2, 4, 1)),  # data given: fsdp takes the devices left
    (('--config.mesh.data=4', '--config.mesh.tensor=-1'), 8, (4, 1, 2)),
    (('--config.mesh.fsdp=2',), 8, (4, 2, 1)),  # explicit: kept
    (('--config.mesh.fsdp=1',), 8, (8, 1, 1)),
])
def test_mesh_fsdp_is_automatic_by_default_and_an_explicit_value_is_kept(overrides, devices,
                                                                         mesh):
  c = parse(f'--config={ROOT}/configs/test.py', *overrides)
  assert config_lib.defaults().mesh.fsdp == 0
  r, run = config_lib.resolve(c, num_devices=devices, backend='cpu')
  assert run.mesh_shape == mesh and (r.mesh.data, r.mesh.fsdp, r.mesh.tensor) == mesh


def test_runs_saved_with_fsdp_1_load_and_resume_with_it_automatic():
  """config.json files hold the resolved mesh (fsdp=1 before it was automatic, or what the fit
  chose): they load as given, and a run that resumes with fsdp automatic accepts another mesh
  (checkpoints restore onto any mesh)."""
  c = config_lib.preset('test')
  for saved_fsdp in (1, 2):
    saved = config_lib.as_dict(config_lib.resolve(c, 8, backend='cpu')[0])
    saved['mesh'].update(data=8 // saved_fsdp, fsdp=saved_fsdp)
    assert config_lib.from_dict(saved).mesh.fsdp == saved_fsdp
    resumed, _ = config_lib.resolve(c, 8, backend='cpu')
    expected = {} if saved_fsdp == 1 else {'mesh.data': (4, 8), 'mesh.fsdp': (2, 1)}
    assert config_lib.resume_changes(saved, resumed) == expected


def test_cudnn_on_cpu_is_an_error_not_a_fallback():
  c = parse(f'--config={ROOT}/configs/test.py', '--config.model.attention=cudnn')
  with pytest.raises(config_lib.ConfigError, match="'cudnn' needs an NVIDIA GPU"):
    config_lib.resolve(c, num_devices=1, backend='cpu')


def test_runs_saved_with_optimizer_fields_in_train_still_load():
  old = config_lib.as_dict(config_lib.typed(config_lib.preset('test')))
  old['train'].update(learning_rate=0.123, warmup_steps=3, grad_clip=0.5)  # the old layout
  for name in ('learning_rate', 'warmup_steps', 'grad_clip'):
    old['optim'].pop(name)
  old['train']['removed_field'] = 1  # a field this version no longer has
  c = config_lib.from_dict(old)
  assert (c.optim.learning_rate, c.optim.warmup_steps, c.optim.grad_clip) == (0.123, 3, 0.5)
  assert 'learning_rate' not in c.train and 'removed_field' not in c.train
  r, _ = config_lib.resolve(c, num_devices=1, backend='cpu')
  assert r.optim.learning_rate == 0.123


_NO_SUCH_FIELD = ('{}: no such config field{}; all fields and their defaults are in '
                  'jax_pretrain/config.py.')
_GRPO_HINT = (' (the grpo group comes with --config=configs/grpo.py:PRESET, the config of python '
              '-m jax_pretrain.grpo)')


@pytest.mark.parametrize('overrides, expected', [
    (('--config.train.batch_size=128', '--config.grpo.num_samples=16'),
     _NO_SUCH_FIELD.format('--config.grpo.num_samples', _GRPO_HINT)),
    (('--config.grpo.num_samples=16', '--config.train.steps=3', '--config.grpo.beta=0.1'),
     _NO_SUCH_FIELD.format('--config.grpo.num_samples, --config.grpo.beta', _GRPO_HINT)),
    (('--config.train.steps=3', '--config.train.stepz=3'),
     _NO_SUCH_FIELD.format('--config.train.stepz', ' (Did you mean "steps" instead of "stepz"?)')),
    (('--config.model.d_model=8', '--config.model.nope.x=1'),
     _NO_SUCH_FIELD.format('--config.model.nope.x', '')),
])
def test_an_unknown_override_is_named_alone(overrides, expected):
  """The overrides that name fields are not blamed; a group of another program's config says
  which config brings it (ml_collections' error names only the unknown part)."""
  argv = ['prog', f'--config={ROOT}/configs/xlarge.py', *overrides]
  with pytest.raises((AttributeError, KeyError)) as e:
    parse(*argv[1:])
  assert str(cli.unknown_config_field(e.value, argv)) == expected


def test_a_typo_in_a_config_file_is_refused_naming_the_field():
  c = config_lib.preset('test')
  c.optim.lerning_rate = 0.1  # config files are unlocked while they build the config
  with pytest.raises(config_lib.ConfigError, match=r'optim.lerning_rate: no such config field'):
    config_lib.resolve(c, num_devices=1, backend='cpu')


class _Device:
  """What config.resolve reads from a jax Device."""

  def __init__(self, platform, device_kind, compute_capability=None):
    self.platform, self.device_kind = platform, device_kind
    if compute_capability is not None:
      self.compute_capability = compute_capability


@pytest.mark.parametrize('device, overrides, expected', [
    (_Device('gpu', 'NVIDIA H100 80GB HBM3', '9.0'), (), 'cudnn'),
    (_Device('gpu', 'NVIDIA H100 80GB HBM3'), (), 'cudnn'),  # compile-only: no capability
    (_Device('gpu', 'NVIDIA A100-SXM4-40GB', '8.0'), (), 'cudnn'),
    (_Device('gpu', 'Tesla V100-SXM2-16GB', '7.0'), (), 'xla'),
    (_Device('gpu', 'Tesla V100-SXM2-16GB'), (), 'xla'),
    (_Device('gpu', 'AMD Instinct MI300X'), (), 'xla'),
    (_Device('cpu', 'cpu'), (), 'xla'),
    (_Device('gpu', 'NVIDIA H100 80GB HBM3', '9.0'), ('--config.model.dtype=float32',), 'xla'),
    (_Device('gpu', 'NVIDIA H100 80GB HBM3', '9.0'), ('--config.model.head_dim=256',), 'xla'),
])
def test_auto_attention_is_cudnn_where_it_runs_and_says_why(device, overrides, expected):
  c = parse(f'--config={ROOT}/configs/xlarge.py', *overrides)
  assert c.model.attention == 'auto'
  r, run = config_lib.resolve(c, num_devices=1, device=device)
  assert r.model.attention == expected
  assert any(c.startswith(f'attention {expected} (auto: ') for c in run.choices)


@pytest.mark.parametrize('choice', ['xla', 'pallas', 'cudnn'])
def test_an_explicit_attention_is_never_replaced(choice):
  c = parse(f'--config={ROOT}/configs/xlarge.py', f'--config.model.attention={choice}')
  r, run = config_lib.resolve(c, num_devices=1, device=_Device('gpu', 'NVIDIA H100 80GB HBM3'))
  assert r.model.attention == choice
  assert not [x for x in run.choices if x.startswith('attention')]


@pytest.mark.parametrize('attention, remat',
                         [('auto', 'dots'), ('pallas', 'dots'), ('xla', 'full')])
def test_auto_remat_keeps_matmul_outputs_unless_attention_materializes_scores(attention, remat):
  c = parse(f'--config={ROOT}/configs/xlarge.py', f'--config.model.attention={attention}')
  r, run = config_lib.resolve(c, num_devices=1, device=_Device('gpu', 'NVIDIA H100 80GB HBM3'))
  assert r.model.remat == remat and f'remat {remat} (auto: attention ' in ' '.join(run.choices)
  explicit = parse(f'--config={ROOT}/configs/xlarge.py', '--config.model.remat=minimal')
  assert config_lib.resolve(explicit, num_devices=1, backend='cpu')[0].model.remat == 'minimal'


@pytest.mark.parametrize('device, expected', [
    (_Device('gpu', 'NVIDIA H100 80GB HBM3', '9.0'), 'bfloat16'),
    (_Device('gpu', 'NVIDIA A100-SXM4-40GB', '8.0'), 'bfloat16'),
    (_Device('gpu', 'NVIDIA GeForce RTX 3090', '8.6'), 'bfloat16'),
    (_Device('gpu', 'Tesla T4', '7.5'), 'float16'),
    (_Device('gpu', 'Tesla V100-SXM2-16GB', '7.0'), 'float16'),
    (_Device('gpu', 'Tesla V100-SXM2-16GB'), 'float16'),  # compile-only (plan): judged by name
    (_Device('gpu', 'NVIDIA H100 80GB HBM3'), 'bfloat16'),
    (_Device('tpu', 'TPU v5 lite'), 'bfloat16'),
    (_Device('cpu', 'cpu'), 'float32'),
])
def test_auto_dtype_is_bfloat16_where_the_card_has_it_and_says_why(device, expected):
  c = parse(f'--config={ROOT}/configs/xlarge.py', '--config.model.attention=xla')
  assert c.model.dtype == 'auto'
  r, run = config_lib.resolve(c, num_devices=1, device=device)
  assert r.model.dtype == expected
  assert [x for x in run.choices if x.startswith(f'dtype {expected} (auto: ')]
  explicit, _ = config_lib.resolve(parse(f'--config={ROOT}/configs/xlarge.py',
                                         '--config.model.dtype=float32',
                                         '--config.model.attention=xla'), 1, device=device)
  assert explicit.model.dtype == 'float32'


def test_the_cpu_presets_keep_float32():
  for name in ('default', 'test'):
    r, _ = config_lib.resolve(config_lib.preset(name), num_devices=1, backend='cpu')
    assert r.model.dtype == 'float32'


@pytest.mark.parametrize('before, after, refused', [
    ('bfloat16', 'float16', True), ('float16', 'float32', True), ('bfloat16', 'float32', False)])
def test_resuming_into_or_out_of_float16_is_refused_naming_the_loss_scale(before, after, refused):
  old, _ = config_lib.resolve(parse(f'--config={ROOT}/configs/test.py',
                                    f'--config.model.dtype={before}'), 1, backend='cpu')
  new, _ = config_lib.resolve(parse(f'--config={ROOT}/configs/test.py',
                                    f'--config.model.dtype={after}'), 1, backend='cpu')
  if refused:
    with pytest.raises(config_lib.ConfigError, match=f"model.dtype '{before}' -> '{after}'.*loss "
                       'scale'):
      config_lib.resume_changes(config_lib.as_dict(old), new)
  else:
    assert config_lib.resume_changes(config_lib.as_dict(old), new) == {
        'model.dtype': (before, after)}


def _changed(value):
  if isinstance(value, bool):
    return not value
  if isinstance(value, (int, float)):
    return value * 2 + 3
  return value + 'x'


def test_every_field_declares_its_resume_policy_and_resume_changes_applies_it():
  saved = config_lib.as_dict(config_lib.typed(grpo_config.defaults()))  # the trainer's groups
  fields = {**config_lib.FIELDS, **{f'grpo.{f.name}': f for f in grpo_config.FIELDS}}  # and grpo's
  assert set(fields) == {f'{g}.{n}' for g in saved for n in saved[g]}
  refused = []
  for name, field in fields.items():
    group, key = name.split('.')
    defaults = grpo_config.defaults()
    defaults[group][key] = after = _changed(field.default)
    new = config_lib.typed(defaults)
    reason = field.refusal(field.default, after)
    if reason:
      refused.append(name)
      with pytest.raises(config_lib.ConfigError, match=f'{name} .* -> .*{re.escape(reason)}'):
        config_lib.resume_changes(saved, new)
    else:
      assert config_lib.resume_changes(saved, new) == {name: (field.default, after)}
  assert 'model.d_model' in refused and 'train.seed' in refused and 'data.train' in refused
  assert 'grpo.num_iterations' in refused  # (the state counts its updates)
  assert 'optim.learning_rate' not in refused and 'mesh.data' not in refused
  grad_clip = config_lib.FIELDS['optim.grad_clip']  # its value is safe; on or off is not
  assert not grad_clip.refusal(1.0, 0.5) and grad_clip.refusal(1.0, 0.0) == config_lib.SHAPE


def test_the_resolved_config_is_one_typed_frozen_dataclass_per_group():
  c, _ = config_lib.resolve(config_lib.preset('test'), 8, backend='cpu')
  assert type(c) is config_lib.Config and isinstance(c.optim, config_lib.OptimConfig)
  assert c.mesh == config_lib.MeshConfig(data=8, fsdp=1, tensor=1)
  assert c.train.steps > 0 and c.model.head_dim == 16
  assert c.model.compute_dtype == jnp.float32 and c.model.remat_policy is None
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.optim.learning_rate = 1.0  # type: ignore[misc]
  # The group dataclasses are the one table: their defaults are defaults()'s, their docs and
  # resume policies FIELDS'.
  assert config_lib.defaults().to_dict() == config_lib.as_dict(config_lib.Config())
  assert config_lib.FIELDS['model.num_layers'].doc == 'transformer blocks'
  # A program's config is its own Config: the trainer's groups and its group.
  g, _ = config_lib.resolve(config_lib.preset('grpo'), 8, backend='cpu')
  assert isinstance(g, grpo_config.GrpoTrainConfig) and g.grpo.num_samples == 16
  assert grpo_config.of(g) is g
  with pytest.raises(config_lib.ConfigError, match='grpo group'):
    grpo_config.of(c)


def test_the_model_reads_the_model_group_itself():
  assert model_lib.ModelConfig is config_lib.ModelConfig


def test_the_compute_capability_is_parsed_once_for_every_choice():
  assert attention.compute_capability(_Device('gpu', 'NVIDIA H100', '9.0')) == (9, 0)
  assert attention.compute_capability(_Device('gpu', 'NVIDIA H100')) is None
  assert attention.compute_capability(None) is None
  assert attention.is_ampere_or_newer('Tesla T4', (7, 5)) is False
  assert attention.is_ampere_or_newer('Tesla T4', None) is False
  assert attention.is_ampere_or_newer('NVIDIA H100', None) is True
