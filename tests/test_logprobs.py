"""The chunked target log-probabilities (kernels/logprobs.py): the loss and its gradients equal
those of the model's full float32 logits and a float64 NumPy reference, chunked or not, and the
train step never holds a [tokens, vocabulary] float32 array."""
import dataclasses
import re

from flax.linen import meta
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import model as model_lib
from jax_pretrain import state as state_lib
from jax_pretrain.kernels import logprobs
from tests.conftest import build_setup

B, T = 4, 32


@pytest.fixture
def small_chunks(monkeypatch):
  """CHUNK_BYTES of 8 tokens of every row: 4 chunks of the test preset's rows."""
  monkeypatch.setattr(logprobs, 'CHUNK_BYTES', 4 * B * 8 * 384)
  assert logprobs.chunk_length(B, T, 384) == 8


def model_and_params(tie: bool):
  config, _ = config_lib.resolve(config_lib.preset('test'), num_devices=1, backend='cpu')
  model = model_lib.Transformer(dataclasses.replace(config.model, tie_embeddings=tie))
  params = meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, T), jnp.int32))['params'])
  return model, params


def full_logits_logprobs(model, params, tokens, temperatures):
  """What target_logprobs computed before it was chunked: log-softmax of the model's logits."""
  logits_BxTxV = model.apply({'params': params}, tokens[:, :-1])
  target_BxT = jnp.take_along_axis(logits_BxTxV, tokens[:, 1:, None], axis=-1)[..., 0]
  return tuple(target_BxT / t - jax.nn.logsumexp(logits_BxTxV / t, axis=-1) for t in temperatures)


def batch(seed=1):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.integers(0, 384, (B, T + 1)), jnp.int32),
          jnp.asarray(rng.uniform(0, 1, (B, T)), jnp.float32))


def max_rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize('tie', [True, False])
@pytest.mark.parametrize('temperatures', [(1.0,), (0.7, 1.0)])
def test_weighted_loss_and_gradients_equal_the_full_logits(small_chunks, tie, temperatures):
  model, params = model_and_params(tie)
  tokens, weights = batch()

  def loss(logprobs_fn):  # GRPO's shape: the first temperature differentiated, the rest held
    def f(p):
      first, *held = logprobs_fn(model, p, tokens, temperatures)
      return jnp.sum(first * weights) + sum(jnp.sum(jax.lax.stop_gradient(x)) for x in held)
    return f

  chunked = lambda m, p, t, temps: state_lib.target_logprobs(m, p, {'tokens': t}, temps)
  with jax.default_matmul_precision('float32'):
    ours, ours_grads = jax.value_and_grad(loss(chunked))(params)
    theirs, their_grads = jax.value_and_grad(loss(full_logits_logprobs))(params)
  assert max_rel(ours, theirs) < 1e-6
  for a, b in zip(jax.tree.leaves(ours_grads), jax.tree.leaves(their_grads)):
    assert max_rel(a, b) < 1e-6


def numpy_head(x_BxTxD, w_DxV, targets_BxT, g_BxT, temperature):
  """float64: log softmax(x @ w / t)[target] and the gradients of sum(g * it) by x and w."""
  x, w = np.asarray(x_BxTxD, np.float64), np.asarray(w_DxV, np.float64)
  z = x @ w / temperature
  z = z - z.max(axis=-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
  onehot = np.eye(w.shape[1])[np.asarray(targets_BxT)]
  logp = np.sum(onehot * (z - np.log(np.exp(z).sum(axis=-1, keepdims=True))), axis=-1)
  dz = np.asarray(g_BxT, np.float64)[..., None] * (onehot - p) / temperature
  return logp, dz @ w.T, np.einsum('btd,btv->dv', x, dz)


@pytest.mark.parametrize('temperature', [1.0, 0.6])
def test_head_matches_a_float64_numpy_reference(small_chunks, temperature):
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(0, 1, (B, T, 64)), jnp.float32)
  w = jnp.asarray(rng.normal(0, 0.3, (64, 384)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 384, (B, T)), jnp.int32)
  g = jnp.asarray(rng.normal(0, 1, (B, T)), jnp.float32)
  with jax.default_matmul_precision('float32'):
    logp, pullback = jax.vjp(
        lambda x, w: logprobs.target_logprobs(x, w, targets, (temperature,))[0], x, w)
    dx, dw = pullback(g)
  ref_logp, ref_dx, ref_dw = numpy_head(x, w, targets, g, temperature)
  # (float32's own rounding: the unchunked float32 computation is 1-2e-6 from float64 here too)
  for ours, ref in ((logp, ref_logp), (dx, ref_dx), (dw, ref_dw)):
    assert max_rel(ours, ref) < 1e-5


def test_chunks_are_the_largest_divisor_within_the_bytes_per_device(monkeypatch):
  monkeypatch.setattr(logprobs, 'CHUNK_BYTES', 256 * 2**20)
  assert logprobs.chunk_length(8, 2048, 32768) == 256  # 8 × 256 × 32,768 × 4 B = 256 MiB
  assert logprobs.chunk_length(1, 2048, 32768) == 2048
  assert logprobs.chunk_length(64, 2048, 2**22) == 1  # not even one token fits: one at a time
  assert logprobs.chunk_length(8, 2049, 32768) == 3  # 2049 = 3 × 683: its divisors


def test_the_train_step_never_holds_float32_logits_of_every_token(small_chunks):
  """The compiled step (CPU) has no float32 array of B·T·V elements or more; the chunks' are
  a quarter of that."""
  c = config_lib.preset('test')
  c.train.batch_size = B
  s = build_setup(c, jax.devices()[:1])
  text = state_lib.jit_train_step(s, pad_id=258).lower(
      s.abstract_state, state_lib.abstract_batch(s, B)).compile().as_text()
  f32_sizes = [np.prod([int(d) for d in dims.split(',') if d])
               for dims in re.findall(r'\bf32\[([0-9,]*)\]', text)]
  V = s.config.model.vocab_size
  assert max(f32_sizes) < B * T * V
  assert B * T * V // 4 in f32_sizes  # (the chunks' logits: the test sees them)


@pytest.mark.parametrize('mesh', [(2, 2, 2), (1, 1, 8)])
def test_chunked_steps_on_a_mesh_agree_with_one_device_unchunked(monkeypatch, mesh):
  """Four chunks a row under data, fsdp and tensor parallelism (the vocabulary split over
  'tensor'): the losses of one device computing each row's logits at once."""
  from tests import test_parallel  # noqa: PLC0415
  rng = np.random.default_rng(3)
  batches = [rng.integers(0, 256, (16, 33)).astype(np.int32) for _ in range(3)]
  with jax.default_matmul_precision('float32'):
    reference, _ = test_parallel.run_steps((1, 1, 1), batches)
    monkeypatch.setattr(logprobs, 'CHUNK_BYTES', 4 * 16 * 384)
    losses, _ = test_parallel.run_steps(mesh, batches)
  # Per device, 4 rows × 192 ids (data=2 fsdp=2 tensor=2) or 16 rows × 48 ids (tensor=8): 8 tokens
  assert logprobs.chunk_length(4, 32, 192) == logprobs.chunk_length(16, 32, 48) == 8
  np.testing.assert_allclose(losses, reference, rtol=1e-5)
