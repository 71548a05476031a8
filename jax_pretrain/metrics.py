"""Scalars out: TensorBoard (through clu), metrics.jsonl, Weights & Biases, and the console; MFU.

Only process 0 writes. clu's TensorBoard writer imports TensorFlow; where TensorFlow is missing
(e.g. a GPU image without it) the scalars go only to the console and metrics.jsonl, after one warning.
metrics.jsonl is always written: one JSON object per logged step, with the same scalar names.
With train.wandb_project set, the same scalars also go to wandb (files under WORKDIR/wandb); the
run's wandb id is kept in WORKDIR/wandb_run_id, so a resumed run continues the same wandb run.
"""
import json
import math
import os
import secrets

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


def _tensorboard_writer(workdir: str):
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow's start-up banner, not ours
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
  try:
    from clu import metric_writers  # pylint: disable=g-import-not-at-top  (imports TensorFlow)
  except ImportError as e:
    logging.warning('TensorBoard event files are not written: %s. metrics.jsonl still is. '
                    'Install tensorflow-cpu and tensorboard to get them.', e)
    return _LogWriter()
  return metric_writers.SummaryWriter(os.path.join(workdir, 'tensorboard'))


WANDB_ID_FILE = 'wandb_run_id'  # in the workdir: the wandb run that a resumed run continues


class _WandbWriter:
  """The scalars to a wandb run whose id is kept in the workdir (made on the first start)."""

  def __init__(self, workdir: str, train: dict, config: dict):
    import wandb  # pylint: disable=g-import-not-at-top  (optional; config.py checks it is there)
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
  does nothing on other processes. config: the resolved config as a dict (config.as_dict)."""

  def __init__(self, workdir: str, enabled: bool = True, config: dict | None = None):
    self._enabled = enabled
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._writers = [_tensorboard_writer(workdir)]
    if config and config['train'].get('wandb_project'):
      self._writers.append(_WandbWriter(workdir, config['train'], config))
    self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a', encoding='utf-8')

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self._enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items() if v is not None}
    for writer in self._writers:
      writer.write_scalars(step, scalars)
    self._jsonl.write(json.dumps({'step': step, **scalars}) + '\n')
    self._jsonl.flush()

  def close(self) -> None:
    if self._enabled:
      for writer in self._writers:
        writer.close()
      self._jsonl.close()


def perplexity(loss: float) -> float:
  """exp(loss), capped (exp(50)) so that a diverged loss logs a number, not inf."""
  return math.exp(min(float(loss), 50.0))
