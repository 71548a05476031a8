"""GRPO's objective against a float64 NumPy reference of the same formula, and what one update
does to the log-probabilities of better- and worse-than-average completions."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import engine
from jax_pretrain import grpo
from tests.conftest import build_setup

EPS, BETA = 0.2, 0.04


def _reference(logp, old, adv, mask, ref, eps=EPS, beta=BETA):
  """float64: loss and d loss / d logp of grpo's docstring formula."""
  ratio = np.exp(logp - old)
  unclipped, clipped = ratio * adv[:, None], np.clip(ratio, 1 - eps, 1 + eps) * adv[:, None]
  kl = np.exp(ref - logp) - (ref - logp) - 1
  per_token = -np.minimum(unclipped, clipped) + beta * kl
  tokens = mask.sum()
  loss = (per_token * mask).sum() / tokens
  # The policy term's derivative is -ratio·A where the unclipped branch is the minimum (or both
  # are equal), 0 where the clipped one is strictly smaller; the k3 term's is 1 - exp(ref - logp).
  policy = np.where(clipped < unclipped, 0.0, -ratio * adv[:, None])
  grad = mask * (policy + beta * (1 - np.exp(ref - logp))) / tokens
  return loss, grad, (clipped < unclipped)[mask > 0].mean()


def _batch(rng, B=6, T=9):
  logp = -rng.uniform(0.1, 3.0, (B, T))
  old = logp - rng.uniform(-0.5, 0.5, (B, T))  # ratios from 0.61 to 1.65: many clipped
  ref = logp + rng.normal(0, 0.3, (B, T))
  adv = rng.normal(0, 1, B)
  mask = (rng.uniform(size=(B, T)) < 0.8).astype(np.float64)
  return logp, old, adv, mask, ref


def test_group_advantages_are_the_group_centred_rewards_over_their_std():
  rewards = np.array([[1, 0, 0, 1], [0, 0, 0, 1], [1, 1, 1, 1.]])
  got = np.asarray(grpo.group_advantages(jnp.asarray(rewards)))
  mean, std = rewards.mean(1, keepdims=True), rewards.std(1, ddof=1, keepdims=True)
  np.testing.assert_allclose(got, (rewards - mean) / (std + grpo.ADVANTAGE_EPS), rtol=1e-6)
  assert np.all(got[2] == 0)  # a group that all agrees teaches nothing
  np.testing.assert_allclose(grpo.group_advantages(jnp.asarray(rewards), 'none'), rewards - mean)


def test_objective_and_its_gradient_equal_the_float64_reference_with_clipped_ratios():
  logp, old, adv, mask, ref = _batch(np.random.default_rng(0))
  want_loss, want_grad, want_clipped = _reference(logp, old, adv, mask, ref)
  assert 0.2 < want_clipped < 0.8  # the batch exercises both branches
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  fn = lambda lp: grpo.objective(lp, f32(old), f32(adv), f32(mask), f32(ref), epsilon=EPS,
                                 beta=BETA)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(f32(logp))
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(float(metrics['clip_fraction']), want_clipped, rtol=1e-6)
  assert float(metrics['kl']) > 0
  # beta 0: no KL term (and no reference needed).
  loss0, _ = grpo.objective(f32(logp), f32(old), f32(adv), f32(mask), None, epsilon=EPS)
  np.testing.assert_allclose(float(loss0), _reference(logp, old, adv, mask, ref, beta=0)[0],
                             rtol=1e-5)


@pytest.fixture(scope='module')
def tiny():
  c = config_lib.preset('test')
  c.model.dtype, c.model.attention = 'float32', 'xla'
  s = build_setup(c, jax.devices()[:1])
  params = s.init_fn(jax.random.key(0)).params
  return s.model, params


def _completion_logp(model, params, tokens, mask):
  logp, _, _ = engine.token_logprobs(model, params, tokens)
  return logp * mask


def test_on_a_tiny_model_the_parameter_gradient_is_the_reference_chained_through_the_model(tiny):
  model, params = tiny
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 256, (6, 10)), jnp.int32)
  mask = np.zeros((6, 9))
  mask[:, 4:] = 1  # prompt of 4 tokens, completion of 5
  logp = np.asarray(engine.token_logprobs(model, params, tokens)[0], np.float64)
  old = logp - rng.uniform(-0.5, 0.5, logp.shape)
  ref = logp + rng.normal(0, 0.3, logp.shape)
  adv = rng.normal(0, 1, 6)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  grads = jax.grad(lambda p: grpo.objective(engine.token_logprobs(model, p, tokens)[0], f32(old),
                                            f32(adv), f32(mask), f32(ref), epsilon=EPS,
                                            beta=BETA)[0])(params)
  _, want_dlogp, clipped = _reference(logp, old, adv, mask, ref)
  assert 0 < clipped < 1
  _, vjp = jax.vjp(lambda p: engine.token_logprobs(model, p, tokens)[0], params)
  (want,) = vjp(f32(want_dlogp))
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=1e-8)


def test_one_update_raises_better_than_average_completions_and_lowers_worse_ones(tiny):
  model, params = tiny
  rng = np.random.default_rng(2)
  prompt = rng.integers(0, 256, 4)
  tokens = jnp.asarray([np.concatenate([prompt, rng.integers(0, 256, 6)]) for _ in range(4)],
                       jnp.int32)  # one prompt, G=4 completions
  mask = np.zeros((4, 9))
  mask[:, 3:] = 1  # the targets after the prompt
  adv = grpo.group_advantages(jnp.asarray([[1.0, 0.0, 0.0, 1.0]]))[0]
  before = np.asarray(_completion_logp(model, params, tokens, mask).sum(1))
  old = engine.token_logprobs(model, params, tokens)[0]  # on-policy: ratio 1
  grads = jax.grad(lambda p: grpo.objective(engine.token_logprobs(model, p, tokens)[0], old, adv,
                                            jnp.asarray(mask))[0])(params)
  updates, _ = optax.sgd(0.5).update(grads, optax.sgd(0.5).init(params))
  after = np.asarray(_completion_logp(model, optax.apply_updates(params, updates), tokens,
                                      mask).sum(1))
  change = after - before
  assert change[0] > 0 and change[3] > 0, change  # rewarded: more likely
  assert change[1] < 0 and change[2] < 0, change  # not rewarded: less likely


def test_rollouts_keep_the_log_probabilities_the_training_forward_gives(tmp_path_factory):
  from jax_pretrain import sample as sample_lib  # noqa: PLC0415
  from jax_pretrain import workdir as workdir_lib  # noqa: PLC0415
  from tests import tiny_run  # noqa: PLC0415
  run = workdir_lib.load(tiny_run.train_once(tmp_path_factory), devices=jax.devices()[:1])
  model_config = config_lib.model_config(run.config)
  prompts = [sample_lib.encode_prompt(run.tokenizer, p).tolist() for p in ('The ', 'A list ')]

  def sample(seed):
    eng = engine.Engine(model_config, run.params, run.tokenizer, slots=8,
                        context=tiny_run.SEQ_LEN)
    return grpo.rollouts(eng, prompts, 4, max_new_tokens=12, temperature=1.0, seed=seed,
                         pad_id=run.tokenizer.pad_id)

  r = sample(seed=3)
  assert r.tokens_BxT1.shape[0] == 8 and len(set(r.completions)) > 4  # 4 samples per prompt
  # The training forward (full sequence, no cache) scores the sampled tokens as the rollout did,
  # once it excludes what the engine never samples (ids past the tokenizer's, and padding): the
  # whole-vocabulary log-probabilities differ by that mass (GRPO's mismatch metric).
  train_model = build_setup(run.config, jax.devices()[:1]).model
  logits = train_model.apply({'params': run.params}, jnp.asarray(r.tokens_BxT1[:, :-1]))
  ids = np.arange(logits.shape[-1])
  allowed = (ids < run.tokenizer.vocab_size) & (ids != run.tokenizer.pad_id)
  logp_all = jax.nn.log_softmax(jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf), -1)
  logp = np.take_along_axis(np.asarray(logp_all), r.tokens_BxT1[:, 1:, None], -1)[..., 0]
  mismatch = np.abs(np.where(r.mask_BxT > 0, logp - r.logp_BxT, 0.0)).max()
  assert mismatch < 1e-4, mismatch
  assert np.all(r.logp_BxT[r.mask_BxT > 0] < 0) and np.all(r.logp_BxT[r.mask_BxT == 0] == 0)
  # The same seed samples the same completions; another seed others.
  assert sample(seed=3).completions == r.completions != sample(seed=4).completions
