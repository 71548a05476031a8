"""Command line: python -m jax_pretrain.main --config=configs/xlarge.py --workdir=runs/xl

Any config field can be overridden: --config.train.steps=100 --config.model.attention=cudnn.
Several processes (hosts): jax.distributed is initialized from SLURM or Open MPI variables when
present, or from --coordinator_address/--num_processes/--process_id.
"""
import os

from absl import flags
from absl import logging

from jax_pretrain import cli

_CONFIG = cli.define_config(
    'default.py', 'Config file (configs/*.py); fields are overridden with --config.group.field=value.')
_WORKDIR = flags.DEFINE_string('workdir', 'runs/default',
                               'Directory for config, logs, TensorBoard and checkpoints.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None,
                                   'host:port of process 0, for a multi-process run.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in a multi-process run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, 0 .. num_processes - 1.')

# Variables that mean a cluster launcher started several processes of this program.
_LAUNCHER_VARIABLES = ('SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE')


def initialize_distributed() -> None:
  """jax.distributed.initialize when this is one of several processes; nothing otherwise."""
  import jax  # pylint: disable=g-import-not-at-top
  explicit = _COORDINATOR.value is not None or (_NUM_PROCESSES.value or 1) > 1
  launched = any(int(os.environ.get(v, '1')) > 1 for v in _LAUNCHER_VARIABLES)
  if not (explicit or launched):
    return
  # CPU-only multi-process runs (tests, debugging) need a collectives backend; GPUs use NCCL.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if explicit:
    jax.distributed.initialize(_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  else:
    jax.distributed.initialize()  # reads the SLURM / Open MPI environment
  logging.warning('process %d of %d, %d local devices', jax.process_index(),
                  jax.process_count(), jax.local_device_count())


def main():
  from jax_pretrain import runtime  # pylint: disable=g-import-not-at-top
  runtime.configure()  # before jax starts its backend; train.describe prints the settings
  initialize_distributed()
  from jax_pretrain import pretrain  # pylint: disable=g-import-not-at-top  (after distributed init)
  pretrain.train_and_evaluate(cli.config_value(_CONFIG), _WORKDIR.value)


if __name__ == '__main__':
  cli.run(main)
