"""SIGTERM / SIGINT (a preemption, Ctrl-C): finish the step, save, exit cleanly.

The first signal decides, in its handler, after which step the run stops, and says so at once; the
loop stops there (it asks `requested(step, previous)` after each step). A second SIGINT aborts
without saving (KeyboardInterrupt).

One process: the run stops after the step it computes when the signal arrives.

Several processes: each may see the signal at a different step, or only one of them sees it (a
preemption notice to one host), and all must stop after the same step, checked every step without
a collective in it. A process that receives a signal while it computes step k stops after step
k + 2 and posts that step for the others (multihost.post: the coordination service's key-value
store); every process reads the posts after each step (multihost.posted: one read that returns at
once) and stops after the earliest step posted. Two steps of margin make the earliest post reach
every process in time, without any process waiting for another: a process reads the posts after
step s only once its step s - 1 has finished (`previous`, that step's outputs), and step s - 1
finishes only once every process has started it (its gradients are reduced across them); the
process that posted step k + 2 started step k + 1 only after posting. So every process has read
the post when it decides about step k + 2, and none has gone past it. (The wait for the previous
step keeps at most two steps in flight: the device idles only if the host's work for a step takes
longer than the step.) With one process nothing is posted, read or waited for.

Before training starts (restoring, loading data, compiling), `wait(phase, fn)` runs the phase in a
thread so that a signal is acknowledged at once; the run then stops when the phase returns, before
training, with nothing new to save (every process together: an all-gather after each phase).
"""
import signal
import threading

import jax

from jax_pretrain import multihost

MARGIN = 2  # several processes: steps between the one a signal arrives in and the last one
_TOPIC = 'stop'  # multihost.post: 'STEP SIGNAL', the step after which the poster stops


class Stopped(Exception):
  """A stop signal arrived before training started."""


class StopSignal:

  def __init__(self):
    self._received: str | None = None  # this process's signal
    self._stop_after: int | None = None  # the earliest step announced (by this process or a post)
    self._by = ''  # who announced it: '' (this process) or e.g. 'SIGTERM on process 1'
    self._posted = False
    self._several = jax.process_count() > 1
    self._previous = {}
    self.step: int | None = None  # the step the loop computes now (None: before the loop)
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
    if self.phase:
      again = ' (Ctrl-C again to abort without saving)' if signum == signal.SIGINT else ''
      multihost.log(f'received {self._received} while {self.phase}: stopping when it is done, '
                    f'before training{again}')
    elif self.step is not None:
      self._announce(self.step)
    # (between the phases and the loop: the next phase, or the loop's first step, says it)

  def _announce(self, step: int) -> None:
    """This process's signal, during `step`: it stops after step + MARGIN (several processes) or
    after `step` (one), or earlier if an earlier step was posted; the post is made by the next
    `requested` (not in a signal handler)."""
    stop_after = step + (MARGIN if self._several else 0)
    if self._stop_after is None or stop_after < self._stop_after:
      self._stop_after, self._by = stop_after, ''
    again = ' (Ctrl-C again to abort without saving)' if self._received == 'SIGINT' else ''
    if self._several:
      multihost.log(f'received {self._received} during step {step}: {self._agreed()}{again}')
    else:
      multihost.log(f'received {self._received}: stopping after step {self._stop_after}{again}')

  def _agreed(self) -> str:
    return f'stopping after step {self._stop_after} (every process stops there)'

  @property
  def name(self) -> str:
    return self._received or self._by or 'a stop signal on another process'

  def requested(self, step: int, previous=None) -> bool:
    """Whether to stop after this step (just dispatched); the same answer on every process.
    previous: step - 1's outputs (None at a run's first step): with several processes, the posts
    are read once it has finished (see the module docstring).

    `step` moves on first: a signal handled from here on announces a later step.
    """
    self.step = step + 1
    if self._received and self._stop_after is None:  # received before the loop began
      self._announce(step)
    if self._several:
      jax.block_until_ready(previous)
      if self._stop_after is not None and self._by == '' and not self._posted:
        multihost.post(_TOPIC, f'{self._stop_after} {self._received}')
        self._posted = True
      for process, note in multihost.posted(_TOPIC).items():
        at, why = note.split(' ', 1)
        if self._stop_after is None or int(at) < self._stop_after:
          self._stop_after, self._by = int(at), f'{why} on process {process}'
          multihost.log(f'process {process} received {why} during step {int(at) - MARGIN}: '
                        f'{self._agreed()}')
    return self._stop_after is not None and step >= self._stop_after

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
