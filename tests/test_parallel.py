"""Parallelism on 8 simulated devices: every mesh computes the same training run, parameters
are sharded as the rules table says, and every preset compiles for an FSDP mesh."""

from absl import flags
import jax
from ml_collections import config_flags
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import hlo
from jax_pretrain import state as state_lib
from tests.conftest import ROOT
from tests.conftest import build_setup

MESHES = {  # (data, fsdp, tensor)
    'data=8': (8, 1, 1),
    'fsdp=8': (1, 8, 1),
    'data=2,fsdp=2,tensor=2': (2, 2, 2),
    'tensor=8': (1, 1, 8),
}


def mesh_config(mesh, steps=5, attention='xla', layers='scan'):
  c = config_lib.preset('test')
  c.model.attention, c.model.layers = attention, layers
  c.model.num_heads = c.model.num_kv_heads = 8  # so that tensor=8 divides the heads
  c.train.steps = steps
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


def run_steps(mesh, batches, attention='xla', layers='scan'):
  s = build_setup(mesh_config(mesh, attention=attention, layers=layers),
                  devices=jax.devices()[:int(np.prod(mesh))])
  state = state_lib.init_state(s)
  step = state_lib.jit_train_step(s, pad_id=258)
  losses = []
  for tokens in batches:
    batch = {'tokens': jax.device_put(tokens, s.batch_sharding)}
    state, metrics = step(state, batch)
    losses.append(float(metrics['loss']))
  return np.array(losses), state


@pytest.fixture(scope='module')
def batches():
  rng = np.random.default_rng(0)
  return [rng.integers(0, 256, (16, 33)).astype(np.int32) for _ in range(5)]


@pytest.fixture(scope='module')
def single_device(batches):
  with jax.default_matmul_precision('float32'):
    return run_steps((1, 1, 1), batches)


@pytest.mark.parametrize('name', list(MESHES))
def test_losses_agree_with_one_device(name, batches, single_device):
  with jax.default_matmul_precision('float32'):
    losses, state = run_steps(MESHES[name], batches)
  np.testing.assert_allclose(losses, single_device[0], rtol=1e-5)
  assert losses[-1] < losses[0]  # it trains
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(single_device[1].params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_unrolled_layers_on_a_mesh_agree_with_the_scanned_ones_on_one_device(batches,
                                                                             single_device):
  """The unrolled step's once-a-step slices of the stacked weights and stacking of their
  gradients, sharded over data, fsdp and tensor."""
  with jax.default_matmul_precision('float32'):
    losses, state = run_steps((2, 2, 2), batches, layers='unroll')
  np.testing.assert_allclose(losses, single_device[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(single_device[1].params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_pallas_attention_under_shard_map_agrees_on_a_mesh(batches, single_device):
  with jax.default_matmul_precision('float32'):
    losses, _ = run_steps((2, 2, 2), batches[:2], attention='pallas')
  np.testing.assert_allclose(losses, single_device[0][:2], rtol=1e-5)


def test_parameter_shardings_follow_the_rules_table():
  s = build_setup(mesh_config((2, 2, 2)), devices=jax.devices())
  p = s.state_shardings.params
  assert p['embedding'].spec == jax.P('tensor', 'fsdp')  # ('vocab', 'embed')
  assert p['layers']['attn']['wq'].spec == jax.P(None, 'fsdp', 'tensor', None)
  assert p['layers']['attn']['wo'].spec == jax.P(None, 'tensor', None, 'fsdp')
  assert p['layers']['mlp']['w_down'].spec == jax.P(None, 'tensor', 'fsdp')
  assert p['layers']['attn_norm']['scale'].spec == jax.P(None, None)
  assert s.batch_sharding.spec == jax.P(('data', 'fsdp'), None)
  # Adam's moments are sharded exactly like the params they belong to.
  mu = s.state_shardings.opt_state[1][0].mu
  assert jax.tree.map(lambda x: x.spec, mu) == jax.tree.map(lambda x: x.spec, p)


def test_fsdp8_holds_an_eighth_of_params_and_optimizer_state_per_device():
  s = build_setup(mesh_config((1, 8, 1)), devices=jax.devices())
  state = state_lib.init_state(s)
  # Norm scales ([layers, d_model] when scanned) are replicated: they are tiny and 1-D per layer.
  arrays = [x for path, x in jax.tree_util.tree_leaves_with_path((state.params, state.opt_state))
            if x.ndim >= 2 and getattr(path[-1], 'key', None) != 'scale']
  total = sum(x.size for x in arrays)
  per_device = [0] * 8
  for x in arrays:
    for shard in x.addressable_shards:
      per_device[shard.device.id] += shard.data.size
  # Every matrix is split over 'fsdp' (its embed dimension).
  assert all(n == total // 8 for n in per_device), (per_device, total)
  wq = state.params['layers']['attn']['wq']
  assert wq.addressable_shards[0].data.shape == (2, 64 // 8, 8, 8)


def parse(preset, *overrides):
  fv = flags.FlagValues()
  args = ['prog', f'--config={ROOT}/configs/{preset}.py', *overrides]
  config_flags.DEFINE_config_file('config', flag_values=fv, lock_config=True, sys_argv=args)
  fv(args)
  return fv.config


@pytest.mark.parametrize('preset', ['tiny', 'small', 'medium', 'medium_large', 'large', 'xlarge'])
def test_every_preset_compiles_for_fsdp8(preset):
  """Ahead-of-time: lower and compile the train step on abstract inputs, no parameters made."""
  c = parse(preset, '--config.mesh.data=1', '--config.mesh.fsdp=8')
  s = build_setup(c, devices=jax.devices())
  compiled = state_lib.jit_train_step(s, pad_id=0).lower(
      s.abstract_state, state_lib.abstract_batch(s, c.train.batch_size)).compile()
  assert compiled is not None
  shard = s.state_shardings.params['layers']['mlp']['w_up'].shard_shape(
      s.abstract_state.params['layers']['mlp']['w_up'].shape)
  assert shard[1] == c.model.d_model // 8


def test_data_parallel_gradients_are_reduced_once_per_step_in_float32():
  """data=8 with 2 micro-batches: no all-reduce inside the accumulation loop; after it, one float32
  reduction of every gradient (4 bytes per parameter) plus the loss and target count."""
  c = mesh_config((8, 1, 1))
  c.train.micro_batch_size = 1  # 16 sequences over 8 devices: 2 micro-batches
  s = build_setup(c, devices=jax.devices())
  assert s.run.grad_accum_steps == 2
  text = state_lib.jit_train_step(s, pad_id=258).lower(
      s.abstract_state, state_lib.abstract_batch(s, c.train.batch_size)).compile().as_text()
  computations, entry = hlo.parse(text)
  assert any(i.opcode == 'while' for i in computations[entry])
  reductions = [i for body in computations.values() for i in body
                if i.opcode in ('all-reduce', 'all-reduce-start')]
  stats = hlo.analyze(text)  # counts each instruction as often as it runs (loops' trip counts)
  assert reductions and stats.unknown_trip_counts == 0
  assert stats.collectives['all-reduce'].count == len(reductions)  # each once: none in a loop
  shapes = {i.name: i.shape for body in computations.values() for i in body}
  reduced = [shapes[o] for i in reductions for o in i.operands]
  assert reductions and all(shape.startswith('f32') for shape in reduced), reduced
  n = sum(x.size for x in jax.tree.leaves(s.abstract_state.params))
  assert sum(hlo.shape_bytes(x) for x in reduced) == 4 * n + 4 * 2
  # Per step, counting each by its loop's trips (what plan reports): the same bytes, so none of
  # them runs inside the accumulation loop (there, twice a step).
  assert stats.collectives['all-reduce'].bytes == 4 * n + 4 * 2


# Remat policies × meshes × GQA/MHA. XLA's SPMD partitioner once aborted the whole process (a
# CHECK in spmd_partitioner_util.cc) on data=2, fsdp=2, tensor=2 for a float32 model with tied
# embeddings at this shape (4 rows per data-parallel device), whatever the remat policy (issue 19).
# A subset keeps CI time small: the crashing case, every remat policy once, both head layouts and
# four mesh shapes; scripts/mesh_matrix.py compiles the full cross product for every preset.
REMAT_MESHES = [  # (mesh, remat, num_kv_heads): 4 query heads
    ((2, 2, 2), 'full', 2),
    ((2, 2, 2), 'none', 4),
    ((1, 2, 4), 'dots', 4),
    ((4, 2, 1), 'dots_no_batch', 2),
    ((2, 4, 1), 'minimal', 2),
]


def remat_config(mesh, remat, num_kv_heads):
  c = config_lib.preset('test')
  c.model.d_model, c.model.mlp_dim, c.model.num_heads = 128, 256, 4
  c.model.num_kv_heads, c.model.remat, c.model.attention = num_kv_heads, remat, 'xla'
  c.data.seq_len, c.train.batch_size, c.train.steps, c.optim.warmup_steps = 64, 16, 3, 1
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


def remat_losses(mesh, remat, num_kv_heads):
  s = build_setup(remat_config(mesh, remat, num_kv_heads), jax.devices()[:int(np.prod(mesh))])
  state, step = state_lib.init_state(s), state_lib.jit_train_step(s, pad_id=258)
  rng, losses = np.random.default_rng(1), []
  for _ in range(3):
    tokens = rng.integers(0, 256, (16, 65)).astype(np.int32)
    state, metrics = step(state, {'tokens': jax.device_put(tokens, s.batch_sharding)})
    losses.append(float(metrics['loss']))
  return np.array(losses)


@pytest.mark.parametrize('mesh, remat, num_kv_heads', REMAT_MESHES)
def test_remat_policies_on_meshes_agree_with_one_device(mesh, remat, num_kv_heads):
  with jax.default_matmul_precision('float32'):
    losses = remat_losses(mesh, remat, num_kv_heads)
    reference = remat_losses((1, 1, 1), 'none', num_kv_heads)
  np.testing.assert_allclose(losses, reference, rtol=1e-5)
