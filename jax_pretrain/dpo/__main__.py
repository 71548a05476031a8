"""python -m jax_pretrain.dpo --workdir=OUT --init=RUN --config.data.train=PAIRS.jsonl \
    [--config=configs/dpo.py] [--config.dpo.loss_type=sigmoid --config.dpo.beta=0.1 ...]

DPO fine-tuning of a trained run (jax_pretrain/dpo/program.py); several processes as the trainer
takes them (--coordinator_address, --num_processes, --process_id).
"""
import sys


def main(workdir: str, config_holder, init: str, processes) -> None:
  from jax_pretrain import cli  # noqa: PLC0415
  from jax_pretrain import runtime  # noqa: PLC0415
  runtime.configure()
  with processes():
    config = cli.config_value(config_holder)
    cli.check_init(init, config.checkpoint.restore_from)
    from jax_pretrain import train as train_lib  # noqa: PLC0415  (after jax.distributed starts)
    from jax_pretrain.dpo import program  # noqa: PLC0415
    train_lib.train(config, workdir, program.DPO())


if __name__ == '__main__':
  from absl import flags  # noqa: I001
  from jax_pretrain import cli
  sys.argv = cli.init_into_config(sys.argv, 'dpo.py')
  _CONFIG = cli.define_config('dpo.py', 'Config file (configs/dpo.py); its model and seq_len '
                             'are the --init run\'s. Fields: --config.dpo.FIELD=VALUE, ...')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'Directory of this DPO run (config, logs, '
                                 'TensorBoard, checkpoints).', required=True)
  _INIT = flags.DEFINE_string('init', '', 'The trained run to fine-tune (its workdir); its '
                              'params are the reference model.')
  _PROCESSES = cli.define_process_flags()
  cli.run(lambda: main(_WORKDIR.value, _CONFIG, _INIT.value, _PROCESSES))
