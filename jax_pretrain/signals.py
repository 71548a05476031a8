"""SIGTERM / SIGINT (a preemption, Ctrl-C): finish the step, save, exit cleanly.

The first signal decides, in its handler, after which step the run stops, and says so at once; the
loop stops there. A second SIGINT aborts without saving (KeyboardInterrupt). With several
processes, each may see the signal at a different step, so the loop asks `requested(step)` at the
same steps on every process (every `check_every`) and they agree through an all-gather.

Before training starts (restoring, loading data, compiling), `wait(phase, fn)` runs the phase in a
thread so that a signal is acknowledged at once; the run then stops when the phase returns, before
training, with nothing new to save (every process together).
"""
import signal
import threading

import jax

from jax_pretrain import multihost


class Stopped(Exception):
  """A stop signal arrived before training started."""


class StopSignal:

  def __init__(self, check_every: int):
    self._received: str | None = None
    self._stop_after: int | None = None  # the step the first signal's handler announced
    self._check_every = check_every
    self._previous = {}
    self.step = 0  # the step the loop computes now: a signal now stops the run after it
    self.phase = ''  # what runs before training ('compiling', ...), for the acknowledgement
    if threading.current_thread() is threading.main_thread():  # handlers only install there
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    if self._received and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C: stop now
    if self._received:
      return
    self._received = signal.Signals(signum).name
    self._stop_after = self.stop_step()
    again = ' (Ctrl-C again to abort without saving)' if signum == signal.SIGINT else ''
    if self.phase:
      multihost.log(f'received {self._received} while {self.phase}: stopping when it is done, '
                    f'before training{again}')
    else:
      multihost.log(f'received {self._received}: stopping after step {self._stop_after}{again}')

  def stop_step(self) -> int:
    """The step after which the loop stops if a signal arrives now."""
    if jax.process_count() == 1:
      return self.step
    return -(-self.step // self._check_every) * self._check_every  # the next agreed check

  @property
  def name(self) -> str:
    return self._received or 'a stop signal on another process'

  def requested(self, step: int) -> bool:
    """Whether to stop after this step (just finished); the same answer on every process.

    `step` moves on before the announced step is compared: a signal handled in between announces
    the next step and stops there, as it says.
    """
    self.step = step + 1
    mine = self._stop_after is not None and step >= self._stop_after
    if jax.process_count() > 1 and step % self._check_every:
      return False
    return multihost.any_process(mine)

  def wait(self, phase: str, fn, *args):
    """fn(*args), run in a thread while this one stays responsive to signals; raises Stopped
    after fn returns if a signal arrived meanwhile on any process (every process calls this at the
    same phases, so they stop together)."""
    result, error = [], []

    def target():
      try:
        result.append(fn(*args))
      except BaseException as e:  # noqa: BLE001  (re-raised below)
        error.append(e)

    self.phase = phase
    thread = threading.Thread(target=target, daemon=True, name=phase)
    thread.start()
    try:
      while thread.is_alive():
        thread.join(timeout=0.1)
    finally:
      self.phase = ''
    if error:
      raise error[0]
    if multihost.any_process(self._received is not None):
      raise Stopped(f'received {self.name} while {phase}: stopped before training')
    return result[0]

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
