"""A run's directory, and a trained run loaded from it: what training writes and what sampling,
evaluation, export and import read.

  WORKDIR/config.json    the resolved config (config.as_dict), written once a launch has restored
  WORKDIR/config_history.jsonl   one line per launch: when, where, from which step, what changed
  WORKDIR/tokenizer/     the run's tokenizer (data.tokenizer.save: its file and record)
  WORKDIR/generation_config.json   an imported model's (Hugging Face's file): its sampling
                         defaults and end-of-sequence ids, which the server reads (optional)
  WORKDIR/.lock          held (flock) by the process that trains in the workdir
  WORKDIR/checkpoints/   orbax checkpoints (checkpoint.py)
  WORKDIR/metrics.jsonl, WORKDIR/tensorboard/   scalars (metrics.py)

`check_history(workdir)` refuses training from step 0 where the history above records training
but `checkpoints/` holds no step (moved, not mounted): no run restarts in silence.
`load(workdir)` gives a `Trained` run: config, params of its latest (or a given) checkpoint, and
tokenizer, on this machine's devices. `create(...)` writes a step-0 run from given params (an
imported Hugging Face model), which training can continue from.
"""
import dataclasses
import datetime
import fcntl
import json
import math
import os
import socket
from typing import Any

import jax
import ml_collections

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import fp8
from jax_pretrain import metrics as metrics_lib
from jax_pretrain import state as state_lib
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.errors import UserError

CONFIG_FILE = 'config.json'
HISTORY_FILE = 'config_history.jsonl'
LOCK_FILE = '.lock'
TOKENIZER_DIR = 'tokenizer'
GENERATION_CONFIG_FILE = 'generation_config.json'


class WorkdirError(UserError):
  """A workdir that is not what the command needs (missing, not a run, already used)."""


def claim(workdir: str):
  """Creates the workdir if needed and takes its exclusive lock; returns the open lock file, which
  holds the lock until it is closed or the process ends (the OS releases it, even on SIGKILL).

  Raises WorkdirError, changing nothing, when the workdir cannot be written or another process
  (on any host sharing the filesystem) holds the lock; the message names the holder.
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f'--workdir={workdir}: is a file, not a directory.')
  try:
    os.makedirs(workdir, exist_ok=True)
    f = open(os.path.join(workdir, LOCK_FILE), 'a+', encoding='utf-8')  # noqa: SIM115
  except OSError as e:
    raise WorkdirError(f'--workdir={workdir}: cannot write there ({e.strerror or e}).') from None
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    f.seek(0)
    holder = f.read().strip() or 'another process'
    f.close()
    raise WorkdirError(f'{workdir} is in use by {holder} (lock file {f.name}). Wait for that run '
                       'to end, stop it, or give another --workdir.') from None
  f.seek(0)
  f.truncate()
  f.write(f'{socket.gethostname()} pid {os.getpid()}, since '
          f'{datetime.datetime.now().isoformat(timespec="seconds")}\n')
  f.flush()
  return f


def record_launch(workdir: str, step: int, changes: dict[str, tuple]) -> None:
  """Appends this launch to config_history.jsonl: time, host, pid, start step, changed fields."""
  entry = {'time': datetime.datetime.now().isoformat(timespec='seconds'),
           'host': socket.gethostname(), 'pid': os.getpid(), 'start_step': step,
           'changes': {k: list(v) for k, v in changes.items()}}
  with open(os.path.join(workdir, HISTORY_FILE), 'a', encoding='utf-8') as f:
    f.write(json.dumps(entry) + '\n')


def check_history(workdir: str) -> None:
  """Refuses to train from step 0 in a workdir whose history records training (scalars of a step
  > 0, a launch that resumed from one) while WORKDIR/checkpoints holds no step, complete or set
  aside: they were moved or deleted, their volume is not mounted, or the run was killed before
  its first save. Starting over would mix two runs in one history, in silence;
  checkpoint.start_over=True asks for it. Reads the directory only: nothing is created."""
  checkpoints = os.path.join(workdir, checkpoint_lib.DIRECTORY)
  names = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
  if any(name.removesuffix(checkpoint_lib.DAMAGED_SUFFIX).isdigit() for name in names):
    return  # (restored, or each found damaged: checkpoint.Checkpointer says)
  found = metrics_lib.last_logged_step(workdir)
  path = os.path.join(workdir, HISTORY_FILE)
  if found is None and os.path.isfile(path):
    resumed = max((row.get('start_step', 0) for _, row in metrics_lib.jsonl_rows(path)),
                  default=0)
    found = (resumed, path) if resumed > 0 else None
  if found is not None:
    step, where = found
    raise WorkdirError(
        f'{where} records training to step {step}, but {checkpoints} holds no checkpoint (moved '
        'or deleted? a volume not mounted? killed before its first save?). Put the checkpoints '
        'back and run the same command to resume; or, to train from step 0 in this workdir on '
        'purpose, add --config.checkpoint.start_over=True (the metrics so far move to '
        'metrics.discarded.jsonl), or give a new --workdir.')


def write_config(workdir: str, config: config_lib.Config) -> None:
  """config.json, written to a temporary name and renamed: never half-written."""
  path = os.path.join(workdir, CONFIG_FILE)
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    f.write(config_lib.to_json(config))
  os.replace(path + '.tmp', path)


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The resolved config a run saved, over today's defaults (runs saved before a field existed,
  or moved, still load), as a config file gives it (a ConfigDict: config.typed or config.resolve
  take it)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise WorkdirError(f'{path} not found: is {workdir!r} the workdir of a training run?')
  with open(path, encoding='utf-8') as f:
    return config_lib.from_dict(json.load(f))


def save_tokenizer(workdir: str, tokenizer) -> None:
  tokenizer_lib.save(tokenizer, os.path.join(workdir, TOKENIZER_DIR))


def load_tokenizer(workdir: str, config: config_lib.Config | None = None):
  """The tokenizer the run trained with. Runs older than WORKDIR/tokenizer/ resolve it from their
  config's data settings, as training did (that reads the data's metadata, not the data)."""
  directory = os.path.join(workdir, TOKENIZER_DIR)
  if os.path.isdir(directory):
    return tokenizer_lib.load(directory)
  from jax_pretrain import data as data_lib  # noqa: PLC0415
  return data_lib.open_sources(config or config_lib.typed(load_config(workdir))).tokenizer


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """What a generation_config.json (Hugging Face's) sets that the server uses, as vLLM reads it:
  sampling defaults (None: not set) and the ids that end a sequence (eos_token_id, an int or a
  list: an instruct model's end-of-turn beside its EOS)."""
  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  max_new_tokens: int | None = None
  eos_ids: tuple[int, ...] = ()


def generation_config(directory: str) -> GenerationConfig:
  """The generation_config.json in directory (a run's, or a Hugging Face model's), checked; an
  empty GenerationConfig where there is none."""
  path = os.path.join(directory, GENERATION_CONFIG_FILE)
  if not os.path.isfile(path):
    return GenerationConfig()
  try:
    with open(path, encoding='utf-8') as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise WorkdirError(f'{path}: invalid JSON ({e}).') from None
  if not isinstance(raw, dict):
    raise WorkdirError(f'{path}: not a JSON object.')
  number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
  integer = lambda x: isinstance(x, int) and not isinstance(x, bool)
  value = lambda name, kind, ok: raw.get(name) is None or kind(raw[name]) and ok(raw[name])
  eos = raw.get('eos_token_id')
  eos_ids: Any = [eos] if integer(eos) else [] if eos is None else eos
  for name, ok, must in [
      ('temperature', value('temperature', number, lambda x: x >= 0), 'be a number >= 0'),
      ('top_p', value('top_p', number, lambda x: 0 < x <= 1), 'be a number in (0, 1]'),
      ('top_k', value('top_k', integer, lambda x: x >= 0), 'be an integer >= 0'),
      ('max_new_tokens', value('max_new_tokens', integer, lambda x: x >= 1),
       'be an integer >= 1'),
      ('eos_token_id', isinstance(eos_ids, list) and all(integer(i) and i >= 0 for i in eos_ids),
       'be a token id or a list of them')]:
    if not ok:
      raise WorkdirError(f'{path}: "{name}" is {raw[name]!r}; it must {must}.')
  return GenerationConfig(raw.get('temperature'), raw.get('top_p'), raw.get('top_k'),
                          raw.get('max_new_tokens'), tuple(int(i) for i in eos_ids))


@dataclasses.dataclass
class Trained:
  """A run's config (resolved for this machine), params (in setup's shardings) and tokenizer;
  with model.fp8, the checkpoint's amax histories (None where it has none)."""
  config: config_lib.Config
  params: Any
  tokenizer: Any
  setup: state_lib.Setup
  step: int
  fp8: Any = None

  @property
  def engine_params(self):
    """What the engine decodes with (runner.decoding_params): the params, and with model.fp8
    the amax histories beside them, whose delayed scales it runs at (fp8.py's inference)."""
    return fp8.merge(self.params, self.fp8)


def for_devices(config: config_lib.Config) -> config_lib.Config:
  """config for whatever devices the state is built on: data-parallel over all of them, batch
  splits re-derived, and the attention and the way the layers run chosen for them ('auto': the
  run may have used a kernel that these devices lack, or unrolled layers a CPU compiles slowly;
  neither changes the params)."""
  return dataclasses.replace(
      config, mesh=config_lib.MeshConfig(data=-1, fsdp=1, tensor=1),
      train=dataclasses.replace(config.train, micro_batch_size=0, eval_batch_size=0),
      model=dataclasses.replace(config.model, attention='auto', layers=config_lib.AUTO_LAYERS))


def _setup(config: config_lib.Config, devices, vocab_size: int) -> state_lib.Setup:
  resolved, run = config_lib.resolve(config, len(devices), device=devices[0],
                                     tokenizer_vocab_size=vocab_size)
  return state_lib.build(resolved, run, devices)


def load(workdir: str, step: int | None = None, devices=None) -> Trained:
  """The run's latest (or given) checkpoint on these devices (default: all of this machine's).

  The mesh is rebuilt for the devices at hand (data-parallel over all of them), batch splits are
  re-derived, and the attention is chosen for them (a run trained with cuDNN loads on a CPU).
  """
  config = config_lib.typed(load_config(workdir))
  tokenizer = load_tokenizer(workdir, config)
  devices = jax.devices() if devices is None else devices
  s = _setup(for_devices(config), devices, tokenizer.vocab_size)
  checkpointer = checkpoint_lib.Checkpointer(workdir, read_only=True)
  try:
    step, params = checkpointer.restore_params(s.abstract_state.params, step)
    histories = checkpointer.restore_fp8(s.abstract_state.fp8, step)
  finally:
    checkpointer.close()
  return Trained(s.config, params, tokenizer, s, step, histories)


def check_new(workdir: str) -> None:
  """Refuses a workdir that already holds checkpoints: a new run there would mix with them."""
  if os.path.exists(os.path.join(workdir, checkpoint_lib.DIRECTORY)):
    raise WorkdirError(f'{workdir} already holds checkpoints; give a new workdir.')


def create(workdir: str, config: config_lib.Config | ml_collections.ConfigDict, params,
           tokenizer) -> Trained:
  """A new run at step 0 with these params (host numpy arrays) and a fresh optimizer. Its
  config.json is `config` as given (unresolved: a new run from it resolves it for its own
  devices). The state is built on the CPU and saved from host memory (state_from_host_params):
  an imported model takes one copy of its params in memory, and no accelerator's."""
  check_new(workdir)
  config = config_lib.typed(config)
  devices = jax.devices('cpu')[:1]
  s = _setup(for_devices(config), devices, tokenizer.vocab_size)
  state = state_lib.state_from_host_params(s, params)
  # As few arrays in flight as orbax allows (its limit must hold the largest): the save then adds
  # about the largest array to memory, not the whole state (the largest model 2 GB, not 100%).
  largest_gb = max(x.nbytes for x in jax.tree.leaves(state)) / 1e9
  with claim(workdir):
    save_tokenizer(workdir, tokenizer)
    write_config(workdir, config)
    checkpointer = checkpoint_lib.Checkpointer(workdir, async_save=False,
                                               save_concurrent_gb=math.ceil(largest_gb))
    try:
      checkpointer.save(0, state, config_lib.as_dict(config))
    finally:
      checkpointer.close()
  return Trained(s.config, params, tokenizer, s, 0)
