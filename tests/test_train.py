"""End to end: the test preset trains on the embedded corpus, deterministically."""
import dataclasses
import json
import os
import signal
import threading

import jax
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import pretrain
from jax_pretrain import train as train_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.data import corpus
from jax_pretrain.data.tokenizer import ByteTokenizer
from tests.conftest import build_setup
from tests.conftest import train_steps


def unigram_entropy_nats(tokens: np.ndarray) -> float:
  counts = np.bincount(tokens)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def run(workdir, steps=150, **train_overrides):
  c = config_lib.preset('test')
  c.train.steps = steps
  c.train.eval_every = steps
  for k, v in train_overrides.items():
    c.train[k] = v
  return pretrain.train_and_evaluate(c, str(workdir), devices=jax.devices()[:1])


def losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [r['train/loss'] for r in map(json.loads, f) if 'train/loss' in r]


def test_trains_below_unigram_entropy_and_writes_workdir(tmp_path):
  final = run(tmp_path)
  tokens = corpus.concatenate(corpus.embedded_documents(), ByteTokenizer())
  entropy = unigram_entropy_nats(tokens)  # ≈ 3.2 nats for English bytes
  assert final['eval/loss'] < entropy - 0.5, (final['eval/loss'], entropy)
  for name in ('config.json', 'metrics.jsonl', 'checkpoints'):
    assert os.path.exists(tmp_path / name), name
  assert os.listdir(tmp_path / 'tensorboard')
  with open(tmp_path / 'config.json', encoding='utf-8') as f:
    assert json.load(f)['train']['steps'] == 150
  record = json.loads(open(tmp_path / 'metrics.jsonl', encoding='utf-8').readline())
  for key in ('train/loss', 'train/ppl', 'train/lr', 'train/grad_norm', 'train/tokens',
              'perf/tokens_per_sec', 'perf/step_time'):
    assert key in record


def test_same_seed_gives_identical_losses(tmp_path):
  a = losses(run(tmp_path / 'a', steps=20) and tmp_path / 'a')
  b = losses(run(tmp_path / 'b', steps=20) and tmp_path / 'b')
  assert len(a) == 4 and a == b


def test_the_logged_rate_after_skipped_steps_is_the_one_the_optimizer_applied(tmp_path):
  """train/lr is schedule(the optimizer's count of applied updates), not schedule(step): after the
  non-finite guard skips steps, the next update applies the rate the skipped ones would have."""
  c = config_lib.preset('test')
  c.train.steps, c.train.log_every, c.train.eval_every = 6, 1, 6
  c.optim.learning_rate, c.optim.min_learning_rate = 1e30, 1e29  # step 2 blows the params up
  c.optim.warmup_steps = 1
  c.train.on_nonfinite, c.train.max_consecutive_skips = 'skip', 100
  pretrain.train_and_evaluate(c, str(tmp_path), devices=jax.devices()[:1])
  with open(tmp_path / 'metrics.jsonl', encoding='utf-8') as f:
    rows = {r['step']: r for r in map(json.loads, f) if 'train/lr' in r}
  schedule = build_setup(c, devices=jax.devices()[:1]).schedule
  skips = {0: 0, **{step: int(r['train/nonfinite_skips']) for step, r in rows.items()}}
  assert skips[6] >= 3, skips  # every step from the third on is skipped
  for step, r in rows.items():
    applied = step - 1 - skips[step - 1]  # updates applied before this step
    assert r['train/lr'] == pytest.approx(float(schedule(applied)), rel=1e-6), step
  assert rows[6]['train/lr'] != pytest.approx(float(schedule(5)), rel=1e-3)  # schedule(step)


def test_weights_cast_once_a_step_train_exactly_as_casting_them_at_use(monkeypatch):
  """model.with_compute_weights (the layers' matmul weights in bfloat16 once a step, not in every
  micro-batch): the same losses, gradient norms and params, bit for bit, as the model's own casts
  at use, over steps of 4 micro-batches."""
  from jax_pretrain import model as model_lib  # noqa: PLC0415
  c = config_lib.preset('test')
  c.model.dtype = 'bfloat16'
  c.train.batch_size, c.train.micro_batch_size = 16, 4
  s = build_setup(c, devices=jax.devices()[:1])
  cast = jax.eval_shape(lambda p: model_lib.with_compute_weights(s.config.model, p),
                        s.abstract_state.params)
  dtypes = {jax.tree_util.keystr(path): x.dtype
            for path, x in jax.tree_util.tree_leaves_with_path(cast)}
  assert dtypes["['layers']['attn']['wq']"] == dtypes["['layers']['mlp']['w_down']"] == 'bfloat16'
  assert dtypes["['layers']['attn_norm']['scale']"] == dtypes["['embedding']"] == 'float32'
  batches = [np.random.default_rng(i).integers(0, 256, (16, 33)).astype(np.int32)
             for i in range(3)]

  def run():
    metrics, state = train_steps(s, batches)
    return metrics, jax.tree.leaves(state.params)

  ours = run()
  cast_once = model_lib.with_compute_weights  # (the same weights, fused the same, uncast)
  monkeypatch.setattr(model_lib, 'with_compute_weights', lambda c, *args: cast_once(
      dataclasses.replace(c, dtype='float32'), *args))
  theirs = run()
  assert ours[0] == theirs[0]
  for a, b in zip(ours[1], theirs[1]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class Watched(pretrain.Pretraining):
  """Pretraining that notes the closing of its data and fails its second step."""

  def __init__(self):
    self.closed = []

  def open_data(self, resolved, sources, step):
    data = super().open_data(resolved, sources, step)
    close = data.train.close

    def noted_close():
      self.closed.append('data')
      close()
    data.train.close = noted_close
    return data

  def make_step(self, s, data, update):
    def step(state, batch):
      if int(state.step) == 1:
        raise RuntimeError('injected at step 2')
      return update(state, batch)
    return step


@pytest.mark.parametrize('fail_at', ['compiling', 'step 2, profiling'])
def test_a_run_that_fails_closes_what_it_opened(tmp_path, monkeypatch, fail_at):
  """A failure while compiling (the checkpointer's digests compiling in their thread, the data
  open) or in a step being profiled (the prefetch and step-clock threads running, a trace
  started): the error comes out, and the data is closed, no thread the run started is left, the
  trace is stopped, the signal handlers are Python's again and the workdir's lock is free."""
  c = config_lib.preset('test')
  c.train.steps, c.train.log_every, c.train.profile_steps = 6, 1, '2:3'
  if fail_at == 'compiling':
    def failing_compile(*args):
      raise RuntimeError('injected while compiling')
    monkeypatch.setattr(train_lib, 'compile_step', failing_compile)
  program = Watched()
  threads, handlers = set(threading.enumerate()), signal.getsignal(signal.SIGTERM)
  with pytest.raises(RuntimeError, match='injected'):
    train_lib.train(c, str(tmp_path), program, devices=jax.devices()[:1])
  assert program.closed == ['data']
  left = [t.name for t in threading.enumerate() if t not in threads and t.is_alive()]
  assert not left, left
  assert signal.getsignal(signal.SIGTERM) is handlers
  workdir_lib.claim(str(tmp_path)).close()  # (raises WorkdirError while the lock is held)
  jax.profiler.start_trace(str(tmp_path / 'again'))  # (raises while a trace runs)
  jax.profiler.stop_trace()
  if fail_at != 'compiling':
    assert os.path.exists(tmp_path / 'profile' / 'profile.json')
