"""The common start and end of our programs (training, sampling, evaluation, scripts).

`run(main)` is absl's app.run with: stray arguments refused, INFO logs quiet unless asked for, and
every UserError printed as one `error: ...` line with exit status 1 (no traceback). Programs that
parse their own arguments (argparse) wrap their body in `with user_errors():`.
"""
import contextlib
import os
import sys

from absl import app
from absl import flags
from absl import logging

from jax_pretrain.errors import UserError

# The checkout's presets (configs/*.py), found by path: `--config=configs/xlarge.py`.
PRESETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow (under clu, tfds) is noisy
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')  # (TF computes nothing here; silences its banner)


@contextlib.contextmanager
def user_errors():
  """A UserError inside becomes `error: MESSAGE` on stderr and exit status 1."""
  try:
    yield
  except UserError as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(1)


def _start(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it touches at INFO


def run(main) -> None:
  """app.run(main) with the start and the error handling above; main takes no arguments."""
  def wrapped(argv):
    _start(argv)
    with user_errors():
      main()
  app.run(wrapped)


def define_run_flags(workdir_help: str = 'Workdir of a training run (or of scripts/import_hf.py).'):
  """--workdir and --step: which run, and which of its checkpoints, a program reads."""
  workdir = flags.DEFINE_string('workdir', None, workdir_help, required=True)
  step = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
  return workdir, step
