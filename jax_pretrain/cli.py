"""The common start and end of our programs (training, sampling, evaluation, scripts).

`run(main)` is absl's app.run with: stray arguments refused, the output policy installed
(`output_policy`), and every UserError printed as one `error: ...` line with exit status 1 (no
traceback). Programs that parse their own arguments (argparse) call `output_policy()` first and
wrap their body in `with user_errors():`.
"""
import contextlib
import logging as pylogging
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from jax_pretrain import PRESETS_DIR
from jax_pretrain import checkpoint_errors
from jax_pretrain.errors import UserError

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow (under clu, tfds) is noisy
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')  # (TF computes nothing here: no banner)


@contextlib.contextmanager
def user_errors():
  """A UserError inside becomes `error: MESSAGE` on stderr and exit status 1."""
  try:
    yield
  except UserError as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(1)


def output_policy(verbosity: bool = False) -> None:
  """What the process prints, set by every entry point before its work, in this one place
  (library code raises and logs, and changes no hook or level of the process): absl's logs from
  WARNING on unless --verbosity was given (`verbosity`: orbax logs every file it touches at INFO),
  and none of what orbax and tensorstore print after a failure that one `error:` line or warning
  already says (checkpoint_errors: a failed save's traceback, the reads a failed restore
  abandons, which Python reports at exit). Installed once however often it is called."""
  if not verbosity:
    logging.set_verbosity(logging.WARNING)
  if isinstance(sys.unraisablehook, checkpoint_errors.AbandonedReads):
    return
  sys.unraisablehook = checkpoint_errors.AbandonedReads(sys.unraisablehook)
  sys.excepthook = checkpoint_errors.ClosedLoop(sys.excepthook)
  logging.get_absl_logger().addFilter(checkpoint_errors.OrbaxNoise())
  pylogging.getLogger('asyncio').addFilter(checkpoint_errors.AbandonedTasks())


def _start(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  output_policy(verbosity=bool(flags.FLAGS['verbosity'].present))


def run(main) -> None:
  """app.run(main) with the start and the error handling above; main takes no arguments.

  A KeyboardInterrupt that reaches here (a second Ctrl-C: the first asks the trainer to stop
  cleanly) ends the process at once with status 130, after one line, without a traceback.
  """
  def wrapped(argv):
    _start(argv)
    try:
      with user_errors():
        main()
    except KeyboardInterrupt:
      print('error: interrupted (Ctrl-C).', file=sys.stderr, flush=True)
      sys.stdout.flush()
      os._exit(130)
  app.run(wrapped, flags_parser=_parse_flags)


def _parse_flags(argv):
  # A config file's own error (e.g. configs/sft.py:RUN without a run), or an override naming no
  # field (ml_collections raises AttributeError or KeyError for it).
  with user_errors():
    try:
      return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError) as e:
      raise unknown_config_field(e, argv) from None


def unknown_config_field(error: Exception, argv: list[str]) -> UserError:
  """The one error for an override naming no field. ml_collections' error names only the first
  part of its path that does not exist (a group, or a field), so the override blamed is the one
  whose path has that part and that is not a trainer's field: the other overrides given are not
  named. A program's group (grpo) given on another config says which config brings it."""
  text = str(error).strip('\'"').replace('\\n', '\n').replace('\\"', '"').replace("\\'", "'")
  name, _, hint = text.partition('\n')
  name = name.strip('\'"')
  given = [a.split('=')[0] for a in argv[1:] if a.startswith('--config.')]
  from jax_pretrain import config as config_lib  # noqa: PLC0415  (heavy)
  named = [f for f in given if name in f.split('.')[1:]]
  wrong = [f for f in named if f.removeprefix('--config.') not in config_lib.FIELDS] or named
  moved = [config_lib.MOVED[(f.split('.')[1], f.split('.')[2])] for f in wrong
           if f.count('.') == 2 and (f.split('.')[1], f.split('.')[2]) in config_lib.MOVED]
  retired = [config_lib.RETIRED[(f.split('.')[1], f.split('.')[2])] for f in wrong
             if f.count('.') == 2 and (f.split('.')[1], f.split('.')[2]) in config_lib.RETIRED]
  program = config_lib.program_group(name)
  if moved:
    hint = 'it moved to ' + ', '.join(f'{group}.{field}' for group, field in moved)
  elif retired:
    hint = '; '.join(retired)
  elif program is not None and wrong and all(f.split('.')[1] == name for f in wrong):
    hint = (f'the {name} group comes with --config={program.config_file}, the config of '
            f'{program.program}')
  hint = f' ({hint})' if hint else ''
  return config_lib.ConfigError(f'{", ".join(wrong or given) or "--config"}: no such config '
                                f'field{hint}; all fields and their defaults are in '
                                'jax_pretrain/config.py.')


def define_config(default_preset: str, help_text: str, lock: bool = True):
  """--config (a config file, default configs/DEFAULT_PRESET) and its --config.GROUP.FIELD
  overrides. An override naming no field stops here with one error line (ml_collections reads
  the overrides while the flag is defined)."""
  with user_errors():
    try:
      return config_flags.DEFINE_config_file(
          'config', os.path.join(PRESETS_DIR, default_preset), help_text, lock_config=lock)
    except (AttributeError, KeyError) as e:
      raise unknown_config_field(e, sys.argv) from None


def config_value(holder):
  """The config a --config flag loaded; a file that failed to load is a UserError."""
  value = holder.value
  try:
    value.keys()  # ml_collections defers the error of a missing or broken file to a first use
    return value
  except OSError as e:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    raise UserError(f'--config: cannot load the config file ({"; ".join(lines[-2:])}). Presets '
                    f'are in {PRESETS_DIR}.') from None


def define_run_flags(workdir_help: str = 'Workdir of a training run (or of scripts/import_hf.py).'):
  """--workdir and --step: which run, and which of its checkpoints, a program reads."""
  workdir = flags.DEFINE_string('workdir', None, workdir_help, required=True)
  step = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
  return workdir, step


def define_kv_cache_flag(name: str = 'kv_cache_dtype'):
  """--kv_cache_dtype, for the programs that decode (sample, serve; plan's serving plan: --NAME)."""
  from jax_pretrain import model  # noqa: PLC0415  (jax; only for the programs that decode)
  return flags.DEFINE_enum(
      name, 'auto', list(model.KV_CACHE_DTYPES),
      "What the engine's KV cache stores keys and values in: auto (the model's compute dtype), "
      'fp8 (e4m3) or int8: 8 bits with a float32 scale per head and position, about half the '
      "bytes decoding reads (vLLM's --kv-cache-dtype).")


def define_process_flags():
  """--coordinator_address, --num_processes, --process_id and --heartbeat_timeout (a run over
  several processes, jax_pretrain/multihost.py). Returns processes(): the context, around the
  program's work, of jax.distributed initialized from them (or from SLURM / Open MPI variables)
  and of the heartbeat, stopped and joined on the way out; entered after runtime.configure and
  before any computation."""
  coordinator = flags.DEFINE_string('coordinator_address', None,
                                    'host:port of process 0, for a multi-process run.')
  count = flags.DEFINE_integer('num_processes', None, 'Processes in a multi-process run.')
  index = flags.DEFINE_integer('process_id', None, 'This process, 0 .. num_processes - 1.')
  heartbeat = flags.DEFINE_integer(
      'heartbeat_timeout', 60, 'Seconds without a heartbeat after which a process of a '
      'multi-process run counts as lost: the others then stop with one error line naming it and '
      'the last complete checkpoint (see jax_pretrain/multihost.py).')

  def processes():
    from jax_pretrain import multihost  # noqa: PLC0415  (imports jax: after runtime.configure)
    return multihost.processes(coordinator.value, count.value, index.value, heartbeat.value)
  return processes


def check_init(init: str, restore_from: str) -> None:
  """A fine-tuning program's --init=RUN against its config's checkpoint.restore_from (the run it
  starts from, which the config file took from --init): one of them, not two runs."""
  if init and os.path.normpath(restore_from) != os.path.normpath(init):
    raise UserError(f'--init={init} but the config restores from {restore_from!r}: give one of '
                    'them.')


def init_into_config(argv: list[str], config_file: str) -> list[str]:
  """A fine-tuning program's --init=RUN as --config=FILE:RUN (FILE: --config's, else
  configs/config_file; the config file takes the run's model and seq_len): the --config value is
  rewritten before flags are parsed (python -m jax_pretrain.grpo, jax_pretrain.dpo). The last
  --init counts, as absl's; `--init RUN` and `--config FILE` are read as `--init=RUN` and
  `--config=FILE`."""
  joined: list[str] = []
  for a in argv:
    if joined and joined[-1] in ('--init', '--config'):
      joined[-1] = f'{joined[-1]}={a}'
    else:
      joined.append(a)
  argv = joined
  init = next((a.split('=', 1)[1] for a in reversed(argv) if a.startswith('--init=')), '')
  if not init:
    return argv
  given = [i for i, a in enumerate(argv) if a.startswith('--config=')]
  out = list(argv)
  if given:
    value = out[given[0]].split('=', 1)[1]
    if ':' not in value:
      out[given[0]] = f'--config={value}:{init}'
  else:
    out.insert(1, f'--config={PRESETS_DIR}/{config_file}:{init}')
  return out
