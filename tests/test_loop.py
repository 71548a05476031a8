"""The loop's rules with a counting step (no model): the order of the hooks in a step, their
cadences, each step's metrics recorded and read once, a stop that finishes the step and saves, the
checks before evaluating and saving; train.profile_steps' range; and every logged speed that of
its own interval (tests/test_profile_summary.py: the trace itself)."""
import time

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import hooks as hooks_lib
from jax_pretrain import loop as loop_lib


class Logger:
  """The loop's metrics protocol, recording what it is asked, in order."""

  def __init__(self, events):
    self.events, self.kept = events, None

  def record(self, step, metrics):
    self.events.append(('record', step))
    self.kept = (step, metrics)

  def flush(self):
    if self.kept is None:
      return None
    step, m = self.kept
    self.kept = None
    self.events.append(('flush', step))
    return {'step': step, **m}

  def pause(self):
    pass


class Stop:
  """signals.StopSignal's interface: a stop requested at a given step."""
  name = 'SIGTERM'

  def __init__(self, at):
    self.at, self.step = at, None

  def requested(self, step, previous):
    return step >= self.at


class Checkpointer:
  """checkpoint.Checkpointer's interface, recording saves."""

  def __init__(self, events):
    self.events = events

  def latest_step(self):
    return None

  def save(self, step, state, config_json, ranking):
    self.events.append(('save', step, ranking))

  def check(self):
    pass

  def wait(self):
    self.events.append(('wait',))


def make_loop(events, steps=6, stop=None, bad_step=None, save_every=4):
  def step_fn(state, batch):
    return state + batch, {'loss': float(state), 'bad': state + batch == bad_step}

  def check(m):
    events.append(('check', m['step']))
    if m['bad']:
      raise hooks_lib.NonFiniteError(f'step {m["step"]}')

  lp = loop_lib.Loop(step_fn, steps, log_every=2, metrics=Logger(events), stop=stop,
                     checks=[check])
  ckpt = hooks_lib.Checkpointing(Checkpointer(events), {}, every=save_every)

  def hook(name, value=None):
    def fn(info):
      events.append((name, info.step))
      return value
    return fn
  lp.add_hook(hook('after_save'), every=3, phase=loop_lib.AFTER_SAVE)
  for h in ckpt.hooks():
    lp.add(h)
  lp.add_hook(hook('eval', {'eval/loss': 1.5}), every=3, phase=loop_lib.EVAL)
  lp.add_hook(hook('end'), phase=loop_lib.END)
  return lp


def due(events):
  """The hooks' and checks' events, without the metrics' own (record, flush)."""
  return [e for e in events if e[0] not in ('record', 'flush')]


def test_hooks_run_at_their_cadence_in_the_loops_order():
  events = []
  assert make_loop(events).run(0, iter([1] * 10), 0) == 6
  assert due(events) == [
      ('check', 2),  # logged (log_every=2), read one step late
      ('check', 3), ('eval', 3), ('after_save', 3),  # checked before eval; eval before after_save
      ('check', 4), ('save', 4, None),
      ('check', 6), ('eval', 6), ('save', 6, {'eval/loss': 1.5}), ('after_save', 6),  # the end
      ('wait',), ('end', 6)]  # the final save complete before the end hooks


def test_a_stop_finishes_the_step_saves_it_and_ends_the_run():
  events = []
  lp = make_loop(events, stop=Stop(at=2))
  assert lp.run(0, iter([1] * 10), 0) is None and lp.step == 2
  assert due(events) == [('check', 2), ('save', 2, None), ('wait',)]


@pytest.mark.parametrize('stop_at', [None, 4, 5])
def test_each_step_is_recorded_once_and_read_once(stop_at):
  """Logged steps (log_every=2), the last, and steps where an eval or save is due or a stop
  arrived: each recorded once, then read once (one step late, or at once before the hooks)."""
  events = []
  make_loop(events, stop=Stop(stop_at) if stop_at else None).run(0, iter([1] * 10), 0)
  records = [e[1] for e in events if e[0] == 'record']
  expected = {None: [2, 3, 4, 6], 4: [2, 3, 4], 5: [2, 3, 4, 5]}[stop_at]
  assert records == expected
  assert [e[1] for e in events if e[0] == 'flush'] == expected


def test_a_hook_runs_at_the_last_step_only_where_asked():
  events = []
  lp = loop_lib.Loop(lambda state, batch: (state + batch, {}), 5)
  lp.add_hook(lambda info: events.append(('cadence', info.step)), every=2)
  lp.add_hook(lambda info: events.append(('and_last', info.step)), every=2, at_last=True)
  lp.add_hook(lambda info: events.append(('last', info.step)), at_last=True)
  lp.add_hook(lambda info: events.append(('never', info.step)))
  assert lp.run(0, iter([1] * 5), 0) == 5
  assert events == [('cadence', 2), ('and_last', 2), ('cadence', 4), ('and_last', 4),
                    ('and_last', 5), ('last', 5)]


def test_a_bad_step_is_caught_before_it_is_evaluated_or_saved():
  events = []
  with pytest.raises(hooks_lib.NonFiniteError, match='step 3'):
    make_loop(events, bad_step=3).run(0, iter([1] * 10), 0)
  assert not [e for e in events if e[0] in ('eval', 'save', 'after_save')]


def test_a_resumed_loop_starts_at_its_step():
  events = []
  assert make_loop(events).run(4, iter([1] * 10), 4) == 6
  assert ('save', 4, None) not in events and ('save', 6, {'eval/loss': 1.5}) in events


def test_profile_steps_must_be_a_range():
  t = ml_collections.ConfigDict({'profile_steps': '3:2'})
  with pytest.raises(config_lib.ConfigError, match='train.profile_steps'):
    config_lib.profile_steps(t)
  t.profile_steps = '2:3'
  assert config_lib.profile_steps(t) == (2, 3)


class Writer:
  """metrics.MetricWriter's interface: the scalars written, by step."""

  def __init__(self):
    self.rows = {}

  def write(self, step, scalars):
    self.rows.setdefault(step, {}).update(scalars)


@pytest.mark.parametrize('stop_at', [None, 12])
def test_every_logged_speed_is_that_of_its_own_interval(stop_at):
  """tokens/s on every line = tokens / the wall time of its interval (hooks excluded), including
  the lines at eval, save, stop and last steps. Each step takes `delay` in a host callback, which
  the CPU runs as the step is dispatched: the host reaches each read of the metrics a whole step
  after that step ended (as it does, for most of a step, on a GPU), or at once where a hook is due
  (timed at the reads instead, the lines were off by up to a step: BENCHMARKS.md)."""
  from jax_pretrain import step_logger  # noqa: PLC0415
  from tests.conftest import build_setup  # noqa: PLC0415
  delay, hook_s, ends, hooks_end = 0.2, 0.25, {}, {}

  def device_work(step):
    time.sleep(delay)
    ends[int(step)] = time.perf_counter()
    return step

  @jax.jit
  def step_fn(step, batch):
    step = jax.pure_callback(device_work, jax.ShapeDtypeStruct((), jnp.int32), step + batch)
    return step, {'loss': step * 0.0, 'lr': 0.0, 'grad_norm': 0.0, 'nonfinite_count': step * 0}

  def slow_hook(info):
    time.sleep(hook_s)
    hooks_end[info.step] = time.perf_counter()

  c = config_lib.preset('test')
  c.train.steps = 14
  s = build_setup(c, devices=jax.devices()[:1])
  writer = Writer()
  step_fn(jnp.int32(0), jnp.int32(0))  # compiled before the clock starts
  ends.clear()
  started = time.perf_counter()
  logger = step_logger.StepLogger(s, writer, 0)
  lp = loop_lib.Loop(step_fn, 14, log_every=4, metrics=logger,
                     stop=Stop(stop_at) if stop_at else None)
  lp.add_hook(slow_hook, every=6, phase=loop_lib.EVAL)
  lp.add_hook(slow_hook, every=10, phase=loop_lib.SAVE, at_stop=True)
  lp.run(jnp.int32(0), iter([jnp.int32(1)] * 20), 0)
  lines = sorted(writer.rows)
  assert lines == ([4, 6, 8, 10, 12] if stop_at else [4, 6, 8, 10, 12, 14]), lines
  previous, start = 0, started
  for step in lines:
    wall = ends[step] - start
    expected = s.run.tokens_per_step * (step - previous) / wall
    assert writer.rows[step]['perf/tokens_per_sec'] == pytest.approx(expected, rel=0.05), step
    previous, start = step, hooks_end.get(step, ends[step])
