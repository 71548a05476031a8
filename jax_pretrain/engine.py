"""Batched decoding and scoring of many requests at once: the one decoder behind GRPO's rollouts
(grpo/rollout.py), the server (serve.py), the harness (lm_eval.py), task evaluation and sample.py.

Generation (Engine): a fixed number of slots, each a row of one KV cache (a buffer [slots, context,
kv_heads, head_dim] per layer) allocated once, so memory is bounded by slots × context whatever the
traffic. A request (a Sequence) waits until a slot is free; its prompt is then prefilled into that
slot's row, and it decodes together with every other busy slot, up to `chunk` tokens per compiled
call. Between calls the host takes the new tokens, ends sequences at EOS, at max_new_tokens or at a
stop string, reports new text to the sequence's callback (streaming), frees the slots of finished
sequences and admits waiting ones: sequences join and leave the batch every chunk (continuous
batching), so a short request never waits for a long one to finish.

What a decoding step moves, and nothing more: the engine holds its own copy of the params, every
matrix in the compute dtype and the layers apart (decoding_params: converted once, when the params
change: GRPO, once a step), so a step reads bf16 weights (on a GPU) once instead of casting float32
ones; the cache's buffers are donated to each call and written in place (a scatter of the new
positions), never copied; and the attention reads only the live part of each row (positions [0,
live), live a bucket that covers the longest busy row), not the whole context.

On a mesh (GRPO on the trainer's devices) the slots and the cache are split over every device of
it, and each device prefills and decodes its own rows with a whole copy of the weights (shard_map:
no communication but gathering the new tokens); `slots` counts them over all devices. Several
processes run the same host logic on the same (replicated) tokens.

Compiled shapes are bucketed, so that traffic does not recompile: a prefill pads its prompts to a
power of two tokens (16 at least, the context at most) and its rows to a power of two; a decode
call covers each device's first 1, 2, 4, ... slots, as many as cover the busy ones (a new sequence
takes the free slot of lowest index on its device, spreading over the devices), with a live length
of a power of two or 1.5 × one (live_bucket); the number of steps of a call is traced, not
static. Sampling's top-k/top-p cut and the top-5 alternatives are compiled in only for calls whose
rows ask for them.

Positions: each row has its own length and positions in its own cache row. A prefill runs its
prompts right-padded to P (pad positions write junk into the row beyond its prompt); a row's first
new token is sampled from the logits at its position len - 1, and decode step i writes its token at
position len + i, overwriting that junk before any query can see it (the causal mask only shows a
query the positions at or before its own). So every row sees exactly its own prompt and its own
continuation, at the positions it would have alone.

Each row samples with its own settings and its own random stream (its seed, folded with its index
among the choices of one request and with the token's index), so a sequence's tokens do not depend
on which other sequences were decoded beside it, nor on the mesh.

Failures (run_forever, the server's loop): a sequence's on_update callback that raises fails that
sequence only ('error'; the callback is told once more, and the traceback logged), never the engine
or the other sequences. A step that raises (a compiled prefill or decode, or the host work between
them) fails the sequences of that call, and the engine goes on with a fresh cache; after
MAX_FAILURES steps failed in a row (nothing decoded between them: the device or the program is
broken, not one request) run_forever gives up: it raises EngineFailed, for its caller to exit.
However run_forever ends (stop(), giving up), every sequence it held or that still waits ends with
'error' and STOPPED, and submit refuses new ones (EngineStopped): nothing is left waiting.

Scoring (token_logprobs, Engine.score): the log-probability of every next token of a batch of rows
in one forward pass, for lm_eval's loglikelihood requests and for the logprobs of an echoed prompt.
"""
import collections
import dataclasses
import functools
import threading
from typing import Callable

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jax_pretrain import model as model_lib
from jax_pretrain import multihost

MIN_BUCKET = 16
TOP_N = 5  # alternatives reported per generated token (OpenAI's logprobs allows at most 5)
MAX_FAILURES = 3  # steps failing in a row after which run_forever gives up
STOPPED = 'the engine stopped before this sequence finished'  # Sequence.error when it did


class EngineStopped(RuntimeError):
  """submit after stop() or after run_forever ended: the engine takes no more sequences."""


class EngineFailed(RuntimeError):
  """run_forever gave up: MAX_FAILURES steps failed in a row (the last one is the __cause__)."""


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
  alternatives: bool = False  # fill top_logprobs (the TOP_N most likely tokens at each step)
  # Called on new text and at the end, from the engine's thread (from stop()'s for a sequence
  # still waiting then). One that raises fails its sequence (see the module docstring).
  on_update: Callable[['Sequence'], None] | None = None
  # Filled by the engine.
  tokens: list[int] = dataclasses.field(default_factory=list)  # new tokens, EOS excluded
  logprobs: list[float] = dataclasses.field(default_factory=list)  # of each new token
  eos_logprob: float | None = None  # of the EOS that ended it, if one did (GRPO trains on it)
  top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
  text: str = ''  # the decoded new tokens, cut before a stop string
  finish_reason: str | None = None  # 'stop' (EOS or stop string) | 'length' | 'cancelled' | 'error'
  error: str = ''
  cancelled: bool = False  # set by the caller (a client went away): dropped at the next chunk
  # Incremental detokenization: the text of tokens[:_read] is _decoded; _prefix <= _read starts
  # the few tokens decoded again to continue it (a tokenizer may print a token differently at the
  # start of a text), so that a chunk decodes a handful of tokens, not the whole sequence.
  _decoded: str = dataclasses.field(default='', repr=False)
  _prefix: int = dataclasses.field(default=0, repr=False)
  _read: int = dataclasses.field(default=0, repr=False)

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

  def detokenize(self, tokenizer, final: bool = False) -> str:
    """The text of self.tokens, decoding only the tokens since the last call (and the few before
    them that the tokenizer needs to continue the text). An unfinished UTF-8 character at the end
    is left out of the text (the text before it is there, for stop strings and streaming) and its
    tokens are decoded again with the next ones. final: the whole sequence, decoded once."""
    if final:
      self._decoded = tokenizer.decode(self.tokens)
      self._prefix = self._read = len(self.tokens)
      return self._decoded
    window = tokenizer.decode(self.tokens[self._prefix:])
    new = window[len(tokenizer.decode(self.tokens[self._prefix:self._read])):]
    if new.endswith('\ufffd'):  # an unfinished character: its bytes come with the next tokens
      return self._decoded + new.rstrip('\ufffd')
    self._decoded += new
    self._prefix, self._read = self._read, len(self.tokens)
    return self._decoded


def filter_logits(logits_BxV: jax.Array, temperature, top_k, top_p, cuts: bool = True
                  ) -> jax.Array:
  """Logits divided by the temperature, with the tokens outside the top_k and then outside the
  top_p set to -inf, float32.

  The settings are numbers (one for the whole batch) or arrays [B] (one per row: the server decodes
  requests with different settings together). top_k 0 and top_p 1.0 cut nothing; cuts=False
  (static) leaves the cut out of the program (its sort), for calls that know no row asks for it.
  """
  temperature_Bx1, top_k_Bx1, top_p_Bx1 = (jnp.reshape(jnp.asarray(x), (-1, 1))
                                           for x in (temperature, top_k, top_p))
  logits_BxV = logits_BxV.astype(jnp.float32) / temperature_Bx1
  if not cuts:
    return logits_BxV
  V = logits_BxV.shape[-1]

  def threshold():
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    k_Bx1 = jnp.where((top_k_Bx1 > 0) & (top_k_Bx1 < V), top_k_Bx1, V)
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, k_Bx1 - 1, axis=-1)
    sorted_BxV = jnp.where(sorted_BxV < kth_Bx1, -jnp.inf, sorted_BxV)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    # Keep a token while the tokens more likely than it hold less than top_p: always >= 1 kept.
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    n_kept_Bx1 = jnp.sum(before_BxV < top_p_Bx1, axis=-1, keepdims=True)
    n_kept_Bx1 = jnp.where(top_p_Bx1 < 1.0, n_kept_Bx1, V)
    return jnp.maximum(kth_Bx1, jnp.take_along_axis(sorted_BxV, n_kept_Bx1 - 1, axis=-1))

  # The sort is the costly part of a decoding step on the CPU: skipped when nothing is cut.
  any_cut = jnp.any((top_k_Bx1 > 0) & (top_k_Bx1 < V)) | jnp.any(top_p_Bx1 < 1.0)
  threshold_Bx1 = jax.lax.cond(any_cut, threshold,
                               lambda: jnp.full((logits_BxV.shape[0], 1), -jnp.inf))
  return jnp.where(logits_BxV < threshold_Bx1, -jnp.inf, logits_BxV)


def sample_rows(logits_BxV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array,
                top_k_B: jax.Array, top_p_B: jax.Array, cuts: bool = True) -> jax.Array:
  """Next token per row, int32 [B], each row with its own settings and its own key, so that a
  request's tokens do not depend on the other requests decoded beside it. Temperature 0: greedy.
  cuts: as filter_logits takes it."""
  sampled_B = jax.vmap(lambda key, logits_V: jax.random.categorical(key, logits_V))(
      keys_B, filter_logits(logits_BxV, jnp.where(temperature_B > 0, temperature_B, 1.0),
                            top_k_B, top_p_B, cuts))
  greedy_B = jnp.argmax(logits_BxV, axis=-1)
  return jnp.where(temperature_B > 0, sampled_B, greedy_B).astype(jnp.int32)


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


def decoding_params(config: model_lib.ModelConfig, params):
  """The engine's copy of a model's params: the layers apart (layers_0, layers_1, ...: the
  unscanned model writes each layer's cache in place) and every matrix in the compute dtype (the
  model casts it there at every use: the same numbers, cast once). Vectors (norm scales) stay."""
  params = dict(params)
  if 'layers' in params:
    layers = params.pop('layers')
    for i in range(config.num_layers):
      params[f'layers_{i}'] = jax.tree.map(lambda x, i=i: x[i], layers)
  cast = lambda x: x.astype(config.compute_dtype) if x.ndim >= 2 and jnp.issubdtype(
      x.dtype, jnp.floating) else x
  return jax.tree.map(cast, params)


def _decoding_model(config: model_lib.ModelConfig) -> model_lib.Transformer:
  """No remat (nothing is differentiated), unscanned (each layer's cache apart), no mesh (the
  engine maps it over its devices)."""
  return model_lib.Transformer(dataclasses.replace(config, remat='none', scan_layers=False))


def cache_bytes(config: model_lib.ModelConfig, slots: int, context: int, devices: int) -> float:
  """Bytes one device holds of an engine's cache and last logits (`slots` over `devices`)."""
  local = -(-slots // devices)
  kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * (
      config.compute_dtype.itemsize)
  return float(local * (context * kv + config.vocab_size * 4))


def live_bucket(n: int, context: int) -> int:
  """Positions a decode call's attention reads: the smallest power of two or 1.5 × a power of
  two that is >= n (MIN_BUCKET at least, the context at most): at most a third more than the
  longest row needs (half with powers of two alone), for twice the compiled shapes."""
  p = bucket(n, 1 << 62, MIN_BUCKET)
  return min(context, 3 * p // 4 if 3 * p // 4 >= n and p > MIN_BUCKET else p)


def _prefill_local(model, params, cache, logits_SxV, prompts_NxP, lengths_N, slots_N, allowed_V):
  """One device's prefill: its prompts, right-padded, run through the model (causal attention over
  themselves), their keys and values written into their slots' rows, each one's last logits kept.
  Padding rows have slot == the device's slots: dropped."""
  N, P = prompts_NxP.shape
  positions_NxP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (N, P))
  use = model_lib.CacheUse(positions_NxP, slots_B=slots_N, logits_at_B=lengths_N - 1)
  logits_Nx1xV, cache = model.apply({'params': params}, prompts_NxP, cache, use)
  last_NxV = jnp.where(allowed_V, logits_Nx1xV[:, 0], -jnp.inf)
  return cache, logits_SxV.at[slots_N].set(last_NxV, mode='drop')


def _decode_local(model, params, cache, logits_SxV, positions_R, seeds_R, streams_R, counts_R,
                  temperature_R, top_k_R, top_p_R, allowed_V, steps, *, chunk: int, live: int,
                  top_n: int, cuts: bool):
  """One device's `steps` (<= chunk) decoding steps of its first R slots: each step samples a
  token per row from its logits and runs it at the row's next position, attending over positions
  [0, live). Returns the updated cache and logits, the tokens [R, chunk], their logprobs
  [R, chunk] and with top_n the top_n alternatives ([R, chunk, top_n] logprobs and ids)."""
  R = positions_R.shape[0]
  context = cache.k[0].shape[1]
  streams_R = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds_R, streams_R)

  def body(i, state):
    cache, logits_RxV, tokens_RxC, logprobs_RxC, *top = state
    keys_R = jax.vmap(jax.random.fold_in)(streams_R, counts_R + i)
    token_R = sample_rows(logits_RxV, keys_R, temperature_R, top_k_R, top_p_R,
                                     cuts=cuts)
    all_RxV = jax.nn.log_softmax(logits_RxV, axis=-1)
    if top_n:
      top_lp_RxN, top_ids_RxN = jax.lax.top_k(all_RxV, top_n)
      top = [top[0].at[:, i].set(top_lp_RxN), top[1].at[:, i].set(top_ids_RxN)]
    # A row past its end (finished within this call) keeps writing its last slot: never read.
    positions_Rx1 = jnp.minimum(positions_R + i, context - 1)[:, None]
    logits_Rx1xV, cache = model.apply({'params': params}, token_R[:, None], cache,
                                      model_lib.CacheUse(positions_Rx1, live=live))
    return (cache, jnp.where(allowed_V, logits_Rx1xV[:, 0], -jnp.inf),
            tokens_RxC.at[:, i].set(token_R),
            logprobs_RxC.at[:, i].set(jnp.take_along_axis(all_RxV, token_R[:, None], -1)[:, 0]),
            *top)

  top = ([jnp.zeros((R, chunk, top_n), jnp.float32), jnp.zeros((R, chunk, top_n), jnp.int32)]
         if top_n else [])
  state = (cache, logits_SxV[:R], jnp.zeros((R, chunk), jnp.int32),
           jnp.zeros((R, chunk), jnp.float32), *top)
  cache, logits_RxV, *out = jax.lax.fori_loop(0, steps, body, state)
  return cache, logits_SxV.at[:R].set(logits_RxV), *out


def _slots_spec(mesh) -> P:
  """Rows split over every device of the mesh."""
  return P(tuple(mesh.axis_names))


@functools.partial(jax.jit, static_argnames=('model', 'mesh'), donate_argnums=(1, 2))
def _prefill(params, cache, logits_SxV, prompts_NxP, lengths_N, slots_N, allowed_V, *, model,
             mesh):
  """_prefill_local on every device of the mesh, each on its rows of the prompts and the cache."""
  rows = _slots_spec(mesh)
  return jax.shard_map(functools.partial(_prefill_local, model), mesh=mesh,
                       in_specs=(P(), rows, rows, rows, rows, rows, P()), out_specs=(rows, rows),
                       check_vma=False)(params, cache, logits_SxV, prompts_NxP, lengths_N,
                                        slots_N, allowed_V)


@functools.partial(jax.jit, static_argnames=('model', 'mesh', 'chunk', 'live', 'top_n', 'cuts'),
                   donate_argnums=(1, 2))
def _decode(params, cache, logits_SxV, positions_R, seeds_R, streams_R, counts_R, temperature_R,
            top_k_R, top_p_R, allowed_V, steps, *, model, mesh, chunk: int, live: int, top_n: int,
            cuts: bool):
  """_decode_local on every device of the mesh, each on its first rows (the per-row inputs hold
  R of them a device); the tokens, logprobs and alternatives gathered to every device."""
  rows, axes = _slots_spec(mesh), tuple(mesh.axis_names)

  def local(*args):
    cache, logits_SxV, *out = _decode_local(model, *args, chunk=chunk, live=live, top_n=top_n,
                                            cuts=cuts)
    return cache, logits_SxV, *(jax.lax.all_gather(x, axes, tiled=True) for x in out)

  outputs = 2 + (2 if top_n else 0)
  return jax.shard_map(local, mesh=mesh, in_specs=(P(), rows, rows) + (rows,) * 7 + (P(), P()),
                       out_specs=(rows, rows) + (P(),) * outputs, check_vma=False)(
      params, cache, logits_SxV, positions_R, seeds_R, streams_R, counts_R, temperature_R,
      top_k_R, top_p_R, allowed_V, steps)


class Engine:
  """Continuous batching over a bounded KV cache (see the module docstring).

  Two ways to drive it: `generate(sequences)` runs them to the end in the calling thread (the
  harness, GRPO); `run_forever()` in a thread of its own serves sequences that any thread
  `submit`s (the server), calling each sequence's on_update from that thread.

  params: the model's (float32, stacked layers, on their devices) or None, set later with
  set_params; mesh: the devices that decode (default: those of the params, else the first
  device); slots: over all of them (rounded up to a multiple of the device count).
  """

  def __init__(self, model_config: model_lib.ModelConfig, params, tokenizer, *, slots: int = 16,
               context: int, chunk: int = 8, prefill_tokens: int = 16384,
               mesh: Mesh | None = None):
    self.model = _decoding_model(model_config)
    self.tokenizer = tokenizer
    self.mesh = mesh if mesh is not None else _mesh_of(params)
    self.devices = self.mesh.size
    self.local_slots = -(-slots // self.devices)  # each device's rows of the cache
    self.slots, self.context, self.chunk = self.local_slots * self.devices, context, chunk
    # Prompt tokens per device per prefill call at most (its activations are [rows, P, mlp]).
    self.prefill_tokens = max(prefill_tokens, context)
    self._replicated = NamedSharding(self.mesh, P())
    self._rows = NamedSharding(self.mesh, _slots_spec(self.mesh))
    self._convert = jax.jit(functools.partial(decoding_params, self.model.config),
                            out_shardings=self._replicated)
    ids_V = np.arange(model_config.vocab_size)
    self._allowed_host_V = (ids_V < tokenizer.vocab_size) & (ids_V != tokenizer.pad_id)
    self._cache = self._logits_SxV = self._allowed_V = None  # placed at the first use (_state)
    self._busy: list[Sequence | None] = [None] * self.slots  # slot d * local_slots + j: device d
    self._waiting: collections.deque[Sequence] = collections.deque()
    self._wakeup = threading.Condition()
    self._stopping = False
    self.shapes: set[tuple] = set()  # the compiled shapes asked for so far
    self.tokens_generated = 0
    self.set_params(params)

  def set_params(self, params) -> None:
    """Takes new params (the model's, or abstract ones for lowering; None frees the copy):
    converted once (decoding_params) and gathered onto every device of the engine's mesh."""
    if params is None:
      self.params = None
    elif all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
      self.params = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated),
          jax.eval_shape(functools.partial(decoding_params, self.model.config), params))
    else:
      self.params = self._convert(params)

  def warmup(self) -> None:
    """Compiles every shape that traffic can ask for (prefills of 1, 2, 4, ... rows of each length
    bucket, decodes of each row and live bucket, with and without the cut and the alternatives),
    so that no request waits for a compile. Changes no sequence: these prefills write to no slot
    and these decodes run no step."""
    for P_ in sorted({bucket(n, self.context, MIN_BUCKET) for n in range(1, self.context + 1)}):
      most = self._most_rows(P_)
      for N in sorted({bucket(n, most) for n in range(1, most + 1)}):
        self._prefill([[] for _ in range(self.devices)], P_, N)
    for rows in sorted({bucket(n, self.local_slots) for n in range(1, self.local_slots + 1)}):
      for live in sorted({live_bucket(n, self.context) for n in range(1, self.context + 1)}):
        for top_n in (0, TOP_N):
          for cuts in (False, True):
            self._decode(rows, live, top_n, cuts, [], 0)

  def submit(self, seq: Sequence) -> None:
    """Queues a sequence (thread-safe). Its prompt and max_new_tokens must fit the context; once
    the engine is stopped (stop(), or run_forever ended) raises EngineStopped."""
    if not seq.prompt or len(seq.prompt) + seq.max_new_tokens > self.context:
      raise ValueError(f'a prompt of {len(seq.prompt)} tokens and {seq.max_new_tokens} new tokens '
                       f'do not fit the context of {self.context} tokens')
    with self._wakeup:
      if self._stopping:
        raise EngineStopped('the engine is stopped: it takes no more sequences')
      if seq.max_new_tokens > 0:
        self._waiting.append(seq)
        self._wakeup.notify()
        return
    self._finish(seq, 'length')

  @property
  def stopped(self) -> bool:
    """Whether stop() was called or run_forever ended: submit refuses."""
    return self._stopping

  def stats(self) -> dict:
    return {'slots': self.slots, 'devices': self.devices, 'context': self.context,
            'busy': sum(s is not None for s in self._busy), 'waiting': len(self._waiting),
            'compiled_shapes': len(self.shapes), 'tokens_generated': self.tokens_generated}

  def generate(self, sequences: list[Sequence]) -> list[Sequence]:
    for seq in sequences:
      self.submit(seq)
    while self.step():
      pass
    return sequences

  def run_forever(self, max_failures: int = MAX_FAILURES) -> None:
    """Serves submitted sequences until stop(). A step that raises fails the sequences it held
    (their error: the exception's type and text; the traceback logged) and the engine goes on
    with a fresh cache; after max_failures such steps in a row (none succeeding between them) it
    gives up: raises EngineFailed. However it ends, the sequences it held or that still wait end
    with STOPPED, and submit refuses new ones."""
    failures = 0
    try:
      while True:
        with self._wakeup:
          while not self._stopping and not self._waiting and not any(self._busy):
            self._wakeup.wait()
          if self._stopping:
            return
        try:
          self.step()
          failures = 0
        except Exception as e:  # fails the sequences of this call only
          failures += 1
          held = [seq for seq in self._busy if seq is not None]
          logging.exception('an engine step failed (%d in a row): its %d sequences fail',
                            failures, len(held))
          self._busy = [None] * self.slots
          self._cache = self._logits_SxV = None  # donated buffers may be gone: start afresh
          for seq in held:
            self._fail(seq, f'{type(e).__name__}: {e}')
          if failures >= max_failures:
            raise EngineFailed(f'{failures} engine steps failed in a row') from e
    finally:
      with self._wakeup:
        self._stopping = True
        left = [*self._waiting, *(seq for seq in self._busy if seq is not None)]
        self._waiting.clear()
        self._busy = [None] * self.slots
      for seq in left:
        self._fail(seq, STOPPED)

  def stop(self) -> None:
    """Ends run_forever after its current step (thread-safe): the sequences still waiting fail
    now (STOPPED), the busy ones when that step ends; submit refuses new ones."""
    with self._wakeup:
      self._stopping = True
      waiting = list(self._waiting)
      self._waiting.clear()
      self._wakeup.notify()
    for seq in waiting:
      self._fail(seq, STOPPED)

  def step(self) -> bool:
    """Admits waiting sequences into free slots, then decodes one chunk of every busy slot.
    Returns whether anything is left to do."""
    self._admit()
    busy = [g for g, seq in enumerate(self._busy) if seq is not None]
    if not busy:
      return bool(self._waiting)
    seqs = [self._held(g) for g in busy]
    steps = max(min(self.chunk, seq.max_new_tokens - len(seq.tokens)) for seq in seqs)
    rows = bucket(max(g % self.local_slots for g in busy) + 1, self.local_slots)
    live = live_bucket(max(len(s.prompt) + len(s.tokens) for s in seqs) + steps, self.context)
    top_n = TOP_N if any(s.alternatives for s in seqs) else 0
    cuts = any(s.temperature > 0 and (s.top_k > 0 or s.top_p < 1.0) for s in seqs)
    tokens_RxC, logprobs_RxC, *top = self._decode(rows, live, top_n, cuts, busy, steps)
    for g, seq in zip(busy, seqs):
      q = self._row(g, rows)
      self._extend(seq, tokens_RxC[q, :steps], logprobs_RxC[q],
                   *((top[0][q], top[1][q]) if top else (None, None)))
      if seq.done:
        self._busy[g] = None
    return True

  def score(self, tokens_BxT1, top_n: int = 0):
    """token_logprobs with the engine's params (on its devices)."""
    return token_logprobs(self.model, self.params, multihost.global_array(np.asarray(tokens_BxT1),
                                                        self._replicated), top_n=top_n)

  def _held(self, g: int) -> Sequence:
    """The sequence in slot g, which the caller knows is busy."""
    seq = self._busy[g]
    assert seq is not None, f'slot {g} is free'
    return seq

  def _row(self, g: int, rows: int) -> int:
    """The row of slot g in a decode call of each device's first `rows` slots."""
    d, j = divmod(g, self.local_slots)
    return d * rows + j

  def _admit(self) -> None:
    """Moves waiting sequences into free slots (the lowest local index first, over the devices
    in turn) and prefills them, a bucket of lengths at a time."""
    admitted = []
    with self._wakeup:
      for j in range(self.local_slots):
        for d in range(self.devices):
          g = d * self.local_slots + j
          while self._busy[g] is None and self._waiting:
            seq = self._waiting.popleft()
            if seq.cancelled:
              self._finish(seq, 'cancelled')
              continue
            self._busy[g] = seq
            admitted.append(g)
    by_length = collections.defaultdict(list)
    for g in admitted:
      by_length[bucket(len(self._held(g).prompt), self.context, MIN_BUCKET)].append(g)
    for P_, slots in sorted(by_length.items()):
      per_device = [[g for g in slots if g // self.local_slots == d] for d in range(self.devices)]
      most = self._most_rows(P_)
      for start in range(0, max(len(x) for x in per_device), most):
        group = [x[start:start + most] for x in per_device]
        self._prefill(group, P_, bucket(max(len(x) for x in group), most))

  def _most_rows(self, P_: int) -> int:
    """Prompts per device per prefill call at most for prompts padded to P_: a power of two that
    keeps the call within prefill_tokens, and no more than a device's slots need."""
    fitting = 1 << (max(1, self.prefill_tokens // P_).bit_length() - 1)
    return min(fitting, bucket(self.local_slots, 1 << 30))

  def _state(self):
    """The cache and last logits, allocated at the first use, each device's rows on it."""
    if self._allowed_V is None:
      self._allowed_V = multihost.global_array(self._allowed_host_V, self._replicated)
    if self._cache is None:
      self._cache, self._logits_SxV = jax.jit(
          lambda: (model_lib.KVCache.zeros(self.model.config, self.slots, self.context),
                   jnp.zeros((self.slots, self.model.config.vocab_size), jnp.float32)),
          out_shardings=self._rows)()
    return self._cache, self._logits_SxV

  def abstract_state(self):
    """The cache and last logits as _state places them, abstract (ShapeDtypeStructs with their
    sharding): nothing is allocated."""
    c = self.model.config
    cache = jax.eval_shape(lambda: model_lib.KVCache.zeros(c, self.slots, self.context))
    return (self._abstract(cache, self._rows),
            jax.ShapeDtypeStruct((self.slots, c.vocab_size), jnp.float32, sharding=self._rows))

  def largest_prefill(self, prompt_tokens: int) -> tuple[int, int]:
    """(rows per device, length) of the largest prefill call that prompts of at most
    prompt_tokens tokens can ask for (_admit's buckets)."""
    P_ = bucket(prompt_tokens, self.context, MIN_BUCKET)
    return self._most_rows(P_), P_

  def lower_prefill(self, rows: int, length: int):
    """The prefill call of `rows` prompts a device padded to `length` tokens, lowered (not run)
    with this engine's params and abstract_state: what that call compiles, e.g. for a GPU this
    machine does not have (plan.py). As warmup's prefills, it writes to no slot."""
    inputs = self._prefill_inputs([[] for _ in range(self.devices)], length, rows)
    return _prefill.lower(self.params, *self.abstract_state(), *self._abstract(inputs, self._rows),
                          self._abstract(self._allowed_host_V, self._replicated),
                          model=self.model, mesh=self.mesh)

  def lower_decode(self, rows: int, live: int, top_n: int = 0, cuts: bool = False):
    """The decode call of each device's first `rows` slots (up to `chunk` steps) attending over
    `live` positions, lowered as lower_prefill lowers its call."""
    return _decode.lower(self.params, *self.abstract_state(),
                         *self._abstract(self._decode_inputs(rows, []), self._rows),
                         self._abstract(self._allowed_host_V, self._replicated),
                         self._abstract(np.int32(self.chunk), self._replicated), model=self.model,
                         mesh=self.mesh, chunk=self.chunk, live=live, top_n=top_n, cuts=cuts)

  @staticmethod
  def _abstract(tree, sharding):
    """ShapeDtypeStructs of host arrays, placed as the engine places them."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
                        tree)

  def _prefill_inputs(self, group: list[list[int]], P_: int, N: int) -> tuple:
    """Prompts [devices × N, P_] (device d's slots group[d] in its N rows), their lengths and
    local slots (padding rows: local_slots, dropped)."""
    prompts_NxP = np.full((self.devices * N, P_), self.tokenizer.pad_id, np.int32)
    lengths_N = np.ones(self.devices * N, np.int32)
    slots_N = np.full(self.devices * N, self.local_slots, np.int32)
    for d, slots in enumerate(group):
      for r, g in enumerate(slots):
        prompt, q = self._held(g).prompt, d * N + r
        prompts_NxP[q, :len(prompt)], lengths_N[q], slots_N[q] = prompt, len(prompt), g % (
            self.local_slots)
    return prompts_NxP, lengths_N, slots_N

  def _prefill(self, group: list[list[int]], P_: int, N: int) -> None:
    self.shapes.add(('prefill', N, P_))
    inputs = (multihost.global_array(x, self._rows) for x in self._prefill_inputs(group, P_, N))
    self._cache, self._logits_SxV = _prefill(self.params, *self._state(), *inputs,
                                             self._allowed_V, model=self.model, mesh=self.mesh)

  def _decode_inputs(self, rows: int, busy: list[int]) -> tuple:
    """The per-row inputs of a decode call (positions, seeds, streams, counts, temperature, top_k,
    top_p) of each device's first `rows` slots, of which `busy` hold sequences."""
    n = rows * self.devices
    positions, streams, counts, top_k = (np.zeros(n, np.int32) for _ in range(4))
    seeds, temperature, top_p = (np.zeros(n, np.uint32), np.zeros(n, np.float32),
                                 np.ones(n, np.float32))
    for g in busy:
      seq, q = self._held(g), self._row(g, rows)
      positions[q] = len(seq.prompt) + len(seq.tokens)
      seeds[q], streams[q], counts[q] = seq.seed % 2**32, seq.stream, len(seq.tokens)
      temperature[q], top_k[q], top_p[q] = seq.temperature, seq.top_k, seq.top_p
    return positions, seeds, streams, counts, temperature, top_k, top_p

  def _decode(self, rows: int, live: int, top_n: int, cuts: bool, busy: list[int], steps: int):
    """`steps` decoding steps of each device's first `rows` slots, of which `busy` hold sequences:
    their tokens [rows × devices, chunk], logprobs and with top_n the alternatives (host arrays;
    row d × rows + j is device d's slot j)."""
    self.shapes.add(('decode', rows, live, top_n, cuts))
    inputs = (multihost.global_array(x, self._rows) for x in self._decode_inputs(rows, busy))
    self._cache, self._logits_SxV, *out = _decode(
        self.params, *self._state(), *inputs, self._allowed_V,
        multihost.global_array(np.int32(steps), self._replicated), model=self.model, mesh=self.mesh,
        chunk=self.chunk, live=live, top_n=top_n, cuts=cuts)
    return jax.device_get(out)

  def _extend(self, seq: Sequence, tokens, logprobs, top_lp_CxN, top_ids_CxN) -> None:
    """Appends a chunk's tokens to a sequence, up to EOS, max_new_tokens or a stop string."""
    if seq.cancelled:
      self._finish(seq, 'cancelled')
      return
    before, reason = len(seq.tokens), None
    decoded = seq._read  # noqa: SLF001  (tokens before it are text that had no stop string)
    for j, token in enumerate(tokens.tolist()):
      if token == self.tokenizer.eos_id:
        seq.eos_logprob, reason = float(logprobs[j]), 'stop'
        break
      seq.tokens.append(token)
      seq.logprobs.append(float(logprobs[j]))
      if top_lp_CxN is not None:
        seq.top_logprobs.append(list(zip(top_ids_CxN[j].tolist(), top_lp_CxN[j].tolist())))
      if len(seq.tokens) == seq.max_new_tokens:
        reason = 'length'
        break
    searched = len(seq.text)
    text = seq.detokenize(self.tokenizer, final=reason is not None)
    longest = max((len(s) for s in seq.stop), default=0)
    cut = _first_stop(text, seq.stop, max(0, searched - longest + 1))
    if cut is not None:
      # Keep the tokens up to the one that completed the stop string.
      n = next(n for n in range(decoded + 1, len(seq.tokens) + 1)
               if _first_stop(self.tokenizer.decode(seq.tokens[:n]), seq.stop) is not None)
      del seq.tokens[n:], seq.logprobs[n:], seq.top_logprobs[n:]
      text, reason = text[:cut], 'stop'
      seq.eos_logprob = None  # it ends at the stop string: an EOS sampled later is not its own
    seq.text = text  # once: a reader in another thread never sees a stop string in it
    self.tokens_generated += max(0, len(seq.tokens) - before)
    if reason:
      self._finish(seq, reason)
    else:
      _report(seq)

  @staticmethod
  def _finish(seq: Sequence, reason: str) -> None:
    seq.finish_reason = reason
    _report(seq)

  @staticmethod
  def _fail(seq: Sequence, error: str) -> None:
    """Ends a sequence with 'error' (unless it has ended already)."""
    if not seq.done:
      seq.error = error  # before finish_reason: a reader that sees it done sees why
      Engine._finish(seq, 'error')


def _report(seq: Sequence) -> None:
  """Calls seq.on_update. One that raises fails its own sequence and nothing else: the traceback
  is logged, the sequence ends with 'error' (its slot is freed after the chunk) and the callback
  is called once more, its chance to learn of the end; a second failure is only logged."""
  if seq.on_update is None:
    return
  try:
    seq.on_update(seq)
    return
  except Exception as e:  # noqa: BLE001  (that sequence's own failure)
    logging.exception('the on_update callback of a sequence raised: that sequence fails')
    seq.error = f'on_update raised {type(e).__name__}: {e}'
    seq.finish_reason = 'error'
  try:
    seq.on_update(seq)
  except Exception:  # noqa: BLE001
    logging.exception('the on_update callback of a failed sequence raised again')


def _mesh_of(params) -> Mesh:
  """The devices the params are on, as a mesh (a named sharding's own; else one device)."""
  leaves = jax.tree.leaves(params)
  where = getattr(leaves[0], 'sharding', None) if leaves else None
  if isinstance(where, NamedSharding) and isinstance(where.mesh, Mesh):  # (placed: not abstract)
    return where.mesh
  device = next(iter(where.device_set)) if where is not None else jax.devices()[0]
  return Mesh(np.array([device]), ('slots',))


def _first_stop(text: str, stop, start: int = 0) -> int | None:
  """Where the earliest stop string starts in text (at or after `start`), or None."""
  found = [i for i in (text.find(s, start) for s in stop if s) if i >= 0]
  return min(found) if found else None
