"""The common start of our absl programs (training, sampling, evaluation, HF export/import)."""
from absl import app
from absl import flags
from absl import logging


def start(argv: list[str]) -> None:
  """Refuses stray arguments, and quiets INFO logs (orbax logs every file it touches) unless the
  user asked for a verbosity."""
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
