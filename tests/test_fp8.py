"""model.fp8: the dense projections in FP8 (delayed scaling in the train step, current scaling
elsewhere), checked on the CPU against float64 (bfloat16 and float16 compute, e4m3 and e5m2
gradients, the first step's scales) and against the bfloat16 and float16 models, its amax
histories through accumulation, meshes, a non-finite gradient and a resume, and in the compiled
H100 program (deviceless)."""
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import engine
from jax_pretrain import fp8
from jax_pretrain import hf
from jax_pretrain import model as model_lib
from jax_pretrain import plan
from jax_pretrain import state as state_lib
from jax_pretrain import train
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.engine import runner
from jax_pretrain.grpo import objective
from tests import tiny_run
from tests.conftest import build_setup
from tests.conftest import train_steps
from tests.test_plan import requires_plugin


def _relative_error(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_fp8_projection_and_its_gradients_round_like_e4m3():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 16, 128))
  w = rng.standard_normal((128, 4, 32)) * 0.05
  g = rng.standard_normal((4, 16, 4, 32))
  y, vjp = jax.vjp(lambda x, w: fp8.dense(x, w), jnp.asarray(x, jnp.float32),
                   jnp.asarray(w, jnp.float32))
  dx, dw = vjp(jnp.asarray(g, jnp.float32))
  # float64 references of y = x·w and its gradients.
  y_ref = np.einsum('btd,dnh->btnh', x, w)
  dx_ref, dw_ref = np.einsum('btnh,dnh->btd', g, w), np.einsum('btd,btnh->dnh', x, g)
  # e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4 per element): errors of that size, not
  # zero (the operands really are rounded) and not larger.
  for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
    assert 2e-3 < _relative_error(got, want) < 2**-4


def test_a_delayed_scale_rounds_like_e4m3_and_records_the_amaxes_as_its_gradient():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((64, 128))
  w = rng.standard_normal((128, 96)) * 0.05
  g = rng.standard_normal((64, 96)) * 1e-3  # (far below 1: a scale of 1 would flush it to zero)
  history = np.zeros((2, fp8.HISTORY), np.float32)
  history[0, 3], history[1, 7] = np.abs(x).max(), np.abs(g).max()  # the largest in the window
  y, vjp = jax.vjp(lambda x, w, h: fp8.dense(x, w, history=h), jnp.asarray(x, jnp.float32),
                   jnp.asarray(w, jnp.float32), jnp.asarray(history))
  dx, dw, amaxes = vjp(jnp.asarray(g, jnp.float32))
  for got, want in ((y, x @ w), (dx, g @ w.T), (dw, x.T @ g)):
    assert 2e-3 < _relative_error(got, want) < 2**-4
  np.testing.assert_allclose(np.asarray(amaxes)[:, 0], [np.abs(x).max(), np.abs(g).max()],
                             rtol=1e-6)
  assert not np.asarray(amaxes)[:, 1:].any()


def test_an_empty_history_scales_from_the_tensors_themselves():
  """The first step (no amax recorded yet): each operand and the gradient scaled from its own amax,
  exactly as current scaling does, not with scale 1, which keeps a gradient of amax ~1e-3 in a few
  subnormal e4m3 levels."""
  rng = np.random.default_rng(2)
  x = rng.standard_normal((64, 128))
  w = rng.standard_normal((128, 96)) * 0.05
  g = rng.standard_normal((64, 96)) * 1e-3
  args = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
  empty = jnp.zeros((2, fp8.HISTORY), jnp.float32)
  y, vjp = jax.vjp(lambda x, w: fp8.dense(x, w, history=empty), *args)
  dx, dw = vjp(jnp.asarray(g, jnp.float32))
  for got, want in ((y, x @ w), (dx, g @ w.T), (dw, x.T @ g)):
    assert 2e-3 < _relative_error(got, want) < 2**-4
  y_current, vjp_current = jax.vjp(fp8.dense, *args)
  for got, want in zip((y, dx, dw), (y_current, *vjp_current(jnp.asarray(g, jnp.float32)))):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('gradients, top', [('e4m3', 448.0), ('e5m2', 57344.0)])
def test_the_gradient_is_rounded_to_its_format_scaled_to_that_format_s_largest_value(gradients,
                                                                                     top):
  """model.fp8_gradients: with x the identity, dw is the gradient as quantized, which must be the
  gradient scaled so that its amax is the format's largest value (448 or 57344), rounded to that
  format (ml_dtypes), and scaled back. (The gradient spans 11 decades: the two maxima differ by
  2^7, which a floating-point format tells apart only at the bottom of its range.)"""
  rng = np.random.default_rng(3)
  g = rng.choice([-1.0, 1.0], (32, 48)) * 10.0 ** rng.uniform(-11, 0, (32, 48))
  history = np.zeros((2, fp8.HISTORY), np.float32)
  history[1, 0] = np.abs(g).max() * 2  # a delayed scale: last step's amax twice this one's
  _, vjp = jax.vjp(lambda x, w: fp8.dense(x, w, history=jnp.asarray(history),
                                          gradients=gradients),
                   jnp.eye(32, dtype=jnp.float32), jnp.zeros((32, 48), jnp.float32))
  _, dw = vjp(jnp.asarray(g, jnp.float32))
  scale = np.float32(history[1, 0]) / np.float32(top)
  q = (g.astype(np.float32) / scale).astype(fp8.GRADIENT_DTYPES[gradients])
  # (to float32's rounding of the identity's scale, 1/448, times the gradient's)
  np.testing.assert_allclose(dw, q.astype(np.float32) * scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize('history', [False, True])
def test_fp8_with_float16_compute_matches_float64(history):
  """float16 activations, weights and gradients: the GEMM's output is float32 and scaled there
  before the cast (as cuBLASLt), so that sums of operands scaled up to ±448 do not overflow
  float16 (written in float16 first, on main: 27,765 of these 32,768 outputs were inf)."""
  rng = np.random.default_rng(4)
  x = rng.standard_normal((64, 1024))
  w = rng.standard_normal((1024, 512)) * 0.02
  g = rng.standard_normal((64, 512))
  h = None
  if history:
    h = np.zeros((2, fp8.HISTORY), np.float32)
    h[:, 5] = np.abs(x).max(), np.abs(g).max()
  y, vjp = jax.vjp(lambda x, w: fp8.dense(x, w, history=None if h is None else jnp.asarray(h)),
                   jnp.asarray(x, jnp.float16), jnp.asarray(w, jnp.float16))
  dx, dw = vjp(jnp.asarray(g, jnp.float16))
  for got, want in ((y, x @ w), (dx, g @ w.T), (dw, x.T @ g)):
    assert got.dtype == jnp.float16 and np.isfinite(np.asarray(got)).all()
    assert 2e-3 < _relative_error(got, want) < 2**-4


def _fp8_step(micro_batch_size: int, devices, mesh_data: int = 1):
  """The test preset with FP8, one step on a fixed batch: the state after it. The histories
  hold an amax already (4 for the activations, 0.01 for the gradients), so that every
  micro-batch is scaled alike (an empty history scales each from its own tensors)."""
  c = config_lib.preset('test')
  c.model.fp8, c.model.attention = True, 'xla'
  c.train.micro_batch_size, c.mesh.data = micro_batch_size, mesh_data
  s = build_setup(c, devices)
  state, step = state_lib.init_state(s), state_lib.jit_train_step(s, pad_id=258)
  state = dataclasses.replace(state, fp8=jax.tree.map(
      lambda h: h.at[..., 0, 0].set(4.0).at[..., 1, 0].set(0.01), state.fp8))
  tokens = np.random.default_rng(0).integers(0, 256, (16, 33)).astype(np.int32)
  return step(state, {'tokens': jax.device_put(tokens, s.batch_sharding)})[0]


def test_the_amax_histories_take_the_maximum_over_micro_batches_and_devices_never_the_sum():
  whole = _fp8_step(16, jax.devices()[:1])
  recorded = jax.tree.map(lambda h: np.asarray(h)[..., 0], whole.fp8)
  assert all(x.min() > 0 for x in jax.tree.leaves(recorded))  # every projection recorded both
  for micro_batch_size, devices, data in ((4, jax.devices()[:1], 1), (4, jax.devices()[:2], 2)):
    split = _fp8_step(micro_batch_size, devices, data)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a)[..., 0], b, rtol=1e-5),
                 split.fp8, recorded)
    jax.tree.map(lambda h: np.testing.assert_array_equal(np.asarray(h)[..., 2:], 0), split.fp8)
    jax.tree.map(lambda h: np.testing.assert_allclose(
        np.asarray(h)[..., 1], np.broadcast_to([4.0, 0.01], h.shape[:-1]), rtol=1e-6), split.fp8)


@pytest.mark.parametrize('layers', ['unroll', 'scan'])
def test_weights_quantized_once_a_step_train_exactly_as_quantized_in_every_micro_batch(
    monkeypatch, layers):
  """fp8.prepare (each projection weight in e4m3 once a step, for all its micro-batches, and the
  activations' and gradients' delayed scales taken once): the same losses, gradient norms, params
  and amax histories, bit for bit, as each micro-batch quantizing the weights itself (fp8.dense
  without them, the program before), over a first step (empty histories: scaled from the tensors
  themselves) and two delayed ones, of 4 micro-batches, the layers unrolled (per-layer weights)
  and scanned (stacked: a scale per layer)."""
  c = config_lib.preset('test')
  c.model.fp8, c.model.dtype, c.model.attention, c.model.layers = True, 'bfloat16', 'xla', layers
  c.train.batch_size, c.train.micro_batch_size = 16, 4
  s = build_setup(c, jax.devices()[:1])
  batches = [np.random.default_rng(i).integers(0, 256, (16, 33)).astype(np.int32)
             for i in range(3)]

  def run():
    metrics, state = train_steps(s, batches)
    return metrics, jax.tree.leaves((state.params, state.fp8))

  once = run()
  monkeypatch.setattr(fp8, 'prepare', lambda *args: {})
  every = run()
  assert once[0] == every[0] and np.isfinite(once[0]).all()
  for a, b in zip(once[1], every[1]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _losses(fp8_on: bool, steps: int = 10, dtype: str = 'bfloat16') -> np.ndarray:
  c = config_lib.preset('test')
  c.model.fp8, c.model.dtype, c.model.attention = fp8_on, dtype, 'xla'
  c.train.steps = steps
  s = build_setup(c, jax.devices()[:1])
  state, step = state_lib.init_state(s), state_lib.jit_train_step(s, pad_id=258)
  rng, losses = np.random.default_rng(0), []
  for _ in range(steps):
    tokens = rng.integers(0, 256, (16, 33)).astype(np.int32)
    state, metrics = step(state, {'tokens': jax.device_put(tokens, s.batch_sharding)})
    losses.append(float(metrics['loss']))
  return np.array(losses)


def test_fp8_training_follows_the_bfloat16_run():
  bf16, with_fp8 = _losses(False), _losses(True)
  assert not np.array_equal(bf16, with_fp8)  # the FP8 path ran
  np.testing.assert_allclose(with_fp8, bf16, rtol=0.01)


def test_fp8_with_float16_compute_trains_as_float16_does():
  """float16 with loss scaling and FP8 (failed by step 6 with non-finite losses when the FP8
  GEMMs wrote float16 before their scales)."""
  f16, with_fp8 = _losses(False, dtype='float16'), _losses(True, dtype='float16')
  assert np.isfinite(with_fp8).all() and not np.array_equal(f16, with_fp8)
  np.testing.assert_allclose(with_fp8, f16, rtol=0.01)


def _poisoned_dense(dense):
  """fp8.dense with +inf put into the gradient arriving at its output (one element)."""
  @jax.custom_vjp
  def poison(y):
    return y

  def backward(_, g):
    return (g.at[(0,) * g.ndim].set(jnp.inf),)
  poison.defvjp(lambda y: (y, None), backward)
  return lambda *args, **kwargs: poison(dense(*args, **kwargs))


def test_an_infinite_gradient_under_fp8_skips_the_step(monkeypatch):
  """With the amax histories filled (a step taken), the gradient's delayed scale is finite and
  quantizing clips +inf to the format's largest value, so the step's gradients come out finite;
  the amax recorded is inf, and the guard skips the step as without FP8: params, moments and
  histories as they were, the step counted non-finite."""
  c = config_lib.preset('test')
  c.model.fp8, c.model.attention, c.train.on_nonfinite = True, 'xla', 'skip'
  s = build_setup(c, jax.devices()[:1])
  tokens = np.random.default_rng(0).integers(0, 256, (16, 33)).astype(np.int32)
  batch = {'tokens': jax.device_put(tokens, s.batch_sharding)}
  step = state_lib.jit_train_step(s, pad_id=258)
  before = jax.device_get(step(state_lib.init_state(s), batch)[0])
  clean, clean_metrics = step(jax.device_put(before, s.state_shardings), batch)
  assert int(clean_metrics['nonfinite_count']) == 0  # (and the step changes the state:)
  for new, old in ((clean.params, before.params), (clean.fp8, before.fp8)):
    assert not any(map(np.array_equal, jax.tree.leaves(new), jax.tree.leaves(old)))
  monkeypatch.setattr(fp8, 'dense', _poisoned_dense(fp8.dense))
  after, metrics = state_lib.jit_train_step(s, pad_id=258)(
      jax.device_put(before, s.state_shardings), batch)
  assert np.isfinite(float(metrics['loss'])) and not np.isfinite(float(metrics['grad_norm']))
  assert int(metrics['nonfinite_count']) == 1 and int(after.step) == 2
  jax.tree.map(np.testing.assert_array_equal, (after.params, after.opt_state, after.fp8),
               (before.params, before.opt_state, before.fp8))


def test_fp8_on_a_gpu_without_fp8_matmuls_is_one_config_error():
  a100 = types.SimpleNamespace(platform='gpu', device_kind='NVIDIA A100-SXM4-80GB',
                               compute_capability='8.0')
  c = config_lib.preset('test')
  c.model.fp8, c.model.attention = True, 'xla'
  with pytest.raises(config_lib.ConfigError, match=r'model\.fp8=True needs .* 8\.0'):
    config_lib.resolve(c, 1, device=a100)


def test_an_unknown_fp8_gradient_format_is_one_config_error():
  c = config_lib.preset('test')
  c.model.fp8, c.model.fp8_gradients = True, 'e3m4'
  with pytest.raises(config_lib.ConfigError,
                     match=r"^model\.fp8_gradients='e3m4': choose one of \('e4m3', 'e5m2'\)\.$"):
    config_lib.resolve(c, 1, backend='cpu')


@requires_plugin
def test_xlarge_fp8_on_h100_runs_its_projections_as_fp8_matmuls():
  c = config_lib.preset('xlarge')
  c.model.fp8 = True
  c.train.micro_batch_size = 8
  r = plan.plan(c, target='h100', num_devices=1)
  # 7 projections per layer, each a forward and two backward matmuls (XLA may merge some that
  # share an operand); everything but the embedding and the head: about 96% of the matmul FLOPs.
  assert r['fp8_matmuls'] >= 14
  assert 0.9 < r['fp8_matmul_flops_per_step'] / r['matmul_flops_per_step'] < 0.99
  assert r['fits']


# FP8 inference (issue 45, item 3): the engine and GRPO's scorer at the training's delayed scales.

def _sequences():
  """Prompts of several lengths, greedy and sampled, each with its top alternatives; more of
  them than the batched engine's slots, so that some join while others decode."""
  return [engine.Sequence(prompt=[(7 * i + j) % 250 + 1 for j in range(1 + 5 * i)],
                          max_new_tokens=8, temperature=(i % 2) * 0.8, seed=3, stream=i,
                          alternatives=True) for i in range(6)]


def _alone_and_together(model_config, params, tokenizer):
  """Each sequence's logprobs of its tokens and of their alternatives ([tokens, TOP_N + 1]:
  the first from the prefill's logits, the rest from decode's), decoded alone, and in a batch."""
  def logprobs(seq):
    return np.array([[lp, *(x for _, x in top)] for lp, top in
                     zip(seq.logprobs, seq.top_logprobs)], np.float32)
  make = lambda slots: engine.Engine(model_config, params, tokenizer, slots=slots, context=64,
                                     chunk=4)
  alone = [make(1).generate([seq])[0] for seq in _sequences()]
  together = make(4).generate(_sequences())
  assert [s.tokens for s in together] == [s.tokens for s in alone]
  return [logprobs(s) for s in alone], [logprobs(s) for s in together]


def test_fp8_inference_gives_a_row_the_same_logits_alone_and_in_any_batch(tmp_path_factory):
  """At the checkpoint's delayed scales (its amax histories, restored with its params), a row's
  logits through the engine, prefill and decode, are bitwise those it has alone (on main,
  which scaled each activation from the whole batch's amax: up to 0.091 apart in these
  logprobs)."""
  run = workdir_lib.load(tiny_run.train_once(tmp_path_factory, fp8=True),
                         devices=jax.devices()[:1])
  assert all(np.asarray(h)[..., 0, :].max() > 0 for h in jax.tree.leaves(run.fp8))
  alone, together = _alone_and_together(run.config.model, run.engine_params, run.tokenizer)
  for a, b in zip(alone, together):
    np.testing.assert_array_equal(b, a)


def test_fp8_inference_without_histories_scales_each_row_from_its_own(tmp_path_factory):
  """Params without amax histories (an import, a checkpoint from before them): each row (token)
  scaled from its own amax, so a row's logits do not depend on the others either, to the
  rounding of the engine's other (float32) matmuls, whose order differs with the batch: 4.3e-6
  at most without FP8 on these rows."""
  run = workdir_lib.load(tiny_run.train_once(tmp_path_factory, fp8=True),
                         devices=jax.devices()[:1])
  alone, together = _alone_and_together(run.config.model, run.params, run.tokenizer)
  for a, b in zip(alone, together):
    np.testing.assert_allclose(b, a, atol=1e-5)


def test_the_engines_fp8_projections_are_the_train_steps_each_with_its_own_scale(
    tmp_path_factory):
  """The engine quantizes each projection once as the train step does, per tensor: fused into
  wqkv and w_gate_up, each part keeps its own scale (on main the fused matrix had one), and it
  scores as the train step's forward does at the same delayed scales (on main, with one scale
  a fused matrix and the activations' from their own amax: 0.0094 apart on average, 0.042 at
  most)."""
  run = workdir_lib.load(tiny_run.train_once(tmp_path_factory, fp8=True),
                         devices=jax.devices()[:1])
  c = run.config.model
  decoding = runner.decoding_params(c, run.engine_params)
  N, K = c.num_heads, c.num_kv_heads
  for i in range(c.num_layers):
    weights = jax.tree.map(lambda x, i=i: np.asarray(x[i], c.compute_dtype),
                           run.params['layers'])
    attn, mlp = decoding[f'layers_{i}']['attn'], decoding[f'layers_{i}']['mlp']
    for parts, names in (
        (np.split(np.asarray(attn['wqkv_scale']), [N, N + K]),
         [('attn', w) for w in ('wq', 'wk', 'wv')]),
        (list(np.asarray(mlp['w_gate_up_scale'])), [('mlp', w) for w in ('w_gate', 'w_up')])):
      own = [np.float32(np.abs(weights[m][w]).max()) / np.float32(448) for m, w in names]
      for part, scale in zip(parts, own):
        np.testing.assert_array_equal(part, np.full_like(part, scale))
      assert len(set(own)) == len(own)  # (one scale for all would fail the line above)
    amaxes = [np.asarray(run.fp8['layers']['attn'][w + '_fp8'])[i, 0].max()
              for w in ('wq', 'wk', 'wv')]
    assert float(attn['wqkv_input_amax']) == max(amaxes) > 0
  tokens = np.array([[256, *b'Hello, world! FP8 at delayed scales.']], np.int32)
  trained = engine.token_logprobs(model_lib.Transformer(c), model_lib.with_compute_weights(
      c, run.params, run.fp8), tokens)[0]
  eng = engine.Engine(c, run.engine_params, run.tokenizer, slots=1, context=64)
  np.testing.assert_array_equal(eng.score(tokens)[0], trained)


def test_grpos_scorer_is_the_train_steps_forward_under_fp8():
  """GRPO's scorer (logp_old, logp_ref) at the state's delayed scales: the update's own
  forward, on the same params and histories, gives the same log-probabilities (its
  logp_mismatch against the scored ones as the rollout's: 0; on main, which scored with
  current scaling, 1.8e-3 a token on average)."""
  c = config_lib.preset('test')
  c.model.fp8, c.model.attention = True, 'xla'
  c.mesh.data, c.train.micro_batch_size = 2, 4  # (two devices, two micro-batches each)
  s = build_setup(c, jax.devices()[:2])
  rng = np.random.default_rng(0)
  tokens = lambda: jax.device_put(rng.integers(0, 256, (16, 33)).astype(np.int32),
                                  s.batch_sharding)
  state, _ = state_lib.jit_train_step(s, pad_id=258)(state_lib.init_state(s),
                                                     {'tokens': tokens()})
  assert all(np.asarray(h)[..., 0].min() > 0 for h in jax.tree.leaves(state.fp8))
  batch = {'tokens': tokens()}
  logp = objective.scorer(s, (1.0,))(state.params, state.fp8, batch)[0]
  update = state_lib.jit_train_step(s, 258, objective.make_loss_fn(s.model, 0.0, epsilon=0.2))
  ones = jax.device_put(np.ones((16, 32), np.float32), s.batch_sharding)
  _, metrics = update(state, {**batch, 'mask': ones, 'advantages': ones, 'rollout_logp': logp})
  assert float(metrics['logp_mismatch']) == 0.0


def test_an_fp8_runs_hugging_face_export_says_what_it_holds(tmp_path_factory, tmp_path):
  """The export of an FP8 run holds its float32 master weights (not quantized, no scales) and
  says so; a run without FP8 has no such note."""
  workdir = tiny_run.train_once(tmp_path_factory, fp8=True)
  notes = hf.export(workdir, str(tmp_path / 'fp8'))
  assert hf.FP8_NOTE in notes and 'float32 master weights' in hf.FP8_NOTE
  run = workdir_lib.load(workdir, devices=jax.devices()[:1])
  exported = safetensors.numpy.load_file(str(tmp_path / 'fp8' / 'model.safetensors'))
  for name, value in hf.to_hf(jax.device_get(run.params), run.config.model).items():
    np.testing.assert_array_equal(exported[name], value)
  assert not any('FP8' in note for note in hf.export(tiny_run.train_once(tmp_path_factory),
                                                     str(tmp_path / 'bf16')))


def test_a_run_from_an_fp8_runs_params_goes_on_from_its_amax_histories(tmp_path_factory,
                                                                       tmp_path):
  """checkpoint.restore_from (GRPO's, DPO's and SFT's --init): the source's amax histories with
  its params, so that the first update and the engine's first rollouts run at the scales it was
  trained at; from a run without them, empty ones (the first step scales from the tensors)."""
  fp8_run = tiny_run.train_once(tmp_path_factory, fp8=True)
  recorded = workdir_lib.load(fp8_run, devices=jax.devices()[:1]).fp8
  for name, source in (('fp8', fp8_run), ('plain', tiny_run.train_once(tmp_path_factory))):
    c = config_lib.preset('test')
    c.data.seq_len, c.model.fp8, c.checkpoint.restore_from = tiny_run.SEQ_LEN, True, source
    empty = checkpoint_lib.Checkpointer(tmp_path / name)
    state = train._initial_state(build_setup(c, jax.devices()[:1]), empty,  # noqa: SLF001
                                 is_main=False)
    empty.close()
    expected = recorded if name == 'fp8' else jax.tree.map(np.zeros_like, recorded)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.fp8),
                 jax.device_get(expected))
