"""The engine's model runner: the params it decodes with, the KV cache, and the compiled prefill
and decode calls (and the scoring pass).

The device keeps the slots' state between calls (State: the cache, each slot's last logits and
Rows, its position, token count, limit, sampling settings and whether it ended), so that a decode
call needs nothing from the host but its shape and steps: the engine dispatches it before reading
the tokens of the call before (core.py). A prefill starts its rows; each decoding step advances
the rows that have not ended, and ends a row at EOS or at its max_new_tokens (it then writes
nothing more); a call stops early once all its rows have ended.

One prefill per prompt: a prefill call runs each distinct prompt of its sequences once, into the
slot of the first, and copies its keys and values (positions [0, P)), last logits and a Rows of
their own into the slots of the others (the scheduler puts them on the same device), so the
num_samples completions of a GRPO prompt cost one prefill, and decode what they would alone.
A prefix prefill (the scheduler's prefix caching) runs each prompt's tokens after its cached
prefix, at their positions, into a row that holds the prefix (its own slot's, or copied first
from the slot that holds it); their attention reads the row (model.CacheUse.prefix), and its
copies take the whole row.

What a decoding step moves, and nothing more: the runner holds its own copy of the params, every
matrix in the compute dtype and the layers apart (decoding_params: converted once, when the params
change: GRPO, once a step), so a step reads bf16 weights (on a GPU) once instead of casting float32
ones (with model.fp8, e4m3 weights quantized once, at the training's delayed scales); the cache
(keys and values [slots, context, kv_heads, head_dim] per layer, model.KVCache: in the compute
dtype, or in 8 bits with a scale per head and position, kv_cache_dtype) is allocated once and
donated to each call, which writes the new positions in place (a scatter), never copying it; and
the attention reads only the live part of each row (positions [0, live)), not the whole context.

On a mesh (GRPO on the trainer's devices) the slots and the cache are split over every device of
it, and each device prefills and decodes its own rows with a whole copy of the weights (shard_map:
no communication but gathering the new tokens). Several processes run the same host logic on the
same (replicated) tokens.

Positions: each row has its own length and positions in its own cache row. A prefill runs its
prompts right-padded to P (pad positions write junk into the row beyond its prompt); a row's first
new token is sampled from the logits at its position len - 1, and decode step i writes its token at
position len + i, overwriting that junk before any query can see it (the causal mask only shows a
query the positions at or before its own). The same holds for what the slot's previous sequence
left, or wrote in a call still in flight when the slot was given to the next (the device runs the
calls in order: its prefill comes after). So every row sees exactly its own prompt and its own
continuation, at the positions it would have alone.

Scoring (token_logprobs, ModelRunner.score): the log-probability of every next token of a batch of
rows in one forward pass, for lm_eval's loglikelihood requests and for the logprobs of an echoed
prompt.
"""
import dataclasses
import functools
from typing import Any, TypeVar

from flax import struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jax_pretrain import fp8
from jax_pretrain import model as model_lib
from jax_pretrain import multihost
from jax_pretrain.engine import grammar as grammar_lib
from jax_pretrain.engine import programs as programs_lib
from jax_pretrain.engine import sampling
from jax_pretrain.engine.sampling import MAX_LOGIT_BIAS
from jax_pretrain.engine.sampling import TOP_N
from jax_pretrain.engine.scheduler import Decode
from jax_pretrain.engine.scheduler import Prefill
from jax_pretrain.engine.scheduler import PrefillShape
from jax_pretrain.engine.scheduler import Shape
from jax_pretrain.engine.sequence import Sequence

CallT = TypeVar('CallT', Prefill, Decode)
# Every runner's compiled programs (ModelRunner.compile): engines of one model, mesh and sizes share
# them, e.g. the engines a process makes one after another (the tests, GRPO's evals).
_COMPILED: dict[tuple, Any] = {}
Array = Any  # a call's inputs: numpy arrays made on the host, then jax.Arrays on the mesh


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
  """The engine's copy of a model's params (a checkpoint's and the trainer's stay as they are):
  the layers apart (layers_0, layers_1, ...: the unscanned model writes each layer's cache in
  place), each layer's query, key and value projections concatenated into one matrix (wqkv
  [D, N + 2K, H]) and its gate and up projections into one (w_gate_up [D, 2, F]), so that a step
  reads few, large operands, and every matrix in the compute dtype (the model casts it there at
  every use: the same numbers, cast once). Vectors (norm scales) stay.

  With model.fp8, `params` may hold the amax histories beside the weights (fp8.merge: the train
  state's, TrainState.fp8, or a checkpoint's, workdir.Trained.fp8): each projection is then
  quantized once here as the train step quantizes it, its own scale kept within the fused
  matrices, and its activations scaled from their history, as the next train step would
  (model.quantize_projections, fp8.quantized_dense): a row's logits are the same alone and in
  any batch. Without histories each row (token) is scaled from its own amax."""
  params, histories = fp8.split(params)
  params = model_lib.unstack_layers(params, config.num_layers)
  histories = model_lib.unstack_layers(histories or {}, config.num_layers)
  cast = lambda x: x.astype(config.compute_dtype) if x.ndim >= 2 and jnp.issubdtype(
      x.dtype, jnp.floating) else x
  params = jax.tree.map(cast, params)
  for i in range(config.num_layers):
    layer = params[f'layers_{i}']
    if config.fp8:
      layer = model_lib.quantize_projections(layer, histories.get(f'layers_{i}'))
    params[f'layers_{i}'] = model_lib.fuse_projections(layer)
  return params


def decoding_model(config: model_lib.ModelConfig) -> model_lib.Transformer:
  """No remat (nothing is differentiated), unrolled (each layer's cache apart), no mesh (the
  engine maps it over its devices)."""
  return model_lib.Transformer(dataclasses.replace(config, remat='none', layers='unroll'))


def cache_bytes(config: model_lib.ModelConfig, slots: int, context: int, devices: int,
                kv_cache_dtype: str = 'auto') -> float:
  """Bytes one device holds of an engine's cache, last logits and token counts (`slots` over
  `devices`)."""
  local = -(-slots // devices)
  kv = model_lib.kv_bytes_per_token(config, kv_cache_dtype)
  return float(local * (context * kv + config.vocab_size * 8))


@struct.dataclass
class Rows:
  """Each slot's decoding state, [slots] each, kept on the device between calls (split over the
  mesh as the cache is): a prefill starts its rows, each decoding step advances the rows that have
  not ended. A row ends on the device (done) at EOS or at its limit; it then writes nothing more.
  Rows that no sequence ever held are done."""
  positions: Array  # int32: where the row's next token goes (its prompt + tokens so far)
  counts: Array  # int32: tokens it generated so far (its next token's random key)
  limits: Array  # int32: its max_new_tokens
  done: Array  # bool: it ended (EOS, or its limit)
  seeds: Array  # uint32: its sequence's seed
  streams: Array  # int32: its stream (sampling.row_streams)
  temperature: Array  # float32 (0: greedy)
  top_k: Array  # int32 (0: no cut)
  top_p: Array  # float32 (1: no cut)
  presence: Array  # float32: its presence penalty
  frequency: Array  # float32: its frequency penalty
  bias_ids: Array  # int32 [slots, MAX_LOGIT_BIAS]: its logit_bias's token ids (padding: 0)
  bias: Array  # float32 [slots, MAX_LOGIT_BIAS]: their biases (padding: 0)

  @classmethod
  def start(cls, sequences: list[Sequence | None]) -> 'Rows':
    """Host arrays of the rows of these sequences at their start (None: a row that is done)."""
    n = len(sequences)
    rows = cls(positions=np.zeros(n, np.int32), counts=np.zeros(n, np.int32),
               limits=np.zeros(n, np.int32), done=np.ones(n, bool), seeds=np.zeros(n, np.uint32),
               streams=np.zeros(n, np.int32), temperature=np.zeros(n, np.float32),
               top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
               presence=np.zeros(n, np.float32), frequency=np.zeros(n, np.float32),
               bias_ids=np.zeros((n, MAX_LOGIT_BIAS), np.int32),
               bias=np.zeros((n, MAX_LOGIT_BIAS), np.float32))
    for q, seq in enumerate(sequences):
      if seq is not None:
        rows.positions[q], rows.limits[q], rows.done[q] = len(seq.prompt), seq.max_new_tokens, False
        rows.seeds[q], rows.streams[q] = seq.seed % 2**32, seq.stream
        rows.temperature[q], rows.top_k[q], rows.top_p[q] = seq.temperature, seq.top_k, seq.top_p
        rows.presence[q], rows.frequency[q] = seq.presence_penalty, seq.frequency_penalty
        for k, (token, bias) in enumerate(seq.logit_bias):
          rows.bias_ids[q, k], rows.bias[q, k] = token, bias
    return rows


@struct.dataclass
class State:
  """What the device keeps of the slots between calls: the KV cache, each slot's last logits
  (float32 [slots, V]: its next token's), how many times it generated each token (int32 [slots,
  V]: its penalties', sampling.penalized) and its Rows."""
  cache: model_lib.KVCache
  logits_SxV: Array
  counts_SxV: Array
  rows: Rows


@struct.dataclass
class Admitted:
  """A prefill call's inputs, rows [devices × rows] and copies [devices × copies] (device d's
  at d × rows + r and d × copies + c): the distinct prompts, right-padded, each with the local
  slot of its first sequence (where it is run) and the Rows that sequence starts; and each other
  sequence of those prompts with its slot, the row of its prompt and its Rows. Padding: the
  device's slot count as the slot, dropped. A prefix prefill's prompts: their tokens after the
  cached prefix (starts_N tokens, in the row of local slot source_N)."""
  tokens_NxP: Array
  slots_N: Array
  starts_N: Array  # int32
  source_N: Array  # int32
  rows_N: Rows
  slots_C: Array
  prompt_C: Array  # int32: the row (0 .. rows - 1, the device's) of its prompt
  rows_C: Rows

  def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """On the host: tokens_NxP, then the prompts' other fields and the copies' each as one
    int32 array (_pack): three transfers for a call, not a leaf's each (32; ~30 µs of the
    engine thread's CPU each)."""
    return (self.tokens_NxP, _pack((self.slots_N, self.starts_N, self.source_N, self.rows_N)),
            _pack((self.slots_C, self.prompt_C, self.rows_C)))

  @classmethod
  def unpacked(cls, tokens_NxP, words_N, words_C) -> 'Admitted':
    """packed()'s inverse, in a program."""
    index, rows = np.zeros(0, np.int32), Rows.start([])
    slots_N, starts_N, source_N, rows_N = _unpack(words_N, (index, index, index, rows))
    slots_C, prompt_C, rows_C = _unpack(words_C, (index, index, rows))
    return cls(tokens_NxP, slots_N, starts_N, source_N, rows_N, slots_C, prompt_C, rows_C)


def _pack(tree) -> np.ndarray:
  """A host tree's leaves [n, ...] (32-bit types or bool) side by side in one int32 [n, words]
  array (their bits; a bool as 0 or 1)."""
  words = lambda x: x.astype(np.int32) if x.dtype == np.bool_ else x.view(np.int32)
  return np.concatenate([words(x).reshape(len(x), int(np.prod(x.shape[1:])))
                         for x in jax.tree.leaves(tree)], axis=1)


def _unpack(words_NxW, like):
  """_pack's inverse, traced: the tree of `like`'s structure (host arrays of any number of rows,
  for their dtypes and trailing shapes) from words_NxW."""
  leaves, treedef = jax.tree.flatten(like)
  out, at = [], 0
  for x in leaves:
    width = int(np.prod(x.shape[1:]))
    w = words_NxW[:, at:at + width].reshape(-1, *x.shape[1:])
    out.append(w != 0 if x.dtype == np.bool_ else jax.lax.bitcast_convert_type(w, x.dtype))
    at += width
  return jax.tree.unflatten(treedef, out)


@struct.dataclass
class Decoding:
  """The carry of _decode_local's loop over steps, for its R rows (the device's first R slots):
  the steps taken, the cache, each row's next logits, position, token count, counts of each token
  and whether it ended;
  and what the call returns, each step's token and its logprob [R, chunk] and the TOP_N
  alternatives ([R, chunk, TOP_N] logprobs and ids)."""
  step: Array  # int32
  cache: model_lib.KVCache
  logits_RxV: Array
  positions_R: Array
  counts_R: Array
  counts_RxV: Array
  done_R: Array
  tokens_RxC: Array
  logprobs_RxC: Array
  top_lp_RxCxN: Array
  top_ids_RxCxN: Array


def _prefill_local(model, params, state: State, admitted: Admitted, allowed_V,
                   prefix: bool = False) -> State:
  """One device's prefill: its prompts, right-padded, run through the model (causal attention over
  themselves), their keys and values written into their first slots' rows, each one's last logits
  kept and its Rows started; then the copies: each takes the keys and values of its prompt's first
  [0, P) positions, its last logits, and starts its own Rows (its own seed and stream). prefix:
  each prompt's tokens after its cached prefix (the module docstring), the copies the whole row."""
  N, P_ = admitted.tokens_NxP.shape
  slots_N, slots_C = admitted.slots_N, admitted.slots_C
  starts_N = admitted.starts_N if prefix else jnp.zeros_like(slots_N)
  positions_NxP = starts_N[:, None] + jnp.arange(P_, dtype=jnp.int32)
  cache = state.cache
  if prefix:  # (a row's own slot as its source copies it onto itself)
    cache = jax.tree.map(lambda x: x.at[slots_N].set(
        jnp.take(x, admitted.source_N, axis=0, mode='clip'), mode='drop'), cache)
  use = model_lib.CacheUse(positions_NxP, slots_B=slots_N,
                           logits_at_B=admitted.rows_N.positions - 1 - starts_N, prefix=prefix)
  logits_Nx1xV, cache = model.apply({'params': params}, admitted.tokens_NxP, cache, use)
  last_NxV = jnp.where(allowed_V, logits_Nx1xV[:, 0], -jnp.inf)
  start = lambda rows, slots, new: jax.tree.map(
      lambda x, y: x.at[slots].set(y, mode='drop'), rows, new)
  logits_SxV = state.logits_SxV.at[slots_N].set(last_NxV, mode='drop')
  counts_SxV = state.counts_SxV.at[slots_N].set(0, mode='drop')
  rows = start(state.rows, slots_N, admitted.rows_N)
  if slots_C.shape[0]:
    from_C, copied = slots_N[admitted.prompt_C], slice(None) if prefix else slice(P_)
    cache = jax.tree.map(lambda x: x.at[slots_C, copied].set(x[from_C, copied], mode='drop'),
                         cache)
    logits_SxV = logits_SxV.at[slots_C].set(last_NxV[admitted.prompt_C], mode='drop')
    counts_SxV = counts_SxV.at[slots_C].set(0, mode='drop')
    rows = start(rows, slots_C, admitted.rows_C)
  return State(cache, logits_SxV, counts_SxV, rows)


def _decode_local(model, params, state: State, allowed_V, eos_E, steps, want_top, mask_RxW, *,
                  rows: int, chunk: int, live: int):
  """One device's decoding steps of its first `rows` (R) slots, up to `steps` (<= chunk) of them
  and no more once every row has ended: each step samples a token per row from its logits and
  runs it at the row's next position, attending over positions [0, live). A row that ends (EOS,
  or its limit) runs no more tokens (its writes go out of range: dropped). Returns the updated
  state, the tokens [R, chunk], their logprobs [R, chunk] and the TOP_N alternatives ([R, chunk,
  TOP_N] logprobs and ids: zeros unless want_top); a row's entries after its end are not its own.
  Sampling's variants are runtime branches, not programs: the top-k/top-p cut runs when a row
  asks for it (sampling.filter_logits), the alternatives when want_top (a traced bool), the
  penalties, logit_bias and the grammars' masks mask_RxW when a row has one (sampling.penalized;
  a call with a constrained row runs one step: its mask is for that token, engine/core.py)."""
  R = rows
  context = state.cache.layers[0].k_BxSxKxH.shape[1]
  r = jax.tree.map(lambda x: x[:R], state.rows)
  streams_R = sampling.row_streams(r.seeds, r.streams)
  any_processed = (jnp.any(r.presence != 0) | jnp.any(r.frequency != 0) | jnp.any(r.bias != 0)
                   | jnp.any(mask_RxW != -1))

  def body(c: Decoding) -> Decoding:
    i = c.step
    keys_R = sampling.token_keys(streams_R, c.counts_R)
    logits_RxV = jax.lax.cond(
        any_processed, lambda: sampling.penalized(c.logits_RxV, c.counts_RxV, r.presence,
                                                  r.frequency, r.bias_ids, r.bias,
                                                  mask_RxW),
        lambda: c.logits_RxV)
    token_R = sampling.sample_rows(logits_RxV, keys_R, r.temperature, r.top_k, r.top_p)
    all_RxV = jax.nn.log_softmax(c.logits_RxV, axis=-1)
    top_lp_RxN, top_ids_RxN = jax.lax.cond(
        want_top, lambda: tuple(jax.lax.top_k(all_RxV, TOP_N)),
        lambda: (jnp.zeros((R, TOP_N), jnp.float32), jnp.zeros((R, TOP_N), jnp.int32)))
    counts_R = c.counts_R + jnp.where(c.done_R, 0, 1)
    done_R = c.done_R | jnp.any(token_R[:, None] == eos_E, axis=-1) | (counts_R >= r.limits)
    at_Rx1 = jnp.where(done_R, context, c.positions_R)[:, None]  # (ended: out of range, dropped)
    logits_Rx1xV, cache = model.apply({'params': params}, token_R[:, None], c.cache,
                                      model_lib.CacheUse(at_Rx1, live=live))
    return Decoding(
        step=i + 1, cache=cache, logits_RxV=jnp.where(allowed_V, logits_Rx1xV[:, 0], -jnp.inf),
        positions_R=c.positions_R + jnp.where(done_R, 0, 1), counts_R=counts_R,
        counts_RxV=c.counts_RxV.at[jnp.arange(R), token_R].add(jnp.where(c.done_R, 0, 1)),
        done_R=done_R,
        tokens_RxC=c.tokens_RxC.at[:, i].set(token_R),
        logprobs_RxC=c.logprobs_RxC.at[:, i].set(
            jnp.take_along_axis(all_RxV, token_R[:, None], -1)[:, 0]),
        top_lp_RxCxN=c.top_lp_RxCxN.at[:, i].set(top_lp_RxN),
        top_ids_RxCxN=c.top_ids_RxCxN.at[:, i].set(top_ids_RxN))

  start = Decoding(
      step=jnp.int32(0), cache=state.cache, logits_RxV=state.logits_SxV[:R],
      positions_R=r.positions, counts_R=r.counts, counts_RxV=state.counts_SxV[:R], done_R=r.done,
      tokens_RxC=jnp.zeros((R, chunk), jnp.int32), logprobs_RxC=jnp.zeros((R, chunk), jnp.float32),
      top_lp_RxCxN=jnp.zeros((R, chunk, TOP_N), jnp.float32),
      top_ids_RxCxN=jnp.zeros((R, chunk, TOP_N), jnp.int32))
  c = jax.lax.while_loop(lambda c: (c.step < steps) & jnp.any(~c.done_R), body, start)
  advanced = dataclasses.replace(
      state.rows, positions=state.rows.positions.at[:R].set(c.positions_R),
      counts=state.rows.counts.at[:R].set(c.counts_R), done=state.rows.done.at[:R].set(c.done_R))
  return (State(c.cache, state.logits_SxV.at[:R].set(c.logits_RxV),
                state.counts_SxV.at[:R].set(c.counts_RxV), advanced), c.tokens_RxC,
          c.logprobs_RxC, c.top_lp_RxCxN, c.top_ids_RxCxN)


def _slots_spec(mesh) -> P:
  """Rows split over every device of the mesh."""
  return P(tuple(mesh.axis_names))


@functools.partial(jax.jit, static_argnames=('model', 'mesh', 'prefix'), donate_argnums=1)
def _prefill(params, state: State, admitted: tuple, allowed_V, *, model, mesh,
             prefix: bool = False) -> State:
  """_prefill_local on every device of the mesh, each on its rows of the prompts and the state
  (admitted: Admitted.packed()'s arrays)."""
  def local(params, state, admitted, allowed_V):
    return _prefill_local(model, params, state, Admitted.unpacked(*admitted), allowed_V,
                          prefix=prefix)

  split = _slots_spec(mesh)
  return jax.shard_map(local, mesh=mesh, in_specs=(P(), split, split, P()), out_specs=split,
                       check_vma=False)(params, state, admitted, allowed_V)


@functools.partial(jax.jit, static_argnames=('model', 'mesh', 'rows', 'chunk', 'live'),
                   donate_argnums=1)
def _decode(params, state: State, allowed_V, eos_E, steps, want_top, mask_RxW, *, model, mesh,
            rows: int, chunk: int, live: int):
  """_decode_local on every device of the mesh, each on its first `rows` slots (and its rows of
  the masks); the tokens, logprobs and alternatives gathered to every device."""
  split, axes = _slots_spec(mesh), tuple(mesh.axis_names)

  def local(*args):
    state, *out = _decode_local(model, *args, rows=rows, chunk=chunk, live=live)
    return state, *(jax.lax.all_gather(x, axes, tiled=True) for x in out)

  return jax.shard_map(local, mesh=mesh, in_specs=(P(), split, P(), P(), P(), P(), split),
                       out_specs=(split,) + (P(),) * 4, check_vma=False)(
      params, state, allowed_V, eos_E, steps, want_top, mask_RxW)


class ModelRunner:
  """The params copy, the state on the device and the compiled calls of an engine (the module
  docstring).

  params: the model's (float32, stacked layers, on their devices), abstract ones (for lowering),
  or None (set later: set_params); mesh: the devices that decode (default: those of the params,
  else the first device); slots: over all of them (rounded up to a multiple of the device count);
  kv_cache_dtype: what the cache stores keys and values in (model.KV_CACHE_DTYPES); eos_ids: ids
  that end a sequence besides the tokenizer's EOS (a generation_config.json's).
  """

  def __init__(self, model_config: model_lib.ModelConfig, params, tokenizer, *, slots: int,
               context: int, chunk: int, mesh: Mesh | None = None,
               kv_cache_dtype: str = 'auto', eos_ids: tuple[int, ...] = ()):
    self.model = decoding_model(model_config)
    model_lib.kv_storage_dtype(model_config, kv_cache_dtype)  # (refuses an unknown one)
    self.kv_cache_dtype = kv_cache_dtype
    self.mesh = mesh if mesh is not None else _mesh_of(params)
    self.devices = self.mesh.size
    self.local_slots = -(-slots // self.devices)  # each device's rows of the cache
    self.slots, self.context, self.chunk = self.local_slots * self.devices, context, chunk
    self.pad_id, self.vocab_size = tokenizer.pad_id, model_config.vocab_size
    self._all_allowed: dict[tuple[int, int], jax.Array] = {}  # masks(): per shape
    self._replicated = NamedSharding(self.mesh, P())
    self._split = NamedSharding(self.mesh, _slots_spec(self.mesh))
    self._convert = jax.jit(functools.partial(decoding_params, self.model.config),
                            out_shardings=self._replicated)
    # What every call reads beside the state (host values; placed at the first call).
    self._constants_host = (sampling.allowed_ids(model_config.vocab_size, tokenizer),
                            np.array(end_ids(tokenizer, eos_ids), np.int32))
    self._constants: tuple | None = None
    self._state: State | None = None  # allocated at the first call (state())
    self.programs = programs_lib.Programs(
        self.compile, processes=len({d.process_index for d in self.mesh.devices.flat}))
    self.prompts_prefilled = 0  # prompts run through the model (once for all their sequences)
    self.set_params(params)

  def set_params(self, params) -> None:
    """Takes new params (the model's, or abstract ones for lowering; None frees the copy):
    converted once (decoding_params) and gathered onto every device of the mesh."""
    if params is None:
      self.params = None
    elif all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
      self.params = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated),
          jax.eval_shape(functools.partial(decoding_params, self.model.config), params))
    else:
      self.params = self._convert(params)

  def reset(self) -> None:
    """Drops the state (donated buffers may be gone after a failed call): the next call starts
    afresh, every row done."""
    self._state = None

  def state(self) -> State:
    """The state, allocated at the first use (every row done), each device's rows on it."""
    if self._state is None:
      self._state = jax.jit(self._zeros, out_shardings=self._split)()
    return self._state

  def abstract_state(self) -> State:
    """The state as state() places it, abstract (ShapeDtypeStructs with their sharding):
    nothing is allocated."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._split),
                        jax.eval_shape(self._zeros))

  def constants(self, abstract: bool = False) -> tuple:
    """(the ids a row may sample, bool [V]; the ids that end a row, int32 [E]), on every device
    (or abstract)."""
    if abstract:
      return _abstract(self._constants_host, self._replicated)
    if self._constants is None:
      self._constants = tuple(multihost.global_array(x, self._replicated)
                              for x in self._constants_host)
    return self._constants

  def fit(self, call: CallT) -> CallT:
    """The call as it runs: its own shape, or after a warmup, until that one is compiled, the
    smallest compiled one that covers it (programs.Programs.fit)."""
    return dataclasses.replace(call, shape=self.programs.fit(call.shape))

  def prefill(self, call: Prefill) -> None:
    """Writes the call's prompts into their slots' rows of the cache, their last logits and their
    Rows (dispatched: the device runs it after the calls before it)."""
    program = self.programs.get(call.shape)
    self.prompts_prefilled += sum(len({i for _, i, _ in x}) for x in call.slots)
    allowed_V, _ = self.constants()
    self._state = program(self.params, self.state(), self.placed(call), allowed_V)

  def decode(self, call: Decode) -> list[jax.Array]:
    """Dispatches the call's steps (the device runs them after the calls before it, the host goes
    on): its rows' tokens [rows × devices, chunk], logprobs and with top_n the alternatives, on
    the device (read: to the host; row d × rows + j is device d's slot j). A constrained
    sequence's row samples what its grammar's matcher allows now (masks)."""
    program = self.programs.get(call.shape)
    self._state, *out = program(
        self.params, self.state(), *self.constants(),
        *multihost.global_array((np.int32(call.steps), np.bool_(call.top_n > 0)),
                                self._replicated), self.masks(call))
    return out if call.top_n else out[:2]

  def masks(self, call: Decode):
    """The call's bitmasks [rows × devices, words] on the mesh: each constrained sequence's row
    filled by its matcher (engine/grammar.py), every other row all allowed (one array per shape,
    placed once, when no row is constrained)."""
    constrained = [(g, seq) for g, seq in call.busy if seq.grammar is not None and not seq.done]
    shape = (self.devices * call.shape.rows, grammar_lib.words(self.vocab_size))
    if not constrained:
      if shape not in self._all_allowed:
        self._all_allowed[shape] = multihost.global_array(np.full(shape, -1, np.int32),
                                                          self._split)
      return self._all_allowed[shape]
    mask_RxW = np.full(shape, -1, np.int32)
    for g, seq in constrained:
      seq.grammar.fill(mask_RxW, call.row(g))
    return multihost.global_array(mask_RxW, self._split)

  def compile(self, shape: Shape):
    """The call of this shape compiled, once per process for this model, mesh, cache, number of
    end ids and params' shapes: runners that share them share their programs (_COMPILED), as
    jit's cache would."""
    key = (shape, self.model, self.mesh, self.slots, self.context, self.chunk, self.kv_cache_dtype,
           len(self._constants_host[1]),
           jax.tree.structure(self.params),
           tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(self.params)))
    program = _COMPILED.get(key)
    if program is None:
      program = _COMPILED[key] = self.lower(shape).compile()
    return program

  def lower(self, shape: Shape):
    """The call of this shape lowered (lower_prefill or lower_decode)."""
    if isinstance(shape, PrefillShape):
      return self.lower_prefill(shape.rows, shape.length, shape.copies, shape.prefix)
    return self.lower_decode(shape.rows, shape.live)

  @staticmethod
  def read(out: list[jax.Array]) -> list[np.ndarray]:
    """A decode call's outputs on the host (waits for the device to finish it)."""
    return jax.device_get(out)

  def lower_prefill(self, rows: int, length: int, copies: int = 0, prefix: bool = False):
    """The prefill call of `rows` prompts a device padded to `length` tokens (and `copies` more
    slots that take their keys and values; prefix: after cached prefixes), lowered (not run) with
    these params and abstract_state: what that call compiles, e.g. for a GPU this machine does not
    have (plan.py). As warmup's prefills, it writes to no slot."""
    call = Prefill(PrefillShape(rows, length, copies, prefix), ((),) * self.devices)
    return _prefill.lower(self.params, self.abstract_state(),
                          _abstract(self.admitted(call).packed(), self._split),
                          self.constants(abstract=True)[0], model=self.model, mesh=self.mesh,
                          prefix=prefix)

  def lower_decode(self, rows: int, live: int):
    """The decode call of each device's first `rows` slots (up to `chunk` steps) attending over
    `live` positions, lowered as lower_prefill lowers its call."""
    mask = jax.ShapeDtypeStruct((self.devices * rows, grammar_lib.words(self.vocab_size)),
                                np.int32, sharding=self._split)
    return _decode.lower(self.params, self.abstract_state(), *self.constants(abstract=True),
                         _abstract(np.int32(self.chunk), self._replicated),
                         _abstract(np.bool_(False), self._replicated), mask, model=self.model,
                         mesh=self.mesh, rows=rows, chunk=self.chunk, live=live)

  def score(self, tokens_BxT1, top_n: int = 0):
    """token_logprobs with these params (on the mesh's devices)."""
    return token_logprobs(self.model, self.params, multihost.global_array(np.asarray(tokens_BxT1),
                                                        self._replicated), top_n=top_n)

  def placed(self, call: Prefill) -> tuple[jax.Array, ...]:
    """The call's inputs on the mesh, as prefill passes them: Admitted.packed()'s arrays, their
    rows split over the devices (one transfer)."""
    return multihost.global_array(self.admitted(call).packed(), self._split)

  def admitted(self, call: Prefill) -> Admitted:
    """The call's inputs (Admitted): each device's prompts in its rows, in the order of their
    index, and its other sequences in its copies."""
    N, C = call.shape.rows, call.shape.copies
    tokens_NxP = np.full((self.devices * N, call.shape.length), self.pad_id, np.int32)
    slots_N, slots_C = (np.full(self.devices * n, self.local_slots, np.int32) for n in (N, C))
    starts_N, source_N = np.zeros(self.devices * N, np.int32), np.zeros(self.devices * N, np.int32)
    prompt_C = np.zeros(self.devices * C, np.int32)
    first: list[Sequence | None] = [None] * (self.devices * N)
    others: list[Sequence | None] = [None] * (self.devices * C)
    for d, triples in enumerate(call.slots):
      c = d * C
      for j, i, seq in triples:
        if first[d * N + i] is None:
          q, start = d * N + i, seq.cached_tokens if call.shape.prefix else 0
          tokens_NxP[q, :len(seq.prompt) - start], slots_N[q], first[q] = (seq.prompt[start:], j,
                                                                           seq)
          starts_N[q], source_N[q] = start, call.sources[d][i] if call.shape.prefix else j
        else:
          slots_C[c], prompt_C[c], others[c] = j, i, seq
          c += 1
    return Admitted(tokens_NxP, slots_N, starts_N, source_N, Rows.start(first), slots_C, prompt_C,
                    Rows.start(others))

  def _zeros(self) -> State:
    c = self.model.config
    return State(model_lib.KVCache.zeros(c, self.slots, self.context, self.kv_cache_dtype),
                 jnp.zeros((self.slots, c.vocab_size), jnp.float32),
                 jnp.zeros((self.slots, c.vocab_size), jnp.int32),
                 jax.tree.map(jnp.asarray, Rows.start([None] * self.slots)))


def end_ids(tokenizer, eos_ids: tuple[int, ...] = ()) -> tuple[int, ...]:
  """The ids that end a sequence: the tokenizer's EOS, then eos_ids' others."""
  return (tokenizer.eos_id, *sorted({int(i) for i in eos_ids} - {tokenizer.eos_id}))


def _abstract(tree, sharding):
  """ShapeDtypeStructs of host arrays, placed as the runner places them."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
                      tree)


def _mesh_of(params) -> Mesh:
  """The devices the params are on, as a mesh (a named sharding's own; else one device)."""
  leaves = jax.tree.leaves(params)
  where = getattr(leaves[0], 'sharding', None) if leaves else None
  if isinstance(where, NamedSharding) and isinstance(where.mesh, Mesh):  # (placed: not abstract)
    return where.mesh
  device = next(iter(where.device_set)) if where is not None else jax.devices()[0]
  return Mesh(np.array([device]), ('slots',))
