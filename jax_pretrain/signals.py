"""SIGTERM / SIGINT (a preemption, Ctrl-C): finish the step, save, exit cleanly.

The first signal sets a flag that the loop checks between steps, and says at once after which step
the run will stop; a second SIGINT aborts without saving (KeyboardInterrupt). With several
processes, each may see the signal at a different step, so the loop asks `requested(step)` at the
same steps on every process and they agree through an all-gather.

Before training starts (loading data, restoring, compiling), `wait(fn)` runs the phase in a thread
so that a signal is acknowledged at once; the run then stops when the phase returns, before
training, with nothing new to save.
"""
import contextlib
import signal
import threading

import jax
from jax.experimental import multihost_utils
import numpy as np


@contextlib.contextmanager
def _signals_blocked():
  """SIGINT and SIGTERM held back (delivered, and their handlers run, on leaving)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Stopped(Exception):
  """A stop signal arrived before training started."""


class StopSignal:

  def __init__(self, check_every: int):
    self._received: str | None = None
    self._check_every = check_every
    self._previous = {}
    self.step = 0  # the step the loop is about to finish: a stop now stops after it
    self.phase = ''  # what runs before training ('compiling', ...), for the acknowledgement
    if threading.current_thread() is threading.main_thread():  # handlers only install there
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    if self._received and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C: stop now
    self._received = signal.Signals(signum).name
    if jax.process_index() == 0:
      again = ' (Ctrl-C again to abort without saving)' if signum == signal.SIGINT else ''
      if self.phase:
        print(f'received {self._received} while {self.phase}: stopping when it is done, before '
              f'training{again}', flush=True)
      else:
        print(f'received {self._received}: stopping after step {self.stop_step()}{again}',
              flush=True)

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

    A signal that arrives after the flag is read stops the run after the next step, which is what
    its acknowledgement says: the two are updated with the signals held back.
    """
    with _signals_blocked():
      received = self._received is not None
      self.step = step + 1
    if jax.process_count() == 1:
      return received
    if step % self._check_every:
      return False
    flags = multihost_utils.process_allgather(np.array(received))
    return bool(np.any(flags))

  def wait(self, phase: str, fn, *args):
    """fn(*args), run in a thread while this one stays responsive to signals; raises Stopped
    after fn returns if a signal arrived meanwhile."""
    result, error = [], []

    def target():
      try:
        result.append(fn(*args))
      except BaseException as e:  # pylint: disable=broad-except  (re-raised below)
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
    if self._received is not None:
      raise Stopped(f'received {self._received} while {phase}: stopped before training')
    return result[0]

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
