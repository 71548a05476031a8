"""Batched decoding and scoring of many requests at once: the decoder behind the server (serve.py)
and the harness (lm_eval.py).

Generation (Engine): a fixed number of slots, each a row of one KV cache [layers, slots, context,
kv_heads, head_dim] allocated once, so memory is bounded by slots × context whatever the traffic.
A request (a Sequence) waits until a slot is free; its prompt is then prefilled into that slot's
row, and it decodes together with every other busy slot, up to `chunk` tokens per compiled call.
Between calls the host takes the new tokens, ends sequences at EOS, at max_new_tokens or at a stop
string, reports new text to the sequence's callback (streaming), frees the slots of finished
sequences and admits waiting ones: sequences join and leave the batch every chunk (continuous
batching), so a short request never waits for a long one to finish.

Compiled shapes are bucketed, so that traffic does not recompile: a prefill pads its prompts to a
power of two tokens (16 at least, the context at most) and its rows to a power of two; a decode
call covers the first 1, 2, 4, ... slots, as many as cover the busy ones (a new sequence takes the
lowest free slot); the number of steps of a call is traced, not static. The positions of a row
work as in sample.py: each row has its own length and positions in its own cache row.

Each row samples with its own settings and its own random stream (its seed, folded with its index
among the choices of one request and with the token's index), so a sequence's tokens do not depend
on which other sequences were decoded beside it.

Scoring (token_logprobs): the log-probability of every next token of a batch of rows in one forward
pass, for lm_eval's loglikelihood requests and for the logprobs of an echoed prompt.
"""
import collections
import dataclasses
import functools
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_pretrain import model as model_lib
from jax_pretrain import sample as sample_lib

MIN_BUCKET = 16
TOP_N = 5  # alternatives reported per generated token (OpenAI's logprobs allows at most 5)


def bucket(n: int, limit: int, smallest: int = 1) -> int:
  """The power of two >= n (and >= smallest), or limit when that is smaller: few distinct shapes."""
  return min(limit, max(smallest, 1 << (max(n, 1) - 1).bit_length()))


@dataclasses.dataclass(eq=False)
class Sequence:
  """One generation: what was asked, then what the engine fills in as it decodes."""
  prompt: list[int]
  max_new_tokens: int
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0  # 0: no top-k cut
  top_p: float = 1.0  # 1.0: no nucleus cut
  seed: int = 0
  stream: int = 0  # index among the choices of one request: the same seed, other samples
  stop: tuple[str, ...] = ()  # the text ends before the first of these
  on_update: Callable[['Sequence'], None] | None = None  # called (engine thread) on new text or end
  # Filled by the engine.
  tokens: list[int] = dataclasses.field(default_factory=list)  # new tokens, EOS excluded
  logprobs: list[float] = dataclasses.field(default_factory=list)  # of each new token
  eos_logprob: float | None = None  # of the EOS that ended it, if one did (GRPO trains on it)
  top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
  text: str = ''  # the decoded new tokens, cut before a stop string
  finish_reason: str | None = None  # 'stop' (EOS or stop string) | 'length' | 'cancelled' | 'error'
  error: str = ''
  cancelled: bool = False  # set by the caller (a client went away): dropped at the next chunk

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  def stable_text(self) -> str:
    """The text that later tokens will not change, for streaming: while decoding, holds back an
    unfinished UTF-8 character and an ending that may be the start of a stop string."""
    text = self.text
    if self.done:
      return text
    keep = len(text.rstrip('\ufffd'))
    for s in self.stop:
      for k in range(min(len(s) - 1, len(text)), 0, -1):
        if text.endswith(s[:k]):
          keep = min(keep, len(text) - k)
          break
    return text[:keep]


@functools.partial(jax.jit, static_argnames=('model', 'top_n'))
def token_logprobs(model, params, tokens_BxT1, *, top_n: int = 0):
  """For inputs tokens[:, :-1] and targets tokens[:, 1:]: (log-probability of each target, float32
  [B, T]; whether it is the most likely token, [B, T]; and when top_n, the top_n most likely tokens
  (logprobs [B, T, top_n], ids [B, T, top_n])). Over the whole vocabulary, as Hugging Face
  models score, so that the numbers compare."""
  logits_BxTxV = model.apply({'params': params}, tokens_BxT1[:, :-1]).astype(jnp.float32)
  logprobs_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
  targets_BxT = tokens_BxT1[:, 1:]
  target_BxT = jnp.take_along_axis(logprobs_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
  greedy_BxT = jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT
  top = jax.lax.top_k(logprobs_BxTxV, top_n) if top_n else None
  return target_BxT, greedy_BxT, top


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty(config: model_lib.ModelConfig, slots: int, context: int):
  """The engine's cache and last logits, zero."""
  return (model_lib.KVCache.zeros(config, slots, context),
          jnp.zeros((slots, config.vocab_size), jnp.float32))


@functools.partial(jax.jit, static_argnames=('model',), donate_argnums=(2, 3))
def _prefill(model, params, cache, logits_SxV, prompts_NxP, lengths_N, slots_N, allowed_V):
  """Runs the prompts, right-padded, into a fresh cache of their length and copies it into their
  slots' rows; keeps each prompt's last logits. Padding rows have slot == slots: dropped."""
  N, P = prompts_NxP.shape
  fresh = model_lib.KVCache.zeros(model.config, N, P)
  positions_NxP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (N, P))
  logits_NxPxV, fresh = model.apply({'params': params}, prompts_NxP, fresh, positions_NxP)
  last_NxV = jnp.where(allowed_V, logits_NxPxV[jnp.arange(N), lengths_N - 1], -jnp.inf)
  cache = model_lib.KVCache(
      cache.k_LxBxSxKxH.at[:, slots_N, :P].set(fresh.k_LxBxSxKxH, mode='drop'),
      cache.v_LxBxSxKxH.at[:, slots_N, :P].set(fresh.v_LxBxSxKxH, mode='drop'))
  return cache, logits_SxV.at[slots_N].set(last_NxV, mode='drop')


@functools.partial(jax.jit, static_argnames=('model', 'rows', 'chunk'), donate_argnums=(2, 3))
def _decode(model, params, cache, logits_SxV, positions_R, seeds_R, streams_R, counts_R,
            temperature_R, top_k_R, top_p_R, allowed_V, steps, *, rows: int, chunk: int):
  """`steps` (<= chunk) decoding steps of the first `rows` slots: each step samples a token per row
  from its logits and runs it at the row's next position. Returns the updated cache and logits,
  the tokens [R, chunk], their logprobs [R, chunk] and the TOP_N alternatives [R, chunk, TOP_N]."""
  context = cache.k_LxBxSxKxH.shape[2]
  sub = model_lib.KVCache(cache.k_LxBxSxKxH[:, :rows], cache.v_LxBxSxKxH[:, :rows])
  streams_R = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds_R, streams_R)

  def body(i, state):
    sub, logits_RxV, tokens_RxC, logprobs_RxC, top_lp_RxCxN, top_ids_RxCxN = state
    keys_R = jax.vmap(jax.random.fold_in)(streams_R, counts_R + i)
    token_R = sample_lib.sample_rows(logits_RxV, keys_R, temperature_R, top_k_R, top_p_R)
    all_RxV = jax.nn.log_softmax(logits_RxV, axis=-1)
    top_lp_RxN, top_ids_RxN = jax.lax.top_k(all_RxV, TOP_N)
    # A row past its end (finished within this call) keeps writing its last slot: never read.
    positions_Rx1 = jnp.minimum(positions_R + i, context - 1)[:, None]
    logits_Rx1xV, sub = model.apply({'params': params}, token_R[:, None], sub, positions_Rx1)
    return (sub, jnp.where(allowed_V, logits_Rx1xV[:, 0], -jnp.inf),
            tokens_RxC.at[:, i].set(token_R),
            logprobs_RxC.at[:, i].set(jnp.take_along_axis(all_RxV, token_R[:, None], -1)[:, 0]),
            top_lp_RxCxN.at[:, i].set(top_lp_RxN), top_ids_RxCxN.at[:, i].set(top_ids_RxN))

  state = (sub, logits_SxV[:rows], jnp.zeros((rows, chunk), jnp.int32),
           jnp.zeros((rows, chunk), jnp.float32), jnp.zeros((rows, chunk, TOP_N), jnp.float32),
           jnp.zeros((rows, chunk, TOP_N), jnp.int32))
  sub, logits_RxV, *out = jax.lax.fori_loop(0, steps, body, state)
  cache = model_lib.KVCache(cache.k_LxBxSxKxH.at[:, :rows].set(sub.k_LxBxSxKxH),
                            cache.v_LxBxSxKxH.at[:, :rows].set(sub.v_LxBxSxKxH))
  return cache, logits_SxV.at[:rows].set(logits_RxV), *out


class Engine:
  """Continuous batching over a bounded KV cache (see the module docstring).

  Two ways to drive it: `generate(sequences)` runs them to the end in the calling thread (the
  harness); `run_forever()` in a thread of its own serves sequences that any thread `submit`s
  (the server), calling each sequence's on_update from that thread.
  """

  def __init__(self, model_config: model_lib.ModelConfig, params, tokenizer, *, slots: int = 16,
               context: int, chunk: int = 8, prefill_tokens: int = 4096):
    self.model = sample_lib.decoding_model(model_config)
    self.params, self.tokenizer = params, tokenizer
    self.slots, self.context, self.chunk = slots, context, chunk
    self.prefill_tokens = max(prefill_tokens, context)  # prompt tokens per prefill call at most
    ids_V = np.arange(model_config.vocab_size)
    self._allowed_V = jnp.asarray((ids_V < tokenizer.vocab_size) & (ids_V != tokenizer.pad_id))
    self._cache = self._logits_SxV = None  # allocated at the first use (_state)
    self._busy: list[Sequence | None] = [None] * slots
    self._waiting: collections.deque[Sequence] = collections.deque()
    self._wakeup = threading.Condition()
    self._stopping = False
    self.shapes: set[tuple] = set()  # the compiled shapes asked for so far
    self.tokens_generated = 0

  def warmup(self) -> None:
    """Compiles every shape that traffic can ask for (prefills of 1, 2, 4, ... rows of each length
    bucket, decodes of each row bucket), so that no request waits for a compile. Changes no
    sequence: these prefills write to no slot and these decodes run no step."""
    for P in sorted({bucket(n, self.context, MIN_BUCKET) for n in range(1, self.context + 1)}):
      most = self._most_rows(P)
      for N in sorted({bucket(n, most) for n in range(1, most + 1)}):
        self._prefill(np.zeros((N, P), np.int32), np.ones(N, np.int32),
                      np.full(N, self.slots, np.int32))
    for rows in sorted({bucket(n, self.slots) for n in range(1, self.slots + 1)}):
      self._decode(rows, [], 0)

  def submit(self, seq: Sequence) -> None:
    """Queues a sequence (thread-safe). Its prompt and max_new_tokens must fit the context."""
    if not seq.prompt or len(seq.prompt) + seq.max_new_tokens > self.context:
      raise ValueError(f'a prompt of {len(seq.prompt)} tokens and {seq.max_new_tokens} new tokens '
                       f'do not fit the context of {self.context} tokens')
    if seq.max_new_tokens <= 0:
      self._finish(seq, 'length')
      return
    with self._wakeup:
      self._waiting.append(seq)
      self._wakeup.notify()

  def stats(self) -> dict:
    return {'slots': self.slots, 'context': self.context, 'busy': sum(s is not None for s in
            self._busy), 'waiting': len(self._waiting), 'compiled_shapes': len(self.shapes),
            'tokens_generated': self.tokens_generated}

  def generate(self, sequences: list[Sequence]) -> list[Sequence]:
    for seq in sequences:
      self.submit(seq)
    while self.step():
      pass
    return sequences

  def run_forever(self) -> None:
    """Serves submitted sequences until stop(). A failing step fails the sequences it held (with
    their error) and the engine goes on with the next ones."""
    while True:
      with self._wakeup:
        while not self._stopping and not self._waiting and not any(self._busy):
          self._wakeup.wait()
        if self._stopping:
          return
      try:
        self.step()
      except Exception as e:  # noqa: BLE001  (reported to each request)
        for i, seq in enumerate(self._busy):
          if seq is not None:
            seq.error = f'{type(e).__name__}: {e}'
            self._finish(seq, 'error')
            self._busy[i] = None
        self._cache = self._logits_SxV = None  # donated buffers may be gone: start afresh

  def stop(self) -> None:
    with self._wakeup:
      self._stopping = True
      self._wakeup.notify()

  def step(self) -> bool:
    """Admits waiting sequences into free slots, then decodes one chunk of every busy slot.
    Returns whether anything is left to do."""
    self._admit()
    busy = [i for i, seq in enumerate(self._busy) if seq is not None]
    if not busy:
      return bool(self._waiting)
    steps = max(min(self.chunk, seq.max_new_tokens - len(seq.tokens))
                for seq in (self._busy[i] for i in busy))
    tokens_RxC, logprobs_RxC, top_lp_RxCxN, top_ids_RxCxN = self._decode(
        bucket(busy[-1] + 1, self.slots), busy, steps)
    for i in busy:
      seq = self._busy[i]
      self._extend(seq, tokens_RxC[i, :steps], logprobs_RxC[i], top_lp_RxCxN[i], top_ids_RxCxN[i])
      if seq.done:
        self._busy[i] = None
    return True

  def _admit(self) -> None:
    """Moves waiting sequences into free slots and prefills them, a bucket of lengths at a time."""
    admitted = []
    with self._wakeup:
      for i in range(self.slots):
        while self._busy[i] is None and self._waiting:
          seq = self._waiting.popleft()
          if seq.cancelled:
            self._finish(seq, 'cancelled')
            continue
          self._busy[i] = seq
          admitted.append(i)
    by_length = collections.defaultdict(list)
    for i in admitted:
      by_length[bucket(len(self._busy[i].prompt), self.context, MIN_BUCKET)].append(i)
    for P, slots in sorted(by_length.items()):
      most = self._most_rows(P)
      for start in range(0, len(slots), most):
        group = slots[start:start + most]
        N = bucket(len(group), most)
        prompts_NxP = np.full((N, P), self.tokenizer.pad_id, np.int32)
        lengths_N, slots_N = np.ones(N, np.int32), np.full(N, self.slots, np.int32)
        for r, i in enumerate(group):
          prompt = self._busy[i].prompt
          prompts_NxP[r, :len(prompt)], lengths_N[r], slots_N[r] = prompt, len(prompt), i
        self._prefill(prompts_NxP, lengths_N, slots_N)

  def _most_rows(self, P: int) -> int:
    """Prompts per prefill call at most for prompts padded to P: a power of two that keeps the
    call within prefill_tokens (its logits are [rows, P, vocab]), and no more than the slots
    need."""
    fitting = 1 << (max(1, self.prefill_tokens // P).bit_length() - 1)
    return min(fitting, bucket(self.slots, 1 << 30))

  def _state(self):
    """The cache and last logits, allocated at the first use, where the params are (replicated
    over their mesh, if any), as the arrays that replace them will be: so the first and later
    calls of a shape share one compile."""
    if self._cache is None:
      self._cache, self._logits_SxV = jax.device_put(
          _empty(self.model.config, self.slots, self.context), self._where())
    return self._cache, self._logits_SxV

  def _where(self):
    """Where the cache and logits live: where the params are, replicated over their mesh."""
    where = jax.tree.leaves(self.params)[0].sharding
    if isinstance(where, jax.sharding.NamedSharding):
      where = jax.sharding.NamedSharding(where.mesh, jax.P())
    return where

  def abstract_state(self):
    """The cache and last logits as _state places them, abstract (ShapeDtypeStructs with their
    sharding): nothing is allocated. The params may be abstract too (with their shardings)."""
    where = self._where()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                        jax.eval_shape(_empty, self.model.config, self.slots, self.context))

  def largest_prefill(self, prompt_tokens: int) -> tuple[int, int]:
    """(rows, length) of the largest prefill call that prompts of at most prompt_tokens tokens
    can ask for (_admit's buckets)."""
    P = bucket(prompt_tokens, self.context, MIN_BUCKET)
    return self._most_rows(P), P

  def lower_prefill(self, rows: int, length: int):
    """The prefill call of `rows` prompts padded to `length` tokens, lowered (not run) with this
    engine's params and abstract_state: what that call compiles, e.g. for a GPU this machine does
    not have (plan.py). As warmup's prefills, it writes to no slot."""
    inputs = (np.zeros((rows, length), np.int32), np.ones(rows, np.int32),
              np.full(rows, self.slots, np.int32))
    return _prefill.lower(self.model, self.params, *self.abstract_state(), *_abstract(inputs),
                          _abstract(self._allowed_V))

  def lower_decode(self, rows: int):
    """The decode call of the first `rows` slots (up to `chunk` steps), lowered as lower_prefill
    lowers its call."""
    return _decode.lower(self.model, self.params, *self.abstract_state(),
                         *_abstract(self._decode_inputs(rows, [])), _abstract(self._allowed_V),
                         _abstract(np.int32(self.chunk)), rows=rows, chunk=self.chunk)

  def _prefill(self, prompts_NxP, lengths_N, slots_N) -> None:
    self.shapes.add(('prefill', *prompts_NxP.shape))
    self._cache, self._logits_SxV = _prefill(self.model, self.params, *self._state(),
                                             prompts_NxP, lengths_N, slots_N, self._allowed_V)

  def _decode_inputs(self, rows: int, busy: list[int]) -> tuple:
    """The per-row inputs of a decode call (positions, seeds, streams, counts, temperature, top_k,
    top_p) of the first `rows` slots, of which `busy` hold sequences."""
    positions, streams, counts, top_k = (np.zeros(rows, np.int32) for _ in range(4))
    seeds, temperature, top_p = (np.zeros(rows, np.uint32), np.zeros(rows, np.float32),
                                 np.ones(rows, np.float32))
    for i in busy:
      seq = self._busy[i]
      positions[i] = len(seq.prompt) + len(seq.tokens)
      seeds[i], streams[i], counts[i] = seq.seed % 2**32, seq.stream, len(seq.tokens)
      temperature[i], top_k[i], top_p[i] = seq.temperature, seq.top_k, seq.top_p
    return positions, seeds, streams, counts, temperature, top_k, top_p

  def _decode(self, rows: int, busy: list[int], steps: int):
    """`steps` decoding steps of the first `rows` slots, of which `busy` hold sequences: their
    tokens [rows, chunk], logprobs [rows, chunk] and alternatives [rows, chunk, TOP_N]."""
    self.shapes.add(('decode', rows))
    self._cache, self._logits_SxV, *out = _decode(
        self.model, self.params, *self._state(), *self._decode_inputs(rows, busy),
        self._allowed_V, np.int32(steps), rows=rows, chunk=self.chunk)
    return jax.device_get(out)

  def _extend(self, seq: Sequence, tokens, logprobs, top_lp_CxN, top_ids_CxN) -> None:
    """Appends a chunk's tokens to a sequence, up to EOS, max_new_tokens or a stop string."""
    if seq.cancelled:
      self._finish(seq, 'cancelled')
      return
    before, reason = len(seq.tokens), None
    for j, token in enumerate(tokens.tolist()):
      if token == self.tokenizer.eos_id:
        seq.eos_logprob, reason = float(logprobs[j]), 'stop'
        break
      seq.tokens.append(token)
      seq.logprobs.append(float(logprobs[j]))
      seq.top_logprobs.append(list(zip(top_ids_CxN[j].tolist(), top_lp_CxN[j].tolist())))
      if len(seq.tokens) == seq.max_new_tokens:
        reason = 'length'
        break
    text = self.tokenizer.decode(seq.tokens)
    cut = _first_stop(text, seq.stop)
    if cut is not None:
      # Keep the tokens up to the one that completed the stop string.
      n = next(n for n in range(before + 1, len(seq.tokens) + 1)
               if _first_stop(self.tokenizer.decode(seq.tokens[:n]), seq.stop) is not None)
      del seq.tokens[n:], seq.logprobs[n:], seq.top_logprobs[n:]
      text, reason = text[:cut], 'stop'
      seq.eos_logprob = None  # it ends at the stop string: an EOS sampled later is not its own
    seq.text = text  # once: a reader in another thread never sees a stop string in it
    self.tokens_generated += len(seq.tokens) - before
    if reason:
      self._finish(seq, reason)
    elif seq.on_update:
      seq.on_update(seq)

  @staticmethod
  def _finish(seq: Sequence, reason: str) -> None:
    seq.finish_reason = reason
    if seq.on_update:
      seq.on_update(seq)


def _abstract(tree):
  """ShapeDtypeStructs of host arrays, unplaced (jit places them as it places the arrays)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _first_stop(text: str, stop) -> int | None:
  """Where the earliest stop string starts in text, or None."""
  found = [i for i in (text.find(s) for s in stop if s) if i >= 0]
  return min(found) if found else None
