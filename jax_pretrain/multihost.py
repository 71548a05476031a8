"""Every agreement between the processes of a run, and what happens when one of them is lost.

With one process each function here is trivial (no communication); with several, the agreements
are collectives: every process calls them at the same point, or they wait for each other forever.

- `is_main()`, `log(message)`: process 0 speaks for the run (its console lines).
- `any_process(flag)`, `all_processes(flag)`: a flag agreed on (a stop signal, a failed save).
- `from_main(flag)`: process 0's flag on every process (it alone claims the workdir).
- `minimum(x)`: the smallest of a number across processes (the memory every device has).
- `gather(tree)`: the full arrays of a sharded tree on every process (process 0 then samples or
  evaluates with them).
- `barrier(name)`: every process reaches this point before any goes on.
- `post(topic, value)`, `posted(topic)`: a note from one process that the others read when they
  look, without a collective (the coordination service's key-value store): signals.StopSignal
  announces a stop with it.

A lost process (`processes`, `set_resume_hint`). jax.distributed's own answer
to a dead process is a C++ abort on the others: `F... client.h:86] Terminating process because
the JAX distributed service detected fatal errors`, a C++ stack trace and `Fatal Python error:
Aborted`, after its heartbeat timeout. In jax 0.12 that abort cannot be replaced from Python:
`missed_heartbeat_callback` is accepted by `get_distributed_runtime_client`, but calling it fails
in C++ (`std::bad_cast`: the status it passes has no Python type), and `jax.distributed.initialize`
does not take it anyway. So this module keeps its own heartbeat, through the coordination
service's key-value store: a daemon thread on every process writes a counter every
`heartbeat_timeout / 10` seconds (at most 5) and reads all the others' in one call (N values per
process and interval: with hundreds of processes, a longer timeout spares the coordinator). The
entry point owns it: `processes()` around the program stops it and joins it on every way out. A
process whose counter has not moved for `heartbeat_timeout` seconds (measured on the reader's
clock) is lost: each surviving process prints one line,

  error: process 1 of 2 stopped responding (no heartbeat for 60 s); the last complete checkpoint
  is step 100 in WORKDIR/checkpoints; restart all processes with the same command to resume from it.

and exits with status 1 (os._exit, after flushing: the main thread may be blocked inside a
collective that will never complete). jax's own heartbeat timeout is set to twice ours plus 10 s,
so that its abort comes only if this thread could not run (a process whose Python is stuck
holding the interpreter lock). A collective that fails at once because its peer is gone (gloo's
`Connection reset by peer`) raises in the main thread: `processes()` then waits for the
heartbeat's verdict instead of printing a traceback, and re-raises the error if no process was
lost. A process that leaves `processes()` (done, stopped by a signal, an `error:` line) writes
'done' as its last heartbeat and is never reported; one killed, frozen or aborted (a second
Ctrl-C) is.

How soon the line comes after a kill or a freeze (about one heartbeat timeout): BENCHMARKS.md.

What it cannot do:
- Losing process 0 ends the others at once with jax's own fatal message: process 0 hosts the
  coordination service, and jax's client aborts in C++ as soon as its connection to the service
  breaks, before any Python code can run. The rule to resume is the same (the last complete
  checkpoint is the highest-numbered directory in WORKDIR/checkpoints; restart all processes).
- Continue without the lost process: the mesh spans all devices, so all processes restart.
- Tell a lost process from one whose Python is blocked (holding the interpreter lock) for
  longer than the timeout: both stop heartbeating. Compiles, collectives and checkpoint writes
  release the lock; a timeout of 60 s leaves ample room.
"""
import contextlib
import os
import re
import sys
import threading
import time
from typing import Callable

import jax
from jax.experimental import multihost_utils
import numpy as np

from jax_pretrain import errors

DEFAULT_HEARTBEAT_TIMEOUT = 60  # seconds without a heartbeat after which a process is lost
EXIT_LOST_PEER = 1

# Variables that mean a cluster launcher started several processes of this program.
_LAUNCHER_VARIABLES = ('SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE')
_HEARTBEAT_DIR = 'jax_pretrain/heartbeat/'  # + process index: a counter, or _DONE when it left
_POSTS_DIR = 'jax_pretrain/posts/'  # + topic/process index: `post`
_DONE = 'done'
# An error that may come from a peer that went away (a collective or the coordination service).
_PEER_ERROR = re.compile(r'gloo|nccl|connection|socket|peer|unavailable|heartbeat|barrier|'
                         r'coordination|deadline', re.IGNORECASE)


def is_main() -> bool:
  """Whether this is process 0, which prints the run's lines and writes its logs."""
  return jax.process_index() == 0


def log(message: str) -> None:
  """Prints a line of the run's console output (process 0 only)."""
  if is_main():
    print(message, flush=True)


def any_process(flag: bool) -> bool:
  """Whether the flag is set on any process (a collective: every process must call it)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.array(bool(flag)))))


def all_processes(flag: bool) -> bool:
  """Whether the flag is set on every process (a collective)."""
  return not any_process(not flag)


def from_main(flag: bool) -> bool:
  """Process 0's flag, on every process (a collective)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(multihost_utils.broadcast_one_to_all(np.array(bool(flag))))


def minimum(x: float) -> float:
  """The smallest of x across processes (a collective)."""
  if jax.process_count() == 1:
    return x
  return float(np.min(multihost_utils.process_allgather(np.float32(x))))


def gather(tree, on_device: bool = False):
  """The full arrays of a sharded tree on every process (a collective: each process holds only
  its shards of them); as NumPy arrays, or on this process's first device. One process: the tree
  as it is."""
  if jax.process_count() == 1:
    return tree
  full = multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_put(full, jax.local_devices()[0]) if on_device else full


def global_array(tree, sharding):
  """Host arrays (a tree of them) that every process holds whole (the same values), as global
  arrays in `sharding`: each process places its devices' blocks of them (one process: one
  device_put for the whole tree)."""
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)
  place = lambda x: jax.make_array_from_callback(np.shape(x), sharding,
                                                 lambda index: np.asarray(x)[index])
  return jax.tree.map(place, tree)


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier of this name."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def post(topic: str, value: str) -> None:
  """Leaves this process's note on `topic` (replacing its last one) for the others to read with
  `posted`: one write to the coordination service's key-value store; nobody waits for anybody.
  Several processes only."""
  _client().key_value_set(f'{_POSTS_DIR}{topic}/{jax.process_index()}', value,
                          allow_overwrite=True)


def posted(topic: str) -> dict[int, str]:
  """process -> its note on `topic`, of every process that left one: one read of the store,
  which returns at once (no collective, no waiting for a note). Several processes only."""
  return {int(key.rsplit('/', 1)[-1]): value
          for key, value in _client().key_value_dir_get(f'{_POSTS_DIR}{topic}/')}


def _client():
  """The coordination service's client (jax has no public API for it)."""
  from jax._src import distributed  # noqa: PLC0415
  return distributed.global_state.client


# A lost process.


class _Watchdog:
  """The heartbeat thread: writes this process's counter, reads the others', reports a lost one."""

  def __init__(self, client, timeout: float):
    self._client, self.timeout = client, timeout
    self.interval = min(max(timeout / 10, 0.1), 5.0)
    self._me, self._count = jax.process_index(), jax.process_count()
    self._stopped = threading.Event()
    self._lock = threading.Lock()  # a last counter never overwrites _DONE
    self.lost = threading.Event()  # set (before the process exits) when a peer is found lost
    self._thread = threading.Thread(target=self._run, daemon=True, name='multihost heartbeat')
    self._thread.start()

  def stop(self) -> None:
    """No more heartbeats or checks: this process is leaving, and says so to the others, which
    then do not count it as lost; then the thread is joined. Bounded: a call into the
    coordination service that never returns (the service gone: jax aborts anyway) is not waited
    for past a heartbeat and 10 s (the thread is a daemon for that case only)."""
    locked = self._lock.acquire(timeout=self.interval + 10)
    try:
      if not self._stopped.is_set():
        self._stopped.set()
        with contextlib.suppress(Exception):
          self._client.key_value_set(f'{_HEARTBEAT_DIR}{self._me}', _DONE, allow_overwrite=True)
    finally:
      if locked:
        self._lock.release()
    self._thread.join(timeout=self.interval + 10)

  def _run(self) -> None:
    beat, start = 0, time.monotonic()
    peers = [p for p in range(self._count) if p != self._me]
    seen = {p: ('', start) for p in peers}  # process -> (its last counter, when it changed)
    while not self._stopped.wait(self.interval):
      beat += 1
      try:
        with self._lock:
          if self._stopped.is_set():
            return
          self._client.key_value_set(f'{_HEARTBEAT_DIR}{self._me}', str(beat),
                                     allow_overwrite=True)
        beats = {int(key.rsplit('/', 1)[-1]): value
                 for key, value in self._client.key_value_dir_get(_HEARTBEAT_DIR)}
      except Exception:  # noqa: BLE001  (the service is gone: jax aborts anyway)
        continue
      now = time.monotonic()
      for p in peers:
        if beats.get(p, '') != seen[p][0]:
          seen[p] = (beats.get(p, ''), now)
      lost = [p for p in peers if seen[p][0] != _DONE and now - seen[p][1] >= self.timeout]
      if lost and not self._stopped.is_set():
        self.lost.set()
        _report_lost(lost, self._count, self.timeout, self.interval)


_resume_hint: Callable[[], str] | None = None


def set_resume_hint(fn: Callable[[], str] | None) -> None:
  """fn() says where a restarted run resumes from (e.g. 'the last complete checkpoint is step 100
  in DIR'), for the line printed when a process is lost. It runs on the heartbeat thread: it must
  not wait for the main thread or a collective (the Checkpointer lists its directory)."""
  global _resume_hint
  _resume_hint = fn


def _report_lost(lost: list[int], count: int, timeout: float, interval: float) -> None:
  """Prints the one line about the lost processes and ends this process (status 1)."""
  who = (f'process {lost[0]}' if len(lost) == 1 else
         'processes ' + ', '.join(map(str, lost)))
  verb = 'stopped' if len(lost) == 1 else 'all stopped'
  hint = ''
  if _resume_hint is not None:
    try:
      hint = f'; {_resume_hint()}'
    except Exception:  # noqa: BLE001  (the line matters more than the hint)
      hint = ''
  then = (' to resume from it' if 'checkpoint is step' in hint else
          ' to start again' if hint else '')
  line = (f'error: {who} of {count} {verb} responding (no heartbeat for {timeout:g} s){hint}; '
          f'restart all processes with the same command{then}.')
  with contextlib.suppress(Exception):
    sys.stdout.flush()
  print(line, file=sys.stderr, flush=True)
  if jax.process_index() == 0 and count - 1 - len(lost) > 0:
    # Process 0 hosts the coordination service: leaving first would make jax abort the other
    # survivors before they print their line. They find the same lost process within two
    # heartbeats.
    time.sleep(2 * interval + 1)
  os._exit(EXIT_LOST_PEER)


@contextlib.contextmanager
def processes(coordinator_address: str | None = None, num_processes: int | None = None,
              process_id: int | None = None,
              heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT):
  """Around a program (its entry point's): jax.distributed initialized when this is one of several
  processes (given, or a SLURM / Open MPI launch), and the heartbeat that reports a lost process;
  nothing for a single process. An error that may come from a lost process (a collective failing
  because its peer is gone) waits for the heartbeat's verdict, which prints its line and exits;
  other errors, and this one if no process was lost, go on as they are. On every way out the
  heartbeat is stopped and its thread joined."""
  watchdog = _initialize(coordinator_address, num_processes, process_id, heartbeat_timeout)
  try:
    yield
  except Exception as e:
    if watchdog is not None and _from_lost_peer(e):
      watchdog.lost.wait(watchdog.timeout + 4 * watchdog.interval + 5)
      if watchdog.lost.is_set():  # the heartbeat thread is printing its line and exiting
        time.sleep(3600)
    raise
  finally:
    if watchdog is not None:
      watchdog.stop()


def _initialize(coordinator_address: str | None, num_processes: int | None,
                process_id: int | None, heartbeat_timeout: float) -> _Watchdog | None:
  """jax.distributed.initialize and the heartbeat's thread, when there are several processes."""
  explicit = coordinator_address is not None or (num_processes or 1) > 1
  launched = any(int(os.environ.get(v, '1')) > 1 for v in _LAUNCHER_VARIABLES)
  if not (explicit or launched):
    return None
  # CPU-only multi-process runs (tests, debugging) need a collectives backend; GPUs use NCCL.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # jax's own timeout later than ours: its abort only if our heartbeat thread could not run.
  jax_timeout = int(2 * heartbeat_timeout + 10)
  if explicit:
    jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                               process_id=process_id, heartbeat_timeout_seconds=jax_timeout)
  else:
    jax.distributed.initialize(heartbeat_timeout_seconds=jax_timeout)  # SLURM / Open MPI
  from absl import logging  # noqa: PLC0415
  logging.warning('process %d of %d, %d local devices', jax.process_index(),
                  jax.process_count(), jax.local_device_count())
  client = _client()
  if client is None or jax.process_count() == 1:
    return None
  return _Watchdog(client, heartbeat_timeout)


def _from_lost_peer(error: BaseException) -> bool:
  """Whether an error may come from a peer that went away (a failed collective)."""
  return any(_PEER_ERROR.search(f'{type(e).__name__}: {e}') for e in errors.chain(error))
