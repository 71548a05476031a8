"""A tiny trained run (the test preset, seq_len 64), shared by the harness and server tests."""
import jax

from jax_pretrain import config as config_lib
from jax_pretrain import pretrain

SEQ_LEN = 64
_RUNS = {}


def train_once(tmp_path_factory) -> str:
  """The run's workdir; trained once per test process (~10 s on the CPU)."""
  if 'run' not in _RUNS:
    workdir = str(tmp_path_factory.mktemp('tiny_run'))
    c = config_lib.preset('test')
    c.data.seq_len = SEQ_LEN
    c.train.steps, c.optim.warmup_steps, c.train.eval_every = 60, 6, 60
    pretrain.train_and_evaluate(c, workdir, devices=jax.devices()[:1])
    _RUNS['run'] = workdir
  return _RUNS['run']
