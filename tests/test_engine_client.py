"""The engine client's requests without a model: a reader that falls behind holds one update per
sequence (the latest), and a request the server is done with is freed at once (no reference
cycle left for the garbage collector, whose full collections stall the event loop)."""
import asyncio
import gc
import weakref

from jax_pretrain.engine import client as client_lib
from jax_pretrain.engine.sequence import Sequence

TOKENS = 400


def _decode(sequences: list[Sequence]) -> None:
  """What the engine's thread does to a request's sequences: a token (a character) at a time,
  each reported, then their ends."""
  for _ in range(TOKENS):
    for seq in sequences:
      seq.tokens.append(65)
      seq.text += 'A'
      seq.on_update(seq)
  for seq in sequences:
    seq.finish_reason = 'length'
    seq.on_update(seq)


def test_a_stream_whose_reader_stalls_buffers_one_update_per_sequence():
  async def stalled():
    sequences = [Sequence([1], TOKENS), Sequence([2], TOKENS)]
    request = client_lib.Request(sequences, stream=True)
    await asyncio.to_thread(_decode, sequences)  # nobody reads meanwhile
    return [update async for update in request.updates()]

  updates = asyncio.run(stalled())
  # What waited for the reader: each sequence's whole text once, not 400 snapshots of it (80,400
  # characters a sequence before: quadratic in its length).
  assert sum(len(u.text) for u in updates) <= 2 * TOKENS, len(updates)
  assert {u.index: (u.text, u.finish) for u in updates} == {
      0: ('A' * TOKENS, 'length'), 1: ('A' * TOKENS, 'length')}


def test_a_reader_that_keeps_up_gets_every_update_in_order():
  async def reading():
    sequences = [Sequence([1], TOKENS)]
    request = client_lib.Request(sequences, stream=True)
    thread = asyncio.create_task(asyncio.to_thread(_decode, sequences))
    texts = [update.text async for update in request.updates()]
    await thread
    return texts

  texts = asyncio.run(reading())
  assert texts[-1] == 'A' * TOKENS
  assert all(a == b[:len(a)] and len(a) <= len(b) for a, b in zip(texts, texts[1:]))


def test_a_request_the_server_is_done_with_is_freed_without_a_collection():
  async def served() -> weakref.ref:
    sequences = [Sequence([1], TOKENS), Sequence([2], TOKENS)]
    request = client_lib.Request(sequences, stream=True)
    _decode(sequences)  # (in this thread: the reports queue on the loop)
    await asyncio.sleep(0)
    async for _ in request.updates():
      pass
    request.cancel()  # as serve does once the answer is sent
    return weakref.ref(request)

  gc.collect()
  gc.disable()
  try:
    request = asyncio.run(served())
    assert request() is None  # freed by its reference count: no cycle through its sequences
  finally:
    gc.enable()
