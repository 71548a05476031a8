"""SIGTERM / SIGINT (a preemption, Ctrl-C): finish the step, save, exit cleanly.

The first signal only sets a flag that the loop checks between steps; a second SIGINT interrupts
at once. With several processes, each may see the signal at a different step, so the loop asks
`requested(step)` at the same steps on every process and they agree through an all-gather.
"""
import signal
import threading

import jax
from jax.experimental import multihost_utils
import numpy as np


class StopSignal:

  def __init__(self, check_every: int):
    self._received: str | None = None
    self._check_every = check_every
    self._previous = {}
    if threading.current_thread() is threading.main_thread():  # handlers only install there
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    if self._received and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C: stop now
    self._received = signal.Signals(signum).name

  @property
  def name(self) -> str:
    return self._received or 'a stop signal on another process'

  def requested(self, step: int) -> bool:
    """Whether to stop after this step; the same answer on every process."""
    if jax.process_count() == 1:
      return self._received is not None
    if step % self._check_every:
      return False
    flags = multihost_utils.process_allgather(np.array(self._received is not None))
    return bool(np.any(flags))

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
