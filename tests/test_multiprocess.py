"""Two processes on localhost (jax.distributed + gloo) train like one process with the same global
batch, and their checkpoint restores in a one-process run; a stop signal to one stops both; a lost
process stops the other with one line, and both resume exactly."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from tests.conftest import ROOT
from tests.conftest import subprocess_env

STEPS = 8


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def command(workdir, *extra):
  return [sys.executable, '-m', 'jax_pretrain.main', f'--config={ROOT}/configs/test.py',
          f'--workdir={workdir}', f'--config.train.steps={STEPS}', '--config.train.log_every=1',
          '--config.train.eval_every=4', '--config.checkpoint.every_steps=4', *extra]



def losses(workdir, key='train/loss', name='metrics.jsonl'):
  with open(os.path.join(workdir, name), encoding='utf-8') as f:
    return {r['step']: r[key] for r in map(json.loads, f) if key in r}


AGREEMENTS = """
import sys, threading
import jax
import numpy as np
from jax_pretrain import multihost
with multihost.processes('127.0.0.1:' + sys.argv[1], 2, int(sys.argv[2]), heartbeat_timeout=60):
  i = jax.process_index()
  mesh = jax.make_mesh((2,), ('x',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x'))
  x = jax.make_array_from_callback((4, 3), sharding,
                                   lambda idx: np.arange(12.).reshape(4, 3)[idx])
  full = multihost.gather({'x': x})['x']
  multihost.barrier('checked')
  print(multihost.any_process(i == 1), multihost.all_processes(i == 1),
        multihost.from_main(i == 0), multihost.minimum(5.0 - 2 * i), multihost.is_main(),
        full.tolist() == np.arange(12.).reshape(4, 3).tolist())
  heartbeat = [t.name for t in threading.enumerate() if 'heartbeat' in t.name]
  multihost.barrier('done')  # (neither leaves before the other read its heartbeat)
print(heartbeat, [t.name for t in threading.enumerate() if 'heartbeat' in t.name])
"""


def test_agreements_between_two_processes():
  """Each of multihost's agreements, with process 0 and 1 giving different values; the heartbeat
  thread runs inside multihost.processes() and is joined when it is left."""
  port = free_port()
  procs = [subprocess.Popen([sys.executable, '-c', AGREEMENTS, str(port), str(i)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(), cwd=ROOT) for i in range(2)]
  outputs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outputs):
    assert p.returncode == 0, err
  # any: True, all: False, process 0's flag: True, the smaller number: 3.0, a full array on both.
  assert outputs[0][0].splitlines()[-2].split() == ['True', 'False', 'True', '3.0', 'True', 'True']
  assert outputs[1][0].splitlines()[-2].split() == ['True', 'False', 'True', '3.0', 'False', 'True']
  for out, _ in outputs:
    assert out.splitlines()[-1] == "['multihost heartbeat'] []"


ENGINE = """
import dataclasses, json, sys
import jax, jax.numpy as jnp
from flax.linen import meta
from jax_pretrain import config as config_lib, engine, model as model_lib, multihost
from jax_pretrain.data.tokenizer import ByteTokenizer
port, count, index = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with multihost.processes('127.0.0.1:' + port, count, index, heartbeat_timeout=60):
  config, _ = config_lib.resolve(config_lib.preset('test'), num_devices=1, backend='cpu')
  cfg = dataclasses.replace(config.model, init_std=0.2)
  mesh = jax.make_mesh((jax.device_count(),), ('slots',))
  init = jax.jit(model_lib.Transformer(cfg).init,
                 out_shardings=jax.sharding.NamedSharding(mesh, jax.P()))
  params = meta.unbox(init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params'])
  eng = engine.Engine(cfg, params, ByteTokenizer(), slots=2, context=16, chunk=8, mesh=mesh)
  lines = []
  eng.warmup(background=True, report=lines.append)
  covering, rest = eng.scheduler.programs()
  warmed = set(covering) | set(rest)
  ready_at_return = set(eng.shapes) >= warmed and eng.runner.programs.pending() == 0
  seqs = [engine.Sequence(prompt=list(range(1, 2 + i)), max_new_tokens=2 + i,
                          temperature=1.0, seed=3, stream=i) for i in range(6)]
  eng.generate(seqs)
  eng.close()  # (the one-process engine's background compiler, joined before the exit)
  print(json.dumps({'ready_at_return': ready_at_return, 'report': lines[0],
                    'tokens': [s.tokens for s in seqs], 'programs': len(eng.shapes)}))
"""


def test_the_engine_warms_up_alike_on_two_processes_and_decodes_as_one():
  """A mesh over two processes: the warmup compiles every program before it returns (no
  background compiler whose progress differs between them), and both decode the same tokens as
  one process does."""
  port = free_port()
  run = lambda count, i: subprocess.Popen(
      [sys.executable, '-c', ENGINE, str(port), str(count), str(i)], stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=ROOT)
  procs = [run(2, i) for i in range(2)]
  port = free_port()
  one = run(1, 0)
  outputs = [p.communicate(timeout=300) for p in [*procs, one]]
  for p, (_, err) in zip([*procs, one], outputs):
    assert p.returncode == 0, err[-3000:]
  two_0, two_1, alone = (json.loads(out.splitlines()[-1]) for out, _ in outputs)
  for two in (two_0, two_1):
    assert two['ready_at_return'], two
    assert 'spans 2 processes' in two['report']
  assert two_0['tokens'] == two_1['tokens'] == alone['tokens']
  assert [len(t) for t in alone["tokens"]] == [2 + i for i in range(6)]
  assert 'spans' not in alone['report']


def test_two_processes_match_one_process_and_checkpoint_restores_in_one(tmp_path):
  port = free_port()
  two = tmp_path / 'two'
  procs = [subprocess.Popen(command(two, f'--coordinator_address=127.0.0.1:{port}',
                                    '--num_processes=2', f'--process_id={i}'),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=subprocess_env(), cwd=ROOT) for i in range(2)]
  outputs = [p.communicate(timeout=400)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out
  assert 'mesh              data=2 fsdp=1 tensor=1' in outputs[0]
  assert 'step 1/' not in outputs[1]  # only process 0 logs

  one = tmp_path / 'one'
  subprocess.run(command(one), check=True, env=subprocess_env(), cwd=ROOT, capture_output=True)
  two_losses, one_losses = losses(two), losses(one)
  assert sorted(two_losses) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([two_losses[s] for s in sorted(two_losses)],
                             [one_losses[s] for s in sorted(one_losses)], rtol=1e-5)
  np.testing.assert_allclose(losses(two, 'eval/loss')[STEPS], losses(one, 'eval/loss')[STEPS],
                             rtol=1e-5)

  # The two-process checkpoint of step 4 restores in one process, which then computes steps 5-8
  # as the two processes did.
  resumed = tmp_path / 'resumed'
  shutil.copytree(two / 'checkpoints' / '4', resumed / 'checkpoints' / '4')
  out = subprocess.run(command(resumed), env=subprocess_env(), cwd=ROOT, capture_output=True,
                       text=True)
  assert out.returncode == 0, out.stdout + out.stderr
  assert 'resuming from step 4' in out.stdout
  after = losses(resumed)
  assert sorted(after) == [5, 6, 7, 8]
  np.testing.assert_allclose([after[s] for s in range(5, 9)],
                             [two_losses[s] for s in range(5, 9)], rtol=1e-5)


def start_two(workdir, *args):
  port = free_port()
  return [subprocess.Popen(command(workdir, *args, f'--coordinator_address=127.0.0.1:{port}',
                                   '--num_processes=2', f'--process_id={i}'),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=subprocess_env(), cwd=ROOT) for i in range(2)]


def test_a_stop_to_one_process_or_both_is_agreed_within_two_steps_and_resumed(tmp_path):
  """A preemption's SIGTERM to one process only, then (resumed) to both, with train.log_every
  longer than the run: both stop after the step two after the one the (first) signal came in, save
  it together and exit 0; the same command resumes there. (Before, the
  processes agreed only at multiples of log_every: they trained on to the end.)"""
  steps = 200
  args = (f'--config.train.steps={steps}', '--config.train.log_every=1000',
          '--config.train.eval_every=1000', '--config.checkpoint.every_steps=10')

  def run(signalled=(), once_saved=0) -> tuple[str, int]:
    """Process 0's output, and the step saved last."""
    procs = start_two(tmp_path, *args)
    if signalled:
      while not (tmp_path / 'checkpoints' / str(once_saved)).is_dir():  # training past it
        assert procs[0].poll() is None, procs[0].communicate()[0]
        time.sleep(0.02)
      for i in signalled:
        procs[i].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
      assert p.returncode == 0, out
    saved = max(int(p) for p in os.listdir(tmp_path / 'checkpoints') if p.isdigit())
    return outputs[0], saved

  def stopped(out: str, who: str, saved: int) -> None:
    # Process 0 says when each signal it hears of came (its own, and an earlier one's post).
    heard = [(int(k), int(s)) for k, s in re.findall(
        r'received SIGTERM during step (\d+): stopping after step (\d+) \(every process stops '
        r'there\)', out)]
    assert heard, out
    signal_step = min(k for k, _ in heard)
    assert f'received {who}: saved step {saved} to ' in out
    assert signal_step <= saved <= signal_step + 2 < steps, out

  out, first = run(signalled=(1,), once_saved=10)
  stopped(out, 'SIGTERM on process 1', first)
  out, second = run(signalled=(0, 1), once_saved=first // 10 * 10 + 10)
  assert f'resuming from step {first} ' in out
  stopped(out, 'SIGTERM', second)
  # Logged at the saves and the stops; each step once (the first run's lines after its stop: none).
  assert sorted(losses(tmp_path)) == sorted({*range(10, second + 1, 10), first, second})


def test_a_lost_process_stops_the_other_with_one_line_and_both_resume_exactly(tmp_path):
  """A node lost mid-run (process 1 SIGKILLed after a checkpoint): process 0 ends, after the
  heartbeat timeout, with one error line naming the lost process and the last complete checkpoint,
  status 1, no crash dump; the same command on both then resumes from that checkpoint and computes
  the steps after it exactly as the interrupted run did (bitwise)."""
  args = ['--config.train.steps=30', '--config.checkpoint.every_steps=5', '--heartbeat_timeout=10',
          '--num_processes=2']

  def start():
    port = free_port()
    return [subprocess.Popen(command(tmp_path, *args, f'--coordinator_address=127.0.0.1:{port}',
                                     f'--process_id={i}'),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=subprocess_env(), cwd=ROOT) for i in range(2)]

  procs = start()
  out = []
  for line in procs[0].stdout:
    out.append(line)
    if line.startswith('step 12/'):  # checkpoints of steps 5 and 10 started by now
      procs[1].kill()
      break
  out = ''.join(out) + procs[0].communicate(timeout=300)[0]
  procs[1].wait(timeout=60)
  assert procs[0].returncode == 1, out
  errors = [line for line in out.splitlines() if line.startswith('error:')]
  assert len(errors) == 1, out
  assert errors[0].startswith('error: process 1 of 2 stopped responding (no heartbeat for 10 s); '
                              'the last complete checkpoint is step '), out
  assert errors[0].endswith('; restart all processes with the same command to resume from it.')
  for crash in ('Fatal Python error', 'Traceback', 'Check failure', 'client.h'):
    assert crash not in out, out
  step = int(re.search(r'checkpoint is step (\d+) in ', errors[0]).group(1))
  assert step in (5, 10) and (tmp_path / 'checkpoints' / str(step)).is_dir()

  procs = start()
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  for p, output in zip(procs, outputs):
    assert p.returncode == 0, output
  assert f'resuming from step {step} ' in outputs[0]
  resumed = losses(tmp_path)
  assert sorted(resumed) == list(range(1, 31))
  # The interrupted run's steps after the checkpoint (it logged up to step 12 at least).
  interrupted = losses(tmp_path, name='metrics.discarded.jsonl')
  assert min(interrupted) == step + 1 and max(interrupted) >= 12
  assert {s: resumed[s] for s in interrupted} == interrupted
