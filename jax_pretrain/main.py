"""Command line: python -m jax_pretrain.main --config=configs/xlarge.py --workdir=runs/xl

Any config field can be overridden: --config.train.steps=100 --config.model.attention=cudnn.
"""
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # so that config files can `from configs import base`
  sys.path.insert(0, _ROOT)

_CONFIG = config_flags.DEFINE_config_file(
    'config', os.path.join(_ROOT, 'configs', 'default.py'),
    'Config file (configs/*.py); fields are overridden with --config.group.field=value.',
    lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', 'runs/default',
                               'Directory for config, logs, TensorBoard and checkpoints.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  from jax_pretrain import train  # pylint: disable=g-import-not-at-top  (after flags parse)
  train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == '__main__':
  app.run(main)
