"""Scalars out: TensorBoard (through clu), metrics.jsonl, Weights & Biases, and the console; MFU.

Only process 0 writes. clu's TensorBoard writer imports TensorFlow; where TensorFlow is missing
(e.g. a GPU image without it) the scalars go only to the console and metrics.jsonl, after one
warning.
metrics.jsonl is always written: one JSON object per logged step, with the same scalar names.
With train.wandb_project set, the same scalars also go to wandb (files under WORKDIR/wandb); the
run's wandb id is kept in WORKDIR/wandb_run_id, so a resumed run continues the same wandb run.
"""
import json
import math
import os
import secrets
import socket
import time

from absl import logging

from jax_pretrain.errors import UserError

# Peak dense bf16 FLOP/s per device (vendor datasheets, SXM parts, no sparsity). Matched as a
# substring of jax's device_kind, first match wins; override with train.peak_flops.
PEAK_BF16_FLOPS = (
    ('GH200', 989e12),
    ('H200', 989e12),
    ('H100 PCIe', 756e12),
    ('H100', 989e12),
    ('H800', 989e12),
    ('B200', 2250e12),
    ('A100', 312e12),
    ('A800', 312e12),
    ('L40S', 362e12),
    ('A10G', 70e12),
    ('L4', 121e12),
    ('V100', 125e12),
)


def peak_flops_per_device(device_kind: str, override: float = 0.0) -> float | None:
  if override > 0:
    return override
  for name, flops in PEAK_BF16_FLOPS:
    if name.lower() in device_kind.lower():
      return flops
  return None  # unknown device (e.g. CPU): MFU is not reported


def mfu(flops_per_token: float, tokens_per_sec: float, num_devices: int,
        peak_per_device: float | None) -> float | None:
  """Model FLOPs utilization: achieved model FLOP/s over the devices' peak."""
  if not peak_per_device:
    return None
  return flops_per_token * tokens_per_sec / (num_devices * peak_per_device)


class _LogWriter:
  """Stand-in for clu's writer when TensorFlow is missing (one warning was logged)."""

  def write_scalars(self, step, scalars):
    pass  # the console line and metrics.jsonl already carry every scalar

  def flush(self):
    pass

  def close(self):
    pass


def _tensorboard_writer(workdir: str, start_step: int):
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow's start-up banner, not ours
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
  try:
    from clu import metric_writers  # noqa: PLC0415  (imports TensorFlow)
  except ImportError as e:
    logging.warning('TensorBoard event files are not written: %s. metrics.jsonl still is. '
                    'Install tensorflow-cpu and tensorboard to get them.', e)
    return _LogWriter()
  _mark_session_start(os.path.join(workdir, TENSORBOARD), start_step)
  return metric_writers.SummaryWriter(os.path.join(workdir, TENSORBOARD))


JSONL = 'metrics.jsonl'
DISCARDED_JSONL = 'metrics.discarded.jsonl'
TENSORBOARD = 'tensorboard'


WANDB_ID_FILE = 'wandb_run_id'  # in the workdir: the wandb run that a resumed run continues


class _WandbWriter:
  """The scalars to a wandb run whose id is kept in the workdir (made on the first start)."""

  def __init__(self, workdir: str, train: dict, config: dict):
    import wandb  # noqa: PLC0415  (optional; config.py checks it is there)
    path = os.path.join(workdir, WANDB_ID_FILE)
    if os.path.isfile(path):
      with open(path, encoding='utf-8') as f:
        run_id = f.read().strip()
    else:
      run_id = secrets.token_hex(6)  # wandb run ids: letters and digits, unique in a project
      with open(path, 'w', encoding='utf-8') as f:
        f.write(run_id + '\n')
    name = train['wandb_run_name'] or os.path.basename(os.path.abspath(workdir))
    try:
      self._run = wandb.init(project=train['wandb_project'], entity=train['wandb_entity'] or None,
                             name=name, id=run_id, resume='allow', dir=workdir, config=config)
    except wandb.errors.Error as e:
      raise UserError(f'wandb: {e} (log in with `wandb login` or WANDB_API_KEY, or set '
                      'WANDB_MODE=offline and `wandb sync` later).') from None

  def write_scalars(self, step, scalars):
    self._run.log(scalars, step=step)

  def close(self):
    self._run.finish()


class MetricWriter:
  """TensorBoard + metrics.jsonl (+ wandb when config's train.wandb_project is set) on process 0;
  does nothing on other processes. config: the resolved config as a dict (config.as_dict).

  metrics.jsonl holds one line per step, in step order: scalars written for the same step (train,
  then eval) are merged into its line. A run that starts at step S (a resume) first moves the lines
  of later steps, written before a crash, to metrics.discarded.jsonl, and tells TensorBoard to drop
  its points after S (each segment starts with a SessionLog START event at S + 1, by which
  TensorBoard's loader purges). (wandb keeps them: it ignores points at steps below its last.)
  A failing write (a full disk) is warned about once and training goes on: the checkpoint saves
  check the free space and stop the run cleanly if it is short. A writer (TensorBoard, wandb) that
  raises anything is warned about once, by name, and later writes are tried again: the others, and
  metrics.jsonl, get every step regardless (the scalars are what the run is watched by, not what it
  computes).
  """

  def __init__(self, workdir: str, enabled: bool = True, start_step: int = 0,
               config: dict | None = None):
    self._enabled = enabled
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._path = os.path.join(workdir, JSONL)
    _truncate_jsonl(self._path, os.path.join(workdir, DISCARDED_JSONL), start_step)
    self._writers = {'TensorBoard': _tensorboard_writer(workdir, start_step)}
    if config and config['train'].get('wandb_project'):
      self._writers['wandb'] = _WandbWriter(workdir, config['train'], config)
    self._jsonl = open(self._path, 'ab')  # noqa: SIM115
    self._last: tuple[int, dict] | None = None  # (file offset, row) of the last line
    self._failures = 0
    self._failed_writers: set[str] = set()  # warned about

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self._enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items() if v is not None}
    for name, writer in self._writers.items():
      try:
        writer.write_scalars(step, scalars)
      except Exception as e:  # noqa: BLE001  (a writer's own failure, of any kind: see above)
        self._writer_failed(name, f'writing the metrics of step {step}', e)
    try:
      if self._last is not None and self._last[1]['step'] == step:  # merge into the step's line
        offset, row = self._last[0], {**self._last[1], **scalars}
        self._jsonl.seek(offset)
        self._jsonl.truncate()
      else:
        offset, row = self._jsonl.tell(), {'step': step, **scalars}
      self._jsonl.write((json.dumps(row) + '\n').encode('utf-8'))
      self._jsonl.flush()
      self._last = (offset, row)
    except OSError as e:
      self._failures += 1
      if self._failures == 1:
        logging.warning('writing the metrics of step %d to %s failed (%s); training goes on, and '
                        'later writes are tried again.', step, self._path, e)

  def _writer_failed(self, name: str, what: str, error: Exception) -> None:
    if name not in self._failed_writers:
      self._failed_writers.add(name)
      logging.warning('%s: %s failed (%s: %s); training goes on, with metrics.jsonl and the '
                      'other writers, and later writes are tried again.', name, what,
                      type(error).__name__, str(error).strip().split('\n')[0][:300])

  def close(self) -> None:
    if self._enabled:
      for name, writer in self._writers.items():
        try:
          writer.close()
        except Exception as e:  # noqa: BLE001  (as in write: the run's end is not the writer's)
          self._writer_failed(name, 'closing', e)
      self._jsonl.close()


def jsonl_rows(path: str):
  """(line, row) of each line of a JSONL file (metrics.jsonl, config_history.jsonl) that reads
  (a line cut short by a crash does not)."""
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        yield line, json.loads(line)
      except json.JSONDecodeError:
        continue


def _truncate_jsonl(path: str, discarded: str, start_step: int) -> None:
  """Keeps one line per step up to start_step, in order; moves later lines to `discarded`."""
  if not os.path.isfile(path):
    return
  kept: dict[int, dict] = {}
  later = []
  for line, row in jsonl_rows(path):
    if row.get('step', 0) <= start_step:
      kept[row['step']] = {**kept.get(row['step'], {}), **row}
    else:
      later.append(line if line.endswith('\n') else line + '\n')
  if later:
    with open(discarded, 'a', encoding='utf-8') as f:
      f.writelines(later)
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(kept[step]) + '\n' for step in sorted(kept))
  os.replace(path + '.tmp', path)


def last_logged_step(workdir: str) -> tuple[int, str] | None:
  """(the last step, the file or directory that holds it) of the scalars written to this
  workdir: metrics.jsonl, or TensorBoard's event files when metrics.jsonl holds no step > 0
  (they are read only then: they are the slower to read); None when neither holds one."""
  path = os.path.join(workdir, JSONL)
  step = 0
  if os.path.isfile(path):
    step = max((row.get('step', 0) for _, row in jsonl_rows(path)), default=0)
  if step > 0:
    return step, path
  directory = os.path.join(workdir, TENSORBOARD)
  if not os.path.isdir(directory):
    return None
  try:
    from tensorboard.backend.event_processing import event_file_loader  # noqa: PLC0415
  except ImportError:  # (then nothing wrote event files here either)
    return None
  for name in os.listdir(directory):
    if os.path.isfile(os.path.join(directory, name)):
      events = event_file_loader.EventFileLoader(os.path.join(directory, name)).Load()
      step = max([step, *(e.step for e in events if e.WhichOneof('what') == 'summary')])
  return (step, directory) if step > 0 else None


def _mark_session_start(directory: str, step: int) -> None:
  """An event file holding a SessionLog START at step + 1, the first event of this run segment:
  TensorBoard takes every START after a run's first as a restart and drops the points of steps
  after `step` that earlier files hold. Named to sort after those files and before the new
  writer's (TensorBoard reads a directory's files in name order)."""
  from tensorboard.compat.proto import event_pb2  # noqa: PLC0415
  from tensorboard.summary.writer import record_writer  # noqa: PLC0415
  os.makedirs(directory, exist_ok=True)
  now = time.time()
  # One second earlier than the writer about to be made; after every earlier file (they were
  # made when an earlier segment of the run started, at least a compile before its checkpoint).
  name = f'events.out.tfevents.{int(now) - 1:010d}.{socket.gethostname()}.start-{step}'
  with open(os.path.join(directory, name), 'wb') as f:
    writer = record_writer.RecordWriter(f)
    writer.write(event_pb2.Event(wall_time=now, file_version='brain.Event:2').SerializeToString())
    writer.write(event_pb2.Event(wall_time=now, step=step + 1, session_log=event_pb2.SessionLog(
        status=event_pb2.SessionLog.START)).SerializeToString())
    writer.flush()


def perplexity(loss: float) -> float:
  """exp(loss), capped (exp(50)) so that a diverged loss logs a number, not inf."""
  return math.exp(min(float(loss), 50.0))
