"""Command line: python -m jax_pretrain.main --config=configs/xlarge.py --workdir=runs/xl

Any config field can be overridden: --config.train.steps=100 --config.model.attention=cudnn.
Several processes (hosts): jax.distributed is initialized from SLURM or Open MPI variables when
present, or from --coordinator_address/--num_processes/--process_id; a process lost for
--heartbeat_timeout seconds stops the others with one error line (jax_pretrain/multihost.py).
"""
from absl import flags

from jax_pretrain import cli

_CONFIG = cli.define_config(
    'default.py',
    'Config file (configs/*.py); fields are overridden with --config.group.field=value.')
_WORKDIR = flags.DEFINE_string('workdir', 'runs/default',
                               'Directory for config, logs, TensorBoard and checkpoints.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None,
                                   'host:port of process 0, for a multi-process run.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in a multi-process run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, 0 .. num_processes - 1.')
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    'heartbeat_timeout', 60, 'Seconds without a heartbeat after which a process of a multi-process '
    'run counts as lost: the others then stop with one error line naming it and the last complete '
    'checkpoint (see jax_pretrain/multihost.py).')


def main():
  from jax_pretrain import runtime  # noqa: PLC0415
  runtime.configure()  # before jax starts its backend; train.describe prints the settings
  from jax_pretrain import multihost  # noqa: PLC0415  (after configure)
  multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                       _HEARTBEAT_TIMEOUT.value)
  from jax_pretrain import pretrain  # noqa: PLC0415  (after distributed init)
  with multihost.peer_failures():
    pretrain.train_and_evaluate(cli.config_value(_CONFIG), _WORKDIR.value)


if __name__ == '__main__':
  cli.run(main)
