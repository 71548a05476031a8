"""Test set-up: 8 simulated CPU devices (meshes are tested without GPUs), quiet TensorFlow."""
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')  # (TF computes nothing here: no banner)
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The suite compiles the same small train steps many times (in-process and in subprocesses):
# a persistent compilation cache shared by all of them saves most of that time.
CACHE_DIR = os.path.join(tempfile.gettempdir(), 'jax_pretrain_test_compile_cache')
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', CACHE_DIR)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

# torch's CUDA build (requirements-dev.txt: the transformers agreement tests) imports triton, whose
# native library crashes the process (SIGSEGV) if TensorFlow (clu's TensorBoard writer, tfds) was
# loaded before it; loaded first, both work. (A test worker runs metric tests before the HF ones.)
try:
  import triton  # noqa: F401
except ImportError:
  pass

import jax  # noqa: E402  (after triton: see above)
import pytest  # noqa: E402

jax.config.update('jax_num_cpu_devices', 8)


def subprocess_env() -> dict[str, str]:
  """Environment for a trainer run in a subprocess: CPU, one device per process, quiet."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', TF_CPP_MIN_LOG_LEVEL='2', TF_ENABLE_ONEDNN_OPTS='0')
  env.pop('XLA_FLAGS', None)
  return env


def run_cli(*args) -> str:
  """Runs `python ARGS` from the repository root in a subprocess; returns its stdout."""
  out = subprocess.run([sys.executable, *args], cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def build_data(config, process_index: int = 0, process_count: int = 1):
  """data.open_batches as the trainer calls it: sources opened once, the config resolved (one
  device)."""
  from jax_pretrain import config as config_lib  # noqa: PLC0415
  from jax_pretrain import data as data_lib  # noqa: PLC0415
  sources = data_lib.open_sources(config)
  resolved, _ = config_lib.resolve(config, num_devices=1, backend='cpu',
                                   tokenizer_vocab_size=sources.tokenizer.vocab_size)
  return data_lib.open_batches(resolved, sources, process_index, process_count)


def build_setup(config, devices=None):
  """state.build as the trainer calls it: the config resolved once for these devices (default:
  all of them), then built."""
  from jax_pretrain import config as config_lib  # noqa: PLC0415
  from jax_pretrain import state as state_lib  # noqa: PLC0415
  devices = jax.devices() if devices is None else devices
  resolved, run = config_lib.resolve(config, len(devices), device=devices[0])
  return state_lib.build(resolved, run, devices)


def train_steps(s, batches):
  """The jitted train step of a Setup run from its initial state over `batches` (tokens [B, T+1]):
  ([(loss, grad_norm)] a step, the final state)."""
  from jax_pretrain import state as state_lib  # noqa: PLC0415
  state, step = state_lib.init_state(s), state_lib.jit_train_step(s, pad_id=258)
  metrics = []
  for tokens in batches:
    state, m = step(state, {'tokens': tokens})
    metrics.append((float(m['loss']), float(m['grad_norm'])))
  return metrics, state


def tiny_model():
  """The test preset's model config (init_std 0.2: logits that spread, for decoding tests) and
  its params, initialized on one device: (config, params)."""
  import dataclasses  # noqa: PLC0415

  from flax.linen import meta  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from jax_pretrain import config as config_lib  # noqa: PLC0415
  from jax_pretrain import model as model_lib  # noqa: PLC0415
  config, _ = config_lib.resolve(config_lib.preset('test'), num_devices=1, backend='cpu')
  cfg = dataclasses.replace(config.model, init_std=0.2)
  params = jax.jit(model_lib.Transformer(cfg).init)(jax.random.key(0),
                                                    jnp.zeros((1, 8), jnp.int32))['params']
  return cfg, meta.unbox(params)


# A trainer run in a subprocess, as users run it: the test preset, a loss logged every step.
STEPS = 40


def command(workdir, *overrides):
  return [sys.executable, '-m', 'jax_pretrain.main', f'--config={ROOT}/configs/test.py',
          f'--workdir={workdir}', f'--config.train.steps={STEPS}', '--config.train.log_every=1',
          '--config.train.eval_every=1000', *overrides]


def logged_losses(workdir) -> dict[int, float]:
  """step -> train loss, from every run that wrote to this workdir (each step at most once)."""
  losses = {}
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    for record in map(json.loads, f):
      if 'train/loss' in record:
        assert record['step'] not in losses, f'step {record["step"]} logged twice'
        losses[record['step']] = record['train/loss']
  return losses


def run_and_signal(workdir, sig, at_step, *overrides, times: int = 1) -> tuple[str, int]:
  """Runs training and sends sig `times` times once the log shows at_step; returns the output
  (stdout and stderr) and the exit status."""
  proc = subprocess.Popen(command(workdir, *overrides), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=subprocess_env(), cwd=ROOT)
  out = []
  for line in proc.stdout:
    out.append(line)
    if line.startswith(f'step {at_step}/'):
      for _ in range(times):
        proc.send_signal(sig)
  proc.wait(timeout=300)
  return ''.join(out), proc.returncode


@pytest.fixture(scope='session')
def uninterrupted(tmp_path_factory):
  """step -> loss of an uninterrupted subprocess run of `command`."""
  workdir = tmp_path_factory.mktemp('uninterrupted')
  subprocess.run(command(workdir), check=True, env=subprocess_env(), cwd=ROOT,
                 capture_output=True)
  losses = logged_losses(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  return losses
