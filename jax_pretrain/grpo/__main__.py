"""python -m jax_pretrain.grpo --workdir=OUT --init=RUN --task=TRAIN.jsonl \
    [--eval_task=HELDOUT.jsonl] [--config=configs/grpo.py] [--config.grpo.num_samples=16 ...]

GRPO fine-tuning of a trained run (jax_pretrain/grpo/program.py); several processes as the
trainer takes them (--coordinator_address, --num_processes, --process_id).
"""
import sys


def main(workdir: str, config_holder, flag_values, processes) -> None:
  from jax_pretrain import cli  # noqa: PLC0415
  from jax_pretrain import runtime  # noqa: PLC0415
  runtime.configure()
  with processes():
    config = cli.config_value(config_holder)
    for field in ('task', 'eval_task'):
      if flag_values[field]:
        config.grpo[field] = flag_values[field]
    init = flag_values['init']
    cli.check_init(init, config.checkpoint.restore_from)
    from jax_pretrain import train as train_lib  # noqa: PLC0415  (after jax.distributed starts)
    from jax_pretrain.grpo import program  # noqa: PLC0415
    train_lib.train(config, workdir, program.GRPO())


if __name__ == '__main__':
  from absl import flags  # noqa: I001
  from jax_pretrain import cli
  sys.argv = cli.init_into_config(sys.argv, 'grpo.py')
  _CONFIG = cli.define_config('grpo.py', 'Config file (configs/grpo.py); its model and seq_len '
                             'are the --init run\'s. Fields: --config.grpo.FIELD=VALUE, ...')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'Directory of this GRPO run (config, logs, '
                                 'TensorBoard, checkpoints).', required=True)
  _INIT = flags.DEFINE_string('init', '', 'The trained run to fine-tune (its workdir).')
  _TASK = flags.DEFINE_string('task', '', 'Training task: JSONL of {"prompt", "answer"} '
                              '(sets grpo.task).')
  _EVAL_TASK = flags.DEFINE_string('eval_task', '', 'Held-out task for eval/accuracy (sets '
                                   'grpo.eval_task).')
  _PROCESSES = cli.define_process_flags()
  cli.run(lambda: main(_WORKDIR.value, _CONFIG, {'init': _INIT.value, 'task': _TASK.value,
                                                 'eval_task': _EVAL_TASK.value}, _PROCESSES))
