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
_PROCESSES = cli.define_process_flags()


def main():
  from jax_pretrain import runtime  # noqa: PLC0415
  runtime.configure()  # before jax starts its backend; train.describe prints the settings
  with _PROCESSES():
    from jax_pretrain import pretrain  # noqa: PLC0415  (after distributed init)
    pretrain.train_and_evaluate(cli.config_value(_CONFIG), _WORKDIR.value)


if __name__ == '__main__':
  cli.run(main)
