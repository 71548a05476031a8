"""Host batches put on the devices ahead of use, by a background thread."""
import queue
import threading

import jax


class Prefetcher:
  """Reads host batches in a background thread and puts them on the devices ahead of use.

  Yields global device batches, in order: each process's rows of a batch ({name: host array})
  become one array sharded by `batch_sharding` (jax.make_array_from_process_local_data).
  """

  def __init__(self, iterator, batch_sharding, depth: int = 2):
    self._iterator, self._sharding = iterator, batch_sharding
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    try:
      while not self._stop.is_set():
        host = next(self._iterator)
        self._queue.put({k: jax.make_array_from_process_local_data(self._sharding, v)
                         for k, v in host.items()})
    except Exception as e:  # noqa: BLE001  (re-raised in the consumer)
      self._queue.put(e)

  def __iter__(self):
    return self

  def __next__(self):
    item = self._queue.get()
    if isinstance(item, Exception):
      raise item
    return item

  def close(self):
    self._stop.set()
    while self._thread.is_alive():
      try:
        self._queue.get_nowait()
      except queue.Empty:
        self._thread.join(timeout=0.1)
