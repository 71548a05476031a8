"""GRPO's objective against a float64 NumPy reference of the same formula, and what one update
does to the log-probabilities of better- and worse-than-average completions; the program
(python -m jax_pretrain.grpo): resume after SIGTERM, learning a toy task, a mesh, bad input."""
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import engine
from jax_pretrain import hf
from jax_pretrain import model as model_lib
from jax_pretrain import state as state_lib
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.engine import output
from jax_pretrain.grpo import config as grpo_config
from jax_pretrain.grpo import objective
from jax_pretrain.grpo import program
from jax_pretrain.grpo import rollout
from tests.conftest import ROOT
from tests.conftest import build_setup
from tests.conftest import subprocess_env
from tests.test_hf import preset_config
from tests.test_hf import random_params

EPS, BETA = 0.2, 0.04


def _reference(logp, old, adv, mask, ref, eps=EPS, beta=BETA, corrected=True, eps_high=None,
               weight=1.0):
  """float64: loss and d loss / d logp of grpo's docstring formula (corrected: the k3 term times
  the ratio, use_bias_correction_kl; the ratio clipped to [1 - eps, 1 + eps_high], eps_high None:
  eps; weight: the rollout correction's, on the policy term, as TRL's compute_loss applies
  importance_sampling_ratio before it adds the KL term)."""
  eps_high = eps if eps_high is None else eps_high
  ratio = np.exp(logp - old)
  unclipped, clipped = ratio * adv[:, None], np.clip(ratio, 1 - eps, 1 + eps_high) * adv[:, None]
  k3 = np.exp(ref - logp) - (ref - logp) - 1
  kl = k3 * ratio if corrected else k3
  per_token = -np.minimum(unclipped, clipped) * weight + beta * kl
  tokens = mask.sum()
  loss = (per_token * mask).sum() / tokens
  # The policy term's derivative is -ratio·A where the unclipped branch is the minimum (or both
  # are equal), 0 where the clipped one is strictly smaller; the k3 term's is 1 - exp(ref - logp),
  # and k3 · ratio's ratio · (1 - exp(ref - logp) + k3) (d ratio / d logp = ratio).
  policy = np.where(clipped < unclipped, 0.0, -ratio * adv[:, None])
  dk3 = 1 - np.exp(ref - logp)
  dkl = ratio * (dk3 + k3) if corrected else dk3
  grad = mask * (policy * weight + beta * dkl) / tokens
  return loss, grad, (clipped < unclipped)[mask > 0].mean()


def _trl_rollout_weight(train, rollout, mask, mode, clip_min=None, clip_max=3.0):
  """float64: TRL 1.16's vllm_importance_sampling_ratio (trl/trainer/grpo_trainer.py,
  _generate_and_score_completions), [B, 1] in the sequence modes, [B, T] in the token ones; its
  bounds None for none. Also whether each ratio lay outside them."""
  diff = (train - rollout) * mask
  if mode in ('sequence_mask', 'sequence_truncate'):
    diff = diff.sum(-1, keepdims=True)
  ratio = np.exp(diff)
  low = -np.inf if clip_min is None else clip_min
  high = np.inf if clip_max is None else clip_max
  outside = (ratio < low) | (ratio > high)
  if mode in ('sequence_truncate', 'token_truncate'):
    return np.clip(ratio, low, high), outside
  return np.where(outside, 0.0, ratio), outside


def _batch(rng, B=6, T=9):
  logp = -rng.uniform(0.1, 3.0, (B, T))
  old = logp - rng.uniform(-0.5, 0.5, (B, T))  # ratios from 0.61 to 1.65: many clipped
  ref = logp + rng.normal(0, 0.3, (B, T))
  adv = rng.normal(0, 1, B)
  mask = (rng.uniform(size=(B, T)) < 0.8).astype(np.float64)
  return logp, old, adv, mask, ref


def test_group_advantages_are_the_group_centred_rewards_over_their_std():
  rewards = np.array([[1, 0, 0, 1], [0, 0, 0, 1], [1, 1, 1, 1.]])
  got = np.asarray(objective.group_advantages(jnp.asarray(rewards)))
  mean, std = rewards.mean(1, keepdims=True), rewards.std(1, ddof=1, keepdims=True)
  assert objective.ADVANTAGE_EPS == 1e-4  # TRL's: (r - mean) / (std + 1e-4)
  np.testing.assert_allclose(got, (rewards - mean) / (std + 1e-4), rtol=1e-6)
  assert np.all(got[2] == 0)  # a group that all agrees teaches nothing
  np.testing.assert_allclose(objective.group_advantages(jnp.asarray(rewards), 'none'),
                             rewards - mean)


@pytest.mark.parametrize('corrected, eps_high', [(True, 0.0), (False, 0.0), (True, 0.4)])
def test_objective_and_its_gradient_equal_the_float64_reference_with_clipped_ratios(corrected,
                                                                                    eps_high):
  logp, old, adv, mask, ref = _batch(np.random.default_rng(0))
  want_loss, want_grad, want_clipped = _reference(logp, old, adv, mask, ref, corrected=corrected,
                                                  eps_high=eps_high or None)
  assert 0.2 < want_clipped < 0.8  # the batch exercises both branches
  if eps_high:  # clip-higher (DAPO) changes what is clipped, so the loss
    symmetric_loss, _, symmetric_clipped = _reference(logp, old, adv, mask, ref)
    assert symmetric_clipped > want_clipped and abs(symmetric_loss - want_loss) > 1e-4
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  fn = lambda lp: objective.objective(lp, f32(old), f32(adv), f32(mask), f32(ref), epsilon=EPS,
                                 epsilon_high=eps_high, beta=BETA, bias_correction_kl=corrected)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(f32(logp))
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(float(metrics['clip_fraction']), want_clipped, rtol=1e-6)
  assert float(metrics['kl']) > 0
  # The correction changes the loss here (ratios are not 1) and the gradient always.
  other_loss, other_grad, _ = _reference(logp, old, adv, mask, ref, corrected=not corrected,
                                         eps_high=eps_high or None)
  assert abs(other_loss - want_loss) > 1e-4 and np.abs(other_grad - want_grad).max() > 1e-4
  # beta 0: no KL term (and no reference needed).
  loss0, _ = objective.objective(f32(logp), f32(old), f32(adv), f32(mask), None, epsilon=EPS)
  np.testing.assert_allclose(float(loss0), _reference(logp, old, adv, mask, ref, beta=0)[0],
                             rtol=1e-5)


@pytest.mark.parametrize('mode', ['sequence_mask', 'sequence_truncate', 'token_mask',
                                  'token_truncate'])
@pytest.mark.parametrize('clip_min, clip_max', [(None, 3.0), (0.5, 2.0), (0.5, None)])
def test_the_rollout_weights_and_the_loss_they_weigh_equal_trls_formula_in_float64(
    mode, clip_min, clip_max):
  """objective.rollout_weights against a float64 NumPy transcription of TRL's (every mode; TRL's
  default bounds, both, a lower one alone): the weight of each token (or completion), the loss
  and its gradient with the weight on the policy term (not the KL term), and the statistics
  logged (the weight's mean, min and max over the completion tokens, or the completions, and the
  share outside the bounds)."""
  rng = np.random.default_rng(11)
  logp, old, adv, mask, ref = _batch(rng, B=16)
  train = logp + rng.normal(0, 0.2, logp.shape)  # (the params that sampled, before the update)
  spread = 0.35 if mode.startswith('sequence') else 0.7  # (a completion's ratio sums ~7 tokens')
  rollout = train + spread * rng.standard_normal(logp.shape)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  c = objective.Correction(mode, clip_min or 0.0, clip_max or 0.0)
  weight, outside = objective.rollout_weights(f32(train), f32(rollout), f32(mask), c)
  want, want_outside = _trl_rollout_weight(train, rollout, mask, mode, clip_min, clip_max)
  assert weight.shape == want.shape == ((16, 1) if mode.startswith('sequence') else logp.shape)
  np.testing.assert_allclose(np.asarray(weight), want, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(outside), want_outside)
  units = (mask.sum(-1, keepdims=True) > 0) if want.shape[1] == 1 else mask > 0
  share = want_outside[units].mean()
  assert 0 < share < 0.8, share  # some tokens (completions) clipped or masked, not all
  # The loss: the policy term times the weight, the KL term not.
  fn = lambda lp: objective.objective(lp, f32(old), f32(adv), f32(mask), f32(ref), epsilon=EPS,
                                      beta=BETA, rollout_weight=weight)
  (loss, _), grad = jax.value_and_grad(fn, has_aux=True)(f32(logp))
  want_loss, want_grad, _ = _reference(logp, old, adv, mask, ref, weight=want)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
  assert abs(_reference(logp, old, adv, mask, ref)[0] - want_loss) > 1e-3  # (it weighs)
  sums, maxima, minima = objective.correction_stats(weight, outside, f32(mask))
  assert float(sums['rollout_units']) == units.sum()
  np.testing.assert_allclose(float(sums['rollout_weight'] / sums['rollout_units']),
                             want[units].mean(), rtol=1e-5)
  np.testing.assert_allclose(float(maxima['rollout_weight_max']), want[units].max(), rtol=1e-5)
  np.testing.assert_allclose(float(minima['rollout_weight_min']), want[units].min(), rtol=1e-5)
  np.testing.assert_allclose(float(sums['rollout_outside'] / sums['rollout_units']), share)


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
  logp_of = lambda p: engine.token_logprobs(model, p, tokens)[0]
  grads = jax.grad(lambda p: objective.objective(logp_of(p), f32(old), f32(adv), f32(mask),
                                                 f32(ref), epsilon=EPS, beta=BETA)[0])(params)
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
  adv = objective.group_advantages(jnp.asarray([[1.0, 0.0, 0.0, 1.0]]))[0]
  before = np.asarray(_completion_logp(model, params, tokens, mask).sum(1))
  old = engine.token_logprobs(model, params, tokens)[0]  # on-policy: ratio 1
  logp_of = lambda p: engine.token_logprobs(model, p, tokens)[0]
  grads = jax.grad(lambda p: objective.objective(logp_of(p), old, adv, jnp.asarray(mask),
                                                 epsilon=EPS)[0])(params)
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
  model_config = run.config.model
  prompts = [sample_lib.encode_prompt(run.tokenizer, p).tolist() for p in ('The ', 'A list ')]

  def sample(seed):
    eng = engine.Engine(model_config, run.params, run.tokenizer, slots=8,
                        context=tiny_run.SEQ_LEN)
    return rollout.rollouts(eng, prompts, 4, max_new_tokens=12, temperature=1.0, seed=seed,
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


class _Engine:
  """Stands in for engine.Engine in rollouts' row assembly: completions as given."""

  def __init__(self, completions):
    self.completions = completions

  def generate(self, sequences):
    for seq, (tokens, logprobs, eos_logprob, text) in zip(sequences, self.completions):
      seq.tokens, seq.logprobs, seq.eos_logprob, seq.text = tokens, logprobs, eos_logprob, text
    return sequences


def test_a_completion_cut_at_its_stop_string_keeps_no_later_eos():
  """In one decoding chunk the model writes 'cba', the stop string '\\n', more, then EOS: the
  completion ends at the stop string, so the EOS (sampled elsewhere) is not its last token."""
  from jax_pretrain.data import tokenizer as tokenizer_lib  # noqa: PLC0415
  tok = tokenizer_lib.ByteTokenizer()
  out = output.OutputProcessor(tok)
  chunk = [*tok.encode('cba\nQ:').tolist(), tok.eos_id]
  seq = engine.Sequence(prompt=[1], max_new_tokens=8, stop=('\n',))
  out.extend(seq, np.array(chunk), np.linspace(-1, -2, len(chunk)), np.zeros((8, 5)),
             np.zeros((8, 5), np.int32))
  assert (seq.text, seq.finish_reason, seq.eos_logprob) == ('cba', 'stop', None)
  assert tok.decode(seq.tokens) == 'cba\n' and len(seq.logprobs) == 4
  r = rollout.rollouts(_Engine([(seq.tokens, seq.logprobs, seq.eos_logprob, seq.text)]), [[1, 2]],
                    1, max_new_tokens=8, temperature=1.0, seed=0, pad_id=0, eos_id=tok.eos_id)
  assert r.tokens_BxT1[0].tolist() == [1, 2, *tok.encode('cba\n').tolist()]  # no EOS after it
  seq = engine.Sequence(prompt=[1], max_new_tokens=8, stop=('\n',))  # EOS first: it is kept
  out.extend(seq, np.array([*tok.encode('ab').tolist(), tok.eos_id, 65]), np.full(4, -0.5),
             np.zeros((8, 5)), np.zeros((8, 5), np.int32))
  assert (seq.text, seq.eos_logprob) == ('ab', -0.5)


def test_rollout_rows_train_the_eos_that_ended_a_completion():
  eng = _Engine([([5, 6], [-0.5, -0.25], -0.125, 'ab'),  # ended by EOS: trained on it
                 ([7, 8, 9], [-1.0, -2.0, -3.0], None, 'cde')])  # max_new_tokens: no EOS
  r = rollout.rollouts(eng, [[1, 2, 3]], 2, max_new_tokens=3, temperature=1.0, seed=0, pad_id=0,
                    eos_id=99, width=8)
  np.testing.assert_array_equal(r.tokens_BxT1, [[1, 2, 3, 5, 6, 99, 0, 0],
                                                [1, 2, 3, 7, 8, 9, 0, 0]])
  np.testing.assert_array_equal(r.mask_BxT, [[0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(r.logp_BxT[0, 2:5], [-0.5, -0.25, -0.125])
  np.testing.assert_array_equal(r.lengths, [3, 3])
  assert r.completions == ['ab', 'cde']


def _logprobs(model, params, tokens, temperature):
  """log softmax(logits / temperature) of each target, in jax (differentiable)."""
  logits = model.apply({'params': params}, tokens[:, :-1]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits / temperature, axis=-1)
  return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


@pytest.mark.parametrize('prompt, new, seq_len, width', [
    (10, 8, 64, 25),  # inputs 17 -> 24: a multiple of 8 (cuDNN trains on no odd length)
    (9, 8, 64, 17),  # inputs 16 already
    (40, 24, 64, 65),  # capped at seq_len inputs
])
def test_update_rows_give_the_model_inputs_a_multiple_of_8_long(prompt, new, seq_len, width):
  c = grpo_config.defaults()
  c.grpo.max_new_tokens, c.data.seq_len = new, seq_len
  assert objective.update_width(c, prompt) == width
  assert width >= prompt + new  # every rollout fits its row


def _step_batch(model, params, rng, temperature, B=8, T=11):
  """A GRPO update batch: 2 groups of 4, prompts of 3 tokens, completions of 3 to 8 tokens; and
  (float64) the log-probabilities at the temperature and the completions' advantages."""
  tokens = rng.integers(0, 256, (B, T + 1))
  mask = np.zeros((B, T), np.float32)
  for b in range(B):
    mask[b, 2:2 + rng.integers(3, 9)] = 1
  logits = np.asarray(model.apply({'params': params}, jnp.asarray(tokens[:, :-1], jnp.int32)),
                      np.float64)
  def log_softmax_at(t):
    z = logits / t
    z = z - z.max(-1, keepdims=True)
    all_logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return np.take_along_axis(all_logp, tokens[:, 1:, None], -1)[..., 0]
  logp, at_one = log_softmax_at(temperature), log_softmax_at(1.0)
  rewards = rng.integers(0, 2, (2, 4)).astype(np.float64)
  rewards[:, 0] = 1 - rewards[:, 1]  # no group all alike
  adv = np.asarray(objective.group_advantages(jnp.asarray(rewards)), np.float64).reshape(-1)
  batch = {'tokens': tokens.astype(np.int32), 'mask': mask,
           'advantages': np.repeat(adv[:, None], T, 1).astype(np.float32),
           'rollout_logp': (at_one + rng.normal(0, 0.01, logp.shape) * mask).astype(np.float32),
           'ref_logp': (logp + rng.normal(0, 0.3, logp.shape)).astype(np.float32)}
  return batch, logp, at_one, adv


def test_the_update_clips_the_ratio_to_the_configs_epsilon_and_epsilon_high(tiny):
  """update_loss_fn (the loss the program compiles) takes grpo.epsilon and grpo.epsilon_high:
  off-policy (a reused rollout batch), its loss and clipped share are the float64 formula's with
  that range, and clip-higher clips fewer tokens than the symmetric default."""
  model, params = tiny
  rng = np.random.default_rng(7)
  batch, logp, _, adv = _step_batch(model, params, rng, 1.0)
  del batch['ref_logp']  # beta 0
  batch['old_logp'] = (logp + rng.uniform(-0.5, 0.5, logp.shape)).astype(np.float32)
  old, mask = batch['old_logp'].astype(np.float64), batch['mask'].astype(np.float64)
  clipped = {}
  for eps, eps_high in [(0.2, 0.0), (0.2, 0.4), (0.05, 0.0)]:
    c = grpo_config.with_group(config_lib.preset('test'))
    c.model.dtype, c.model.attention = 'float32', 'xla'
    c.grpo.task, c.grpo.epsilon, c.grpo.epsilon_high = 'train.jsonl', eps, eps_high
    c.grpo.rollout_correction = 'none'  # (its weights: test_the_update_weighs_...)
    loss_fn = objective.update_loss_fn(build_setup(c, jax.devices()[:1]))
    loss_sum, (weight, sums, _, _) = loss_fn(params, batch)
    want_loss, _, want_clipped = _reference(logp, old, adv, mask, logp, eps=eps, beta=0,
                                            eps_high=eps_high or None)
    np.testing.assert_allclose(float(loss_sum / weight), want_loss, rtol=1e-5)
    clipped[eps, eps_high] = float(sums['clip_fraction'] / weight)
    np.testing.assert_allclose(clipped[eps, eps_high], want_clipped, rtol=1e-6)
  assert clipped[0.2, 0.4] < clipped[0.2, 0.0] < clipped[0.05, 0.0], clipped


@pytest.mark.parametrize('temperature, off_policy, corrected', [
    (1.0, False, True), (0.7, False, True), (1.0, True, True), (0.7, True, False)])
def test_the_train_steps_grpo_loss_and_gradient_equal_the_float64_reference(
    tiny, temperature, off_policy, corrected):
  """The loss the update differentiates against grpo's formula in float64: loss, gradient
  (chained through the model's VJP), KL, mismatch (at temperature 1, the engine's scale), clipped
  share; logp of the sampling distribution (logits / temperature). On-policy (one update a batch)
  logp_old is the forward's own, held constant, and nothing is clipped; off-policy (a later update
  of num_iterations > 1) it is the batch's 'old_logp', ratios move away from 1 and clip."""
  model, params = tiny
  rng = np.random.default_rng(5)
  batch, logp, at_one, adv = _step_batch(model, params, rng, temperature)
  old = logp
  if off_policy:
    batch['old_logp'] = (logp + rng.uniform(-0.5, 0.5, logp.shape)).astype(np.float32)
    old = batch['old_logp'].astype(np.float64)
  mask = batch['mask'].astype(np.float64)
  ref = batch['ref_logp'].astype(np.float64)
  loss_fn = objective.make_loss_fn(model, beta=BETA, temperature=temperature,
                              bias_correction_kl=corrected, epsilon=EPS)
  (loss_sum, (weight, sums, _, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params,
                                                                                     batch)
  want_loss, want_dlogp, clipped = _reference(logp, old, adv, mask, ref, corrected=corrected)
  assert (0.1 < clipped < 0.9) if off_policy else clipped == 0
  np.testing.assert_allclose(float(loss_sum / weight), want_loss, rtol=1e-5)
  assert float(weight) == mask.sum()
  kl = (np.exp(ref - logp) - (ref - logp) - 1) * (np.exp(logp - old) if corrected else 1)
  np.testing.assert_allclose(float(sums['kl'] / weight), (kl * mask).sum() / mask.sum(),
                             rtol=1e-4)
  mismatch = np.abs(at_one - batch['rollout_logp']) * mask
  np.testing.assert_allclose(float(sums['logp_mismatch'] / weight),
                             mismatch.sum() / mask.sum(), rtol=1e-3)
  np.testing.assert_allclose(float(sums['clip_fraction'] / weight), clipped, rtol=1e-6)
  tokens = jnp.asarray(batch['tokens'])
  _, vjp = jax.vjp(lambda p: _logprobs(model, p, tokens, temperature), params)
  (want,) = vjp(jnp.asarray(want_dlogp * mask.sum(), jnp.float32))  # d loss_sum, not the mean
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):  # (entries up to ~4: float32)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize('temperature, off_policy, mode', [
    (1.0, False, 'sequence_mask'), (0.7, False, 'token_truncate'), (1.0, True, 'sequence_mask'),
    (0.7, True, 'token_mask')])
def test_the_update_weighs_the_loss_by_the_rollout_correction_of_the_sampling_params(
    tiny, temperature, off_policy, mode):
  """update_loss_fn with the grpo group's correction: the weight compares the engine's
  log-probabilities with the training forward's of the params that sampled, both at temperature 1
  (the engine's scale): on-policy this forward's own; with num_iterations > 1 the scored
  logp_old ('old_logp' at temperature 1, 'old_logp_at_one' at another), so that the μ updates
  weigh alike. Loss, gradient and the logged statistics against the float64 formula."""
  model, params = tiny
  rng = np.random.default_rng(5)
  batch, logp, at_one, adv = _step_batch(model, params, rng, temperature)
  mask, ref = batch['mask'].astype(np.float64), batch['ref_logp'].astype(np.float64)
  c = grpo_config.with_group(config_lib.preset('test'))
  c.model.dtype, c.model.attention = 'float32', 'xla'
  c.grpo.task, c.grpo.temperature, c.grpo.beta = 'train.jsonl', temperature, BETA
  c.grpo.rollout_correction, c.grpo.rollout_correction_min = mode, 0.5
  c.grpo.num_iterations = 2 if off_policy else 1
  s = build_setup(c, jax.devices()[:1])
  old, sampler = logp, at_one  # (on-policy: this forward's own)
  if off_policy:  # logp_old and its temperature-1 twin, scored before the first update
    shift = rng.uniform(-0.5, 0.5, logp.shape)
    old, sampler = logp + shift, at_one + shift
    batch['old_logp'] = old.astype(np.float32)
    if temperature != 1.0:
      batch['old_logp_at_one'] = sampler.astype(np.float32)
  assert set(batch) == set(objective.update_batch(s, batch['tokens'].shape[1]))
  batch['rollout_logp'] = (at_one + rng.normal(0, 0.6, logp.shape) * mask).astype(np.float32)
  want_w, outside = _trl_rollout_weight(sampler, batch['rollout_logp'], mask, mode, 0.5)
  units = (mask.sum(-1, keepdims=True) > 0) if want_w.shape[1] == 1 else mask > 0
  assert 0 < outside[units].mean() < 1
  loss_fn = objective.update_loss_fn(s)
  (loss_sum, (weight, sums, maxima, minima)), grads = jax.value_and_grad(
      loss_fn, has_aux=True)(params, batch)
  want_loss, want_dlogp, _ = _reference(logp, old, adv, mask, ref, weight=want_w)
  np.testing.assert_allclose(float(loss_sum / weight), want_loss, rtol=1e-5)
  np.testing.assert_allclose(float(sums['rollout_weight'] / sums['rollout_units']),
                             want_w[units].mean(), rtol=1e-4)
  np.testing.assert_allclose(float(maxima['rollout_weight_max']), want_w[units].max(), rtol=1e-4)
  np.testing.assert_allclose(float(minima['rollout_weight_min']), want_w[units].min(), rtol=1e-4)
  np.testing.assert_allclose(float(sums['rollout_outside'] / sums['rollout_units']),
                             outside[units].mean())
  _, vjp = jax.vjp(lambda p: _logprobs(model, p, jnp.asarray(batch['tokens']), temperature),
                   params)
  (want,) = vjp(jnp.asarray(want_dlogp * mask.sum(), jnp.float32))
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=1e-6)


def test_the_train_step_reduces_the_rollout_weights_over_micro_batches_and_replicas(tiny):
  """The weight's extremes reach the step's metrics as the maximum and minimum over the
  micro-batches and the data-parallel replicas (state.make_train_step's maxima and minima), its
  sums as sums: 2 replicas × 2 micro-batches give the one-batch loss function's values."""
  model, params = tiny
  rng = np.random.default_rng(3)
  batch, _, at_one, _ = _step_batch(model, params, rng, 1.0)
  del batch['ref_logp']  # beta 0
  batch['rollout_logp'] = (at_one + rng.normal(0, 0.6, at_one.shape) * batch['mask']).astype(
      np.float32)
  c = grpo_config.with_group(config_lib.preset('test'))
  c.model.dtype, c.model.attention = 'float32', 'xla'
  c.grpo.task, c.grpo.rollout_correction_min = 'train.jsonl', 0.3
  c.mesh.data, c.train.batch_size, c.train.micro_batch_size = 2, 8, 2
  s = build_setup(c, jax.devices()[:2])
  assert s.run.grad_accum_steps == 2
  loss_fn = objective.update_loss_fn(s)
  state = dataclasses.replace(s.init_fn(jax.random.key(0)), params=params)
  step = state_lib.make_train_step(s.model, s.optimizer, s.schedule, grad_accum_steps=2,
                                   pad_id=0, mesh=s.mesh, loss_fn=loss_fn)
  _, metrics = jax.jit(step, in_shardings=(s.state_shardings, s.batch_sharding))(state, batch)
  loss_sum, (count, sums, maxima, minima) = objective.make_loss_fn(
      model, 0.0, epsilon=EPS, correction=objective.Correction(low=0.3))(params, batch)
  assert 0 < float(sums['rollout_outside']) < float(sums['rollout_units'])  # (some masked)
  for name, want in [('loss', loss_sum), *sums.items()]:
    np.testing.assert_allclose(float(metrics[name]), float(want / count), rtol=1e-5, atol=1e-7,
                               err_msg=name)
  for name, want in {**maxima, **minima}.items():
    np.testing.assert_allclose(float(metrics[name]), float(want), rtol=1e-5, err_msg=name)


def _trl_trainer(hf_dir, out_dir, rows, rewards, logprobs=None, **args):
  """TRL's GRPOTrainer on the exported model, on the CPU in float32, its generation replaced by
  the given rows (rollout_func: (prompt ids, completion ids) a completion, with logprobs the
  sampler's log-probability of each completion token) and its reward by the given rewards, in
  order; args: GRPOConfig fields besides its defaults'."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  datasets = pytest.importorskip('datasets')
  trl = pytest.importorskip('trl')
  config = trl.GRPOConfig(output_dir=str(out_dir), use_cpu=True, bf16=False, report_to='none',
                          per_device_train_batch_size=len(rows), logging_steps=1,
                          max_completion_length=max(len(c) for _, c in rows), **args)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
  trainer = trl.GRPOTrainer(
      model=model, args=config, reward_funcs=lambda prompts, completions, **_: list(rewards),
      train_dataset=datasets.Dataset.from_dict({'prompt': ['a', 'b']}),
      processing_class=transformers.AutoTokenizer.from_pretrained(str(hf_dir)),
      rollout_func=lambda prompts, _: {'prompt_ids': [p for p, _ in rows],
                                      'completion_ids': [c for _, c in rows],
                                      'logprobs': logprobs})
  trainer.current_gradient_accumulation_steps = 1  # (set by Trainer's loop, which is not run)
  return trainer


@pytest.mark.parametrize('temperature, beta, off_policy, correction', [
    (1.0, 0.0, False, None), (0.7, 0.0, False, None), (1.0, BETA, False, None),
    (0.7, BETA, False, None), (0.7, BETA, True, None),
    (1.0, 0.0, False, ('sequence_mask', None)), (1.0, BETA, False, ('sequence_truncate', None)),
    (1.0, BETA, False, ('token_mask', 0.5)), (1.0, 0.0, False, ('token_truncate', 0.5))])
def test_the_grpo_loss_equals_trls_at_its_defaults(tmp_path, monkeypatch, temperature, beta,
                                                   off_policy, correction):
  """TRL's GRPOTrainer (its defaults: loss_type 'dapo', epsilon 0.2, scale_rewards 'group',
  use_bias_correction_kl) and ours on the same exported model, completions and rewards: TRL's own
  code scores them (rewards -> advantages, the reference's and the policy's log-probabilities at
  the temperature) and computes the loss (compute_loss) and, by backward, every parameter's
  gradient; ours (group_advantages, make_loss_fn: the train step's loss) agree to 1e-5. The
  reference model is the policy moved a little (as after some steps: with the policy's own
  params the KL term and its gradient are 0, and the test would not see it). Off-policy: a later
  update of num_iterations=2, logp_old moved off logp (the same for both), so that ratios clip.

  TRL without vLLM corrects no rollouts: ours is off (correction None); with one: _as_vllms."""
  torch = pytest.importorskip('torch')
  pytest.importorskip('trl')
  monkeypatch.setenv('TRL_EXPERIMENTAL_SILENCE', '1')  # (rollout_func is experimental)
  monkeypatch.setenv('CI', '1')  # (no telemetry from a test)
  c = preset_config()
  params = random_params(c, seed=3)
  rng = np.random.default_rng(7)
  ref_params = jax.tree.map(lambda x: x + np.float32(0.03) * rng.standard_normal(
      x.shape, np.float32), params)
  tok = tokenizer_lib.ByteTokenizer()
  hf.save(str(tmp_path / 'hf'), params, c, max_position_embeddings=64, tokenizer=tok)
  # 2 prompts of 5 tokens (TRL pads prompts on the left: equal lengths keep the positions ours)
  # × 4 completions of 2 to 7 tokens, some ending with EOS; rewards with ties and spread.
  P, G = 2, 4
  prompts = [rng.integers(3, 256, 5).tolist() for _ in range(P)]
  rows = []
  for b in range(P * G):
    completion = rng.integers(3, 256, rng.integers(2, 8)).tolist()
    rows.append((prompts[b // G], completion + ([tok.eos_id] if b % 3 == 0 else [])))
  rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.25, -1.0, 2.0, 0.25])
  g = grpo_config.defaults().grpo
  model = model_lib.Transformer(c)
  corr, sampled, vllm = _as_vllms(model, params, rows, correction, rng)
  trainer = _trl_trainer(tmp_path / 'hf', tmp_path / 'out', rows, rewards, logprobs=sampled,
                         num_generations=G, beta=beta, temperature=temperature,
                         num_iterations=2 if off_policy else 1, **vllm)
  _check_trls_defaults(trainer.args, g, corr)
  if corr:  # (its rollouts taken as vLLM's, whose weights are in sync already)
    trainer.use_vllm, trainer._last_loaded_step = True, trainer.state.global_step  # noqa: SLF001
  if beta:  # (TRL loads its reference from the policy's directory)
    trainer.ref_model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in hf.to_hf(ref_params, c).items()}, strict=False)
  trainer.model.train()
  inputs = trainer._generate_and_score_completions([{'prompt': 'ab'[b // G]} for b in range(P * G)])  # noqa: SLF001
  ids = torch.cat([inputs['prompt_ids'], inputs['completion_ids']], 1)
  C = inputs['completion_ids'].shape[1]
  with torch.no_grad():
    theirs_logp = trainer._get_per_token_logps_and_entropies(  # noqa: SLF001
        trainer.model, ids, torch.cat([inputs['prompt_mask'], inputs['completion_mask']], 1),
        C)[0].numpy()
  completion = inputs['completion_mask'].numpy() > 0
  if off_policy:
    shift = rng.uniform(-0.5, 0.5, theirs_logp.shape).astype(np.float32) * completion
    inputs['old_per_token_logps'] = inputs['old_per_token_logps'] + torch.from_numpy(shift)
  loss = trainer.compute_loss(trainer.model, inputs)
  loss.backward()
  theirs = {name: p.grad.numpy() for name, p in trainer.model.named_parameters()}

  # Ours on the same rows: tokens = prompt + completion (+ pad), targets t = token t + 1.
  tokens = jnp.asarray(ids.numpy(), jnp.int32)
  B, T = tokens.shape[0], tokens.shape[1] - 1
  mask = np.zeros((B, T), np.float32)
  mask[:, T - C:] = completion
  advantages = objective.group_advantages(jnp.asarray(rewards.reshape(P, G)), g.scale_rewards)
  np.testing.assert_allclose(np.asarray(advantages).reshape(-1), inputs['advantages'].numpy(),
                             rtol=1e-5, atol=1e-6)
  score = lambda p: state_lib.target_logprobs(model, p, {'tokens': tokens}, (temperature,))[0]
  rollout_logp = np.zeros((B, T), np.float32)
  for b, logps in enumerate(sampled or []):
    rollout_logp[b, T - C:T - C + len(logps)] = logps
  with jax.default_matmul_precision('float32'):
    logp = score(params)
    batch = {'tokens': tokens, 'mask': jnp.asarray(mask), 'rollout_logp': rollout_logp,
             'advantages': jnp.broadcast_to(advantages.reshape(-1, 1), (B, T))}
    if beta:
      batch['ref_logp'] = score(ref_params)
      np.testing.assert_allclose(np.asarray(batch['ref_logp'])[:, T - C:] * completion,
                                 inputs['ref_per_token_logps'].numpy(), atol=1e-5)
    if off_policy:  # TRL's logp_old: scored when the batch was generated, with these params
      np.testing.assert_allclose(np.asarray(logp)[:, T - C:] * completion,
                                 inputs['old_per_token_logps'].numpy() - shift, atol=1e-5)
      batch['old_logp'] = logp.at[:, T - C:].add(shift)
    loss_fn = objective.make_loss_fn(model, beta, temperature, epsilon=g.epsilon,
                                     epsilon_high=g.epsilon_high, correction=corr)
    (loss_sum, (weight, sums, *extremes)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(params, batch)
  np.testing.assert_allclose(np.asarray(logp)[:, T - C:] * completion, theirs_logp, atol=1e-5)
  np.testing.assert_allclose(float(loss_sum / weight), loss.item(), rtol=1e-5, atol=1e-6)
  clipped = float(sums['clip_fraction'] / weight)
  assert (clipped > 0.1) if off_policy else clipped == 0
  if corr:
    _check_rollout_weights_as_trls(trainer, inputs['importance_sampling_ratio'], sums, *extremes)
  ours = hf.to_hf(jax.tree.map(lambda x: np.asarray(x) / float(weight), grads), c)
  assert ours.keys() == theirs.keys()
  for name, grad in theirs.items():
    np.testing.assert_allclose(ours[name], grad, rtol=1e-5, atol=1e-5 * np.abs(grad).max(),
                               err_msg=name)


def _as_vllms(model, params, rows, correction, rng):
  """For TRL's rollout correction (correction: (mode, clip_min) or None, off): ours (a Correction
  with TRL's clip_max), the sampler's log-probabilities of the rows (_sampled_logprobs) and
  GRPOConfig's arguments; (None, None, {}) for none. The test then sets the trainer's use_vllm:
  its importance-sampling code runs on the given log-probabilities, and its weights, loss and
  gradient are to equal ours, its sampling/importance_sampling_ratio metrics our statistics."""
  if not correction:
    return None, None, {}
  corr = objective.Correction(correction[0], correction[1] or 0.0, 3.0)
  return corr, _sampled_logprobs(model, params, rows, corr, rng), {
      'vllm_importance_sampling_mode': corr.mode,
      'vllm_importance_sampling_clip_min': correction[1]}


def _check_trls_defaults(a, g, corr) -> None:
  """TRL's GRPOConfig a and our grpo group g agree on the defaults the test relies on (the
  rollout correction's where corr is None: TRL's default mode, which is ours)."""
  assert (a.loss_type, a.epsilon, a.epsilon_high, a.scale_rewards, a.use_bias_correction_kl,
          a.importance_sampling_level) == ('dapo', g.epsilon, None, g.scale_rewards,
                                           g.use_bias_correction_kl, 'token')
  assert g.epsilon_high == 0  # ours for TRL's None: epsilon
  assert (a.vllm_importance_sampling_correction, a.vllm_importance_sampling_mode,
          a.vllm_importance_sampling_clip_max, g.rollout_correction,
          g.rollout_correction_max, g.rollout_correction_min) == (
              True, corr.mode if corr else 'sequence_mask', 3.0, 'sequence_mask', 3.0, 0.0)


def _check_rollout_weights_as_trls(trainer, theirs, sums, maxima, minima) -> None:
  """Our weight's statistics (make_loss_fn's) are TRL's sampling/importance_sampling_ratio
  metrics; some tokens (or completions) were clipped or masked, not all."""
  assert 0 < float(sums['rollout_outside'] / sums['rollout_units']) < 0.9, sums
  assert theirs.shape[1] == 1 or float(sums['rollout_units']) > theirs.shape[0]  # (per token)
  metrics = trainer._metrics['train']  # noqa: SLF001
  for name, value in (('mean', sums['rollout_weight'] / sums['rollout_units']),
                      ('min', minima['rollout_weight_min']),
                      ('max', maxima['rollout_weight_max'])):
    np.testing.assert_allclose(float(value),
                               metrics[f'sampling/importance_sampling_ratio/{name}'][-1],
                               rtol=1e-5, err_msg=name)


def _sampled_logprobs(model, params, rows, correction, rng) -> list[list[float]]:
  """A sampler's log-probabilities of each row's completion tokens (temperature 1): the model's
  moved by amounts that put some tokens' (token_*) or completions' (sequence_*) ratios outside
  the correction's bounds and every one at least 0.05 from them (in log space; the two forwards
  agree to 1e-5, so the same ones are clipped or masked)."""
  width = max(len(p) + len(comp) for p, comp in rows)
  tokens = np.zeros((len(rows), width), np.int32)
  for b, (p, comp) in enumerate(rows):
    tokens[b, :len(p) + len(comp)] = p + comp
  logp = np.asarray(state_lib.target_logprobs(model, params, {'tokens': jnp.asarray(tokens)})[0])
  bounds = np.log([x for x in (correction.low, correction.high) if x])
  sampled = []
  for b, (p, comp) in enumerate(rows):
    d = rng.normal(0.0, 0.9, len(comp))
    if correction.mode.startswith('sequence'):  # the row's ratio: exp(sum d)
      d += (rng.choice([-2.0, -0.5, 0.5, 2.0]) - d.sum()) / len(comp)
    d = np.where(np.abs(d[:, None] - bounds).min(-1) < 0.05, d + 0.1, d)  # (clear of them)
    sampled.append((logp[b, len(p) - 1:len(p) - 1 + len(comp)] - d).tolist())
  return sampled


# The program on a toy task: completions are rewarded for their share of the letter 'e' (a user's
# reward function), which varies from the start, so groups have advantages to learn from.
E_REWARD = ('def share_of_e(completion, item):\n'
            '  return completion.count("e") / max(len(completion), 1)\n')
STEPS = 8


@pytest.fixture(scope='module')
def toy(tmp_path_factory):
  """(the tiny pretrained run, the task's files, the reward) for the program's tests."""
  from tests import tiny_run  # noqa: PLC0415
  base = tiny_run.train_once(tmp_path_factory)
  d = tmp_path_factory.mktemp('toy_task')
  for name, numbers in (('train', range(32)), ('heldout', range(32, 40))):
    with open(d / f'{name}.jsonl', 'w', encoding='utf-8') as f:
      for i in numbers:
        f.write(json.dumps({'prompt': f'Item {i}: ', 'answer': 'e'}) + '\n')
  (d / 'reward_e.py').write_text(E_REWARD + 'def nan(completion, item):\n  return float("nan")\n')
  return base, d


def _grpo_command(toy, workdir, *extra):
  base, d = toy
  return [sys.executable, '-m', 'jax_pretrain.grpo', f'--workdir={workdir}', f'--init={base}',
          f'--task={d}/train.jsonl', f'--eval_task={d}/heldout.jsonl',
          f'--config.grpo.reward={d}/reward_e.py:share_of_e', '--config.grpo.num_samples=4',
          '--config.train.batch_size=16', '--config.grpo.max_new_tokens=12',
          f'--config.train.steps={STEPS}', '--config.optim.warmup_steps=2',
          '--config.optim.learning_rate=1e-3', '--config.optim.min_learning_rate=1e-3',
          '--config.train.eval_every=4', '--config.checkpoint.every_steps=4', *extra]


def _records(workdir) -> dict[int, dict]:
  """step -> every scalar logged for it (train and eval), from metrics.jsonl."""
  steps = {}
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    for record in map(json.loads, f):
      steps.setdefault(record.pop('step'), {}).update(record)
  return steps


def _straight_and_stopped(toy, tmp_path, steps: int, stop_at: int, *extra) -> tuple[dict, dict]:
  """The records of a straight run, and of one stopped by SIGTERM once step stop_at is logged
  then rerun; checks that the rerun resumed and that both ran every step."""
  straight, stopped = tmp_path / 'straight', tmp_path / 'stopped'
  out = subprocess.run(_grpo_command(toy, straight, *extra), cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  proc = subprocess.Popen(_grpo_command(toy, stopped, *extra), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=subprocess_env(), cwd=ROOT)
  for line in proc.stdout:
    if line.startswith(f'step {stop_at}/'):
      proc.send_signal(signal.SIGTERM)  # stops after the step in flight, saves, exits 0
  assert proc.wait(timeout=300) == 0
  rerun = subprocess.run(_grpo_command(toy, stopped, *extra), cwd=ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert 'resuming from step' in rerun.stdout
  want, got = _records(straight), _records(stopped)
  assert sorted(want) == sorted(got) == list(range(steps + 1))  # step 0: eval before training
  return want, got


CORRECTION_SCALARS = ('train/rollout_weight_mean', 'train/rollout_weight_min',
                      'train/rollout_weight_max', 'train/rollout_outside')


def _check_correction_scalars(record: dict) -> None:
  """A step's rollout correction scalars (the default, sequence_mask at most 3.0): a weight in
  [0, 3] (min <= mean <= max) and a share."""
  w = [record[f'train/rollout_weight_{k}'] for k in ('min', 'mean', 'max')]
  assert 0 <= w[0] <= w[1] <= w[2] <= 3.0 and 0 <= record['train/rollout_outside'] <= 1, record


def test_a_grpo_run_stopped_by_sigterm_and_rerun_equals_a_straight_run_and_learns(toy, tmp_path):
  want, got = _straight_and_stopped(toy, tmp_path, STEPS, 3)
  for step in range(1, STEPS + 1):
    for name in ('train/reward', 'train/loss', 'train/grad_norm', 'train/logp_mismatch',
                 'train/completion_tokens', *CORRECTION_SCALARS):
      assert got[step][name] == want[step][name], (step, name)  # bitwise: same rollouts
    _check_correction_scalars(want[step])
  assert 0 < want[1]['perf/generation_share'] < 1 and want[1]['train/clip_fraction'] == 0
  # The policy learns the reward: held-out greedy completions score more than before training.
  assert want[STEPS]['eval/reward'] > want[0]['eval/reward'] + 0.2, (want[0], want[STEPS])


def test_num_iterations_reuses_each_rollout_batch_clips_and_resumes_exactly(toy, tmp_path):
  """grpo.num_iterations=2 at a large learning rate: each step's rollout batch makes 2 updates,
  the second off its sampling policy (logp_old scored before the first), so ratios clip. Steps
  count batches and the state updates: the schedule is stretched (warmup 2 steps: 4 updates, a
  step's lr the mean of its two), and a run stopped by SIGTERM resumes at its step and equals
  the straight run bitwise."""
  steps, lr = 4, 3e-2
  want, got = _straight_and_stopped(
      toy, tmp_path, steps, 1, '--config.grpo.num_iterations=2', f'--config.train.steps={steps}',
      f'--config.optim.learning_rate={lr}', f'--config.optim.min_learning_rate={lr}')
  for step in range(1, steps + 1):
    for name in ('train/reward', 'train/loss', 'train/grad_norm', 'train/logp_mismatch',
                 'train/clip_fraction', 'train/lr', 'train/completion_tokens',
                 *CORRECTION_SCALARS):
      assert got[step][name] == want[step][name], (step, name)  # bitwise: same rollouts
    _check_correction_scalars(want[step])
  # Updates 0, 1 | 2, 3 | 4, 5 ... at lr · (0, 1/4) | (2/4, 3/4) | (1, 1) ...
  np.testing.assert_allclose([want[s]['train/lr'] for s in range(1, steps + 1)],
                             [lr / 8, lr * 5 / 8, lr, lr], rtol=1e-6)
  assert all(want[s]['train/clip_fraction'] > 0 for s in range(2, steps + 1)), want


@pytest.mark.parametrize('field, value, message', [
    ('epsilon', 0.0, r'grpo.epsilon=0.0 must be in \(0, 1\)'),
    ('epsilon', 1.5, r'grpo.epsilon=1.5 must be in \(0, 1\)'),
    ('epsilon_high', -0.1, r'grpo.epsilon_high=-0.1 must be >= 0'),
])
def test_a_clip_range_out_of_bounds_is_refused_at_resolve(field, value, message):
  c = grpo_config.defaults()
  c.grpo.task, c.train.steps = 'train.jsonl', 10
  setattr(c.grpo, field, value)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.resolve(c, num_devices=1, backend='cpu')


@pytest.mark.parametrize('values, message', [
    ({'rollout_correction': 'sequence'}, "grpo.rollout_correction='sequence': choose one of "
     r"\('sequence_mask', 'sequence_truncate', 'token_mask', 'token_truncate', 'none'\)"),
    ({'rollout_correction_max': -1.0}, r'grpo.rollout_correction_max=-1.0 must be >= 0'),
    ({'rollout_correction_min': -0.5}, r'grpo.rollout_correction_min=-0.5 must be >= 0'),
    ({'rollout_correction_min': 3.0}, r'grpo.rollout_correction_min=3.0 must be less than '
     r'grpo.rollout_correction_max=3.0'),
    ({'rollout_correction': 'token_truncate', 'rollout_correction_max': 0.0},
     r"grpo.rollout_correction='token_truncate' clips the weight: give it a bound"),
])
def test_a_bad_rollout_correction_is_one_config_error_naming_its_field(values, message):
  c = grpo_config.defaults()
  c.grpo.task, c.train.steps = 'train.jsonl', 10
  for name, value in values.items():
    setattr(c.grpo, name, value)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.resolve(c, num_devices=1, backend='cpu')
  g = grpo_config.defaults().grpo  # TRL's defaults: on, sequence_mask, [None, 3.0]
  assert (g.rollout_correction, g.rollout_correction_min, g.rollout_correction_max) == (
      'sequence_mask', 0.0, 3.0)
  c.grpo.rollout_correction, c.grpo.rollout_correction_max = 'sequence_mask', 0.0
  c.grpo.rollout_correction_min = 0.0
  config_lib.resolve(c, num_devices=1, backend='cpu')  # (a mask without bounds: TRL's too)


@pytest.mark.parametrize('extra, message', [
    (['--init=/nonexistent'], 'configs/grpo.py:/nonexistent: /nonexistent/config.json not found'),
    (['--config.train.batch_size=18'], 'train.batch_size=18 (completions a step) is not a '
     'multiple of grpo.num_samples=4'),
    (['--config.grpo.max_new_tokens=60'], 'exceeds the context of 64'),
    (['--config.grpo.reward=nosuch'], "reward 'nosuch': no such reward"),
    (['--config.grpo.stop=a\\'], "grpo.stop='a\\\\': not a string with readable backslash"),
    (['--config.grpo.reward={d}/reward_e.py:nan'], 'reward nan returned nan on '),
])
def test_bad_input_is_one_error_line(toy, tmp_path, extra, message):
  extra = [arg.format(d=toy[1]) for arg in extra]
  out = subprocess.run(_grpo_command(toy, tmp_path / 'w', *extra), cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  assert out.stderr.strip().splitlines() == [out.stderr.strip()] and message in out.stderr, \
      out.stderr[-2000:]


def test_grpo_on_a_mesh_agrees_with_one_device(toy, tmp_path, capsys):
  """Rollouts (the engine's slots split over the 8 devices, each decoding its own with the
  policy's params gathered once a step) and updates (2 micro-batches a device, the KL against the
  reference model held in the policy's shardings) on a data=2, fsdp=2, tensor=2 mesh: the same
  completions and rewards as one device, losses and KL to 1e-5."""
  from jax_pretrain import train as train_lib  # noqa: PLC0415
  base, d = toy

  def run(workdir, devices, *mesh):
    c = config_lib.load_file(f'{ROOT}/configs/grpo.py')
    config_lib.fine_tune(c, base, 'configs/grpo.py')
    c.grpo.task, c.grpo.reward = f'{d}/train.jsonl', f'{d}/reward_e.py:share_of_e'
    c.grpo.num_samples, c.grpo.max_new_tokens = 4, 12
    c.train.batch_size, c.train.steps, c.train.eval_every = 16, 3, 3
    c.optim.warmup_steps, c.optim.learning_rate, c.optim.min_learning_rate = 1, 1e-3, 1e-3
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
    c.train.micro_batch_size = 16 // (2 * mesh[0] * mesh[1])
    c.grpo.beta = 0.04
    train_lib.train(c, str(workdir), program.GRPO(), devices)
    return _records(workdir)

  one = run(tmp_path / 'one', jax.devices()[:1], 1, 1, 1)
  assert 'engine 16 slots × ' in capsys.readouterr().out
  mesh = run(tmp_path / 'mesh', jax.devices()[:8], 2, 2, 2)
  # (the longest prompt, 'Item 39: ', and 12 new tokens)
  assert 'engine 16 slots × 21 tokens over 8 devices' in capsys.readouterr().out
  assert one[3]['train/kl'] > 1e-4  # the policy has moved from the reference (step 1: lr 0)
  for step in (1, 2, 3):
    assert mesh[step]['train/reward'] == one[step]['train/reward'], step
    assert mesh[step]['train/completion_tokens'] == one[step]['train/completion_tokens'], step
    np.testing.assert_allclose(mesh[step]['train/loss'], one[step]['train/loss'], atol=1e-5)
    np.testing.assert_allclose(mesh[step]['train/kl'], one[step]['train/kl'], atol=1e-5)
    for name in CORRECTION_SCALARS:  # (the extremes: reduced over the replicas)
      np.testing.assert_allclose(mesh[step][name], one[step][name], atol=1e-5, err_msg=name)
    np.testing.assert_allclose(mesh[step]['train/grad_norm'], one[step]['train/grad_norm'],
                               rtol=1e-4)


def test_stop_strings_read_escapes_and_keep_other_characters():
  assert config_lib.unescape('\\n') == '\n' and config_lib.unescape('é→\\t') == 'é→\t'
  with pytest.raises(ValueError):
    config_lib.unescape('a\\')
  assert config_lib.stop_strings('\\n') == ('\n',) and config_lib.stop_strings('') == ()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_two_processes_roll_out_and_update_as_one_and_a_lost_one_stops_the_other(toy, tmp_path):
  """GRPO over two processes (a device each, data=2: each decodes half of the slots): the same
  completions, rewards and losses as one process; then a process lost mid-run stops the other
  with one error line, as in pretraining."""
  steps = ['--config.train.steps=3', '--config.train.eval_every=3']

  def start(workdir, *extra):
    port = _free_port()
    return [subprocess.Popen(_grpo_command(toy, workdir, *steps, *extra, '--num_processes=2',
                                           f'--coordinator_address=127.0.0.1:{port}',
                                           f'--process_id={i}'),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=subprocess_env(), cwd=ROOT) for i in range(2)]

  procs = start(tmp_path / 'two')
  outputs = [p.communicate(timeout=400)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  assert 'over 2 devices' in outputs[0] and 'step 1/' not in outputs[1]  # process 0 logs
  one = subprocess.run(_grpo_command(toy, tmp_path / 'one', *steps), cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert one.returncode == 0, one.stderr[-3000:]
  want, got = _records(tmp_path / 'one'), _records(tmp_path / 'two')
  assert sorted(got) == sorted(want) == [0, 1, 2, 3]
  assert got[0]['eval/reward'] == want[0]['eval/reward']
  for step in (1, 2, 3):
    for name in ('train/reward', 'train/completion_tokens', 'train/accuracy'):
      assert got[step][name] == want[step][name], (step, name)
    for name in ('train/loss', 'train/grad_norm', 'train/logp_mismatch', *CORRECTION_SCALARS):
      np.testing.assert_allclose(got[step][name], want[step][name], rtol=1e-5, atol=1e-7)

  procs = start(tmp_path / 'lost', '--config.train.steps=400', '--heartbeat_timeout=10')
  out = []
  for line in procs[0].stdout:
    out.append(line)
    if line.startswith('step 2/'):
      procs[1].kill()
      break
  out = ''.join(out) + procs[0].communicate(timeout=300)[0]
  procs[1].wait(timeout=60)
  assert procs[0].returncode == 1, out[-3000:]
  errors = [line for line in out.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and errors[0].startswith(
      'error: process 1 of 2 stopped responding (no heartbeat for 10 s)'), out[-3000:]
  assert 'Traceback' not in out and 'Fatal Python error' not in out, out[-3000:]
