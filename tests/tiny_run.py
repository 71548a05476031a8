"""A tiny trained run (the test preset, seq_len 64), shared by the harness and server tests; and
one trained with model.fp8 (its checkpoint holds the amax histories), for FP8 inference's."""
import jax

from jax_pretrain import config as config_lib
from jax_pretrain import pretrain

SEQ_LEN = 64
_RUNS = {}


def train_once(tmp_path_factory, fp8: bool = False) -> str:
  """The run's workdir; trained once per test process (~10 s on the CPU)."""
  key = 'fp8' if fp8 else 'run'
  if key not in _RUNS:
    workdir = str(tmp_path_factory.mktemp('tiny_' + key))
    c = config_lib.preset('test')
    c.data.seq_len = SEQ_LEN
    c.train.steps, c.optim.warmup_steps, c.train.eval_every = 60, 6, 60
    c.model.fp8 = fp8
    pretrain.train_and_evaluate(c, workdir, devices=jax.devices()[:1])
    _RUNS[key] = workdir
  return _RUNS[key]
