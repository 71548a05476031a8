"""The loop's `metrics` for a training run: each logged step's scalars to the writers
(metrics.MetricWriter: TensorBoard, metrics.jsonl, W&B) and its line to the console, read one step
late so that logging never waits for the device to go idle."""
import concurrent.futures
import time
from typing import Any

import jax

from jax_pretrain import metrics as metrics_lib
from jax_pretrain import model as model_lib
from jax_pretrain import multihost
from jax_pretrain.state import Setup


def _format_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


def _ready_at(device_metrics) -> float:
  """perf_counter once the arrays are computed (run on StepLogger's clock thread)."""
  jax.block_until_ready(device_metrics)
  return time.perf_counter()


class StepLogger:
  """Turns step metrics into scalars, the console line and the writers, one step late.

  `record(step, metrics)` keeps the device arrays of a logged step; they are read (`flush`) after
  the next step has been dispatched, so logging never waits for the device to go idle. `report`
  makes the scalars and the console line of the metrics read (a program's own logger overrides
  it: grpo.program.GRPOLogger).

  Speed: each line's tokens/s and step time are those of its own interval: from the moment the
  previous logged step's metrics were ready (or training resumed after `pause`: an eval, a save)
  to the moment this step's were. A thread waiting for the metrics takes that moment
  (`_ready_at`), because the moment `flush` reads them varies: after the next step's dispatch,
  which blocks the host for most of a step where a step launches thousands of kernels (a GPU), or
  at once at an eval, save, stop or last step; timed at the reads, those lines would be off by up
  to a step (tests/test_loop.py). `close` ends that thread.
  """

  def __init__(self, s: Setup, writer: metrics_lib.MetricWriter, start_step: int):
    c = s.config
    self._writer, self._steps = writer, c.train.steps
    self._tokens_per_step = s.run.tokens_per_step
    self._flops_per_token = model_lib.flops_per_token(c.model, c.data.seq_len)
    self._num_devices = s.mesh.size
    self._peak = metrics_lib.peak_flops_per_device(s.mesh.devices.flat[0].device_kind,
                                                   c.train.peak_flops)
    # (step, its metrics on the device, when they were ready: a Future of perf_counter)
    self._pending: tuple[int, Any, concurrent.futures.Future] | None = None
    self._clock = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='step_clock')
    self._last_time, self._last_step = time.perf_counter(), start_step
    self.latest: dict[str, float] = {}

  def record(self, step: int, device_metrics) -> None:
    self._pending = (step, device_metrics, self._clock.submit(_ready_at, device_metrics))

  def pause(self) -> None:
    """Time spent outside training steps (eval, a blocking save) is not step time: the next
    interval starts now (called with no step pending, the device idle)."""
    self._last_time = time.perf_counter()

  def flush(self) -> dict | None:
    if self._pending is None:
      return None
    step, device_metrics, ready = self._pending
    self._pending = None
    m = jax.device_get(device_metrics)
    now = ready.result()
    step_time = (now - self._last_time) / max(step - self._last_step, 1)
    self._last_time, self._last_step = now, step
    scalars, line = self.report(step, m, step_time)
    self.write(step, scalars)
    multihost.log(f'step {step}/{self._steps} | {line} | ETA '
                  f'{_format_eta((self._steps - step) * step_time)}')
    return {'step': step, **m}

  def report(self, step: int, m: dict, step_time: float) -> tuple[dict, str]:
    """(scalars, the console line's middle) of step metrics read from the device."""
    tokens_per_sec = self._tokens_per_step / step_time
    mfu = metrics_lib.mfu(self._flops_per_token, tokens_per_sec, self._num_devices, self._peak)
    scalars = {'train/loss': m['loss'], 'train/ppl': metrics_lib.perplexity(m['loss']),
               'train/lr': m['lr'], 'train/grad_norm': m['grad_norm'],
               'train/tokens': step * self._tokens_per_step,
               'train/nonfinite_skips': m['nonfinite_count'],
               'perf/tokens_per_sec': tokens_per_sec, 'perf/step_time': step_time,
               'perf/mfu': mfu}
    scalars.update(self.loss_scale_scalars(m))
    mfu_text = f' | MFU {mfu:.1%}' if mfu is not None else ''
    return scalars, (f'loss {m["loss"]:.4f} | lr {m["lr"]:.2e} | grad_norm {m["grad_norm"]:.3f} '
                     f'| {tokens_per_sec:,.0f} tok/s | {step_time:.3f} s/step{mfu_text}'
                     f'{self.skipped(m)}')

  @staticmethod
  def loss_scale_scalars(m: dict) -> dict:
    """float16 runs' dynamic loss scaling (state.LossScale): its scale and skipped steps."""
    if 'loss_scale' not in m:
      return {}
    return {'train/loss_scale': m['loss_scale'], 'train/loss_scale_skips': m['loss_scale_skips']}

  @staticmethod
  def skipped(m: dict) -> str:
    return f' | skipped {m["nonfinite_count"]}' if m['nonfinite_count'] else ''

  def write(self, step: int, scalars: dict) -> None:
    self._writer.write(step, scalars)
    self.latest.update({k: v for k, v in scalars.items() if v is not None})

  def close(self) -> None:
    """Ends the clock thread (once it has timed a step in flight, if any)."""
    self._clock.shutdown(cancel_futures=True)
