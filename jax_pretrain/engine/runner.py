"""The engine's model runner: the params it decodes with, the KV cache, and the compiled prefill
and decode calls (and the scoring pass).

What a decoding step moves, and nothing more: the runner holds its own copy of the params, every
matrix in the compute dtype and the layers apart (decoding_params: converted once, when the params
change: GRPO, once a step), so a step reads bf16 weights (on a GPU) once instead of casting float32
ones; the cache (one buffer [slots, context, kv_heads, head_dim] per layer, model.KVCache) is
allocated once and donated to each call, which writes the new positions in place (a scatter),
never copying it; and the attention reads only the live part of each row (positions [0, live)),
not the whole context.

On a mesh (GRPO on the trainer's devices) the slots and the cache are split over every device of
it, and each device prefills and decodes its own rows with a whole copy of the weights (shard_map:
no communication but gathering the new tokens). Several processes run the same host logic on the
same (replicated) tokens.

Positions: each row has its own length and positions in its own cache row. A prefill runs its
prompts right-padded to P (pad positions write junk into the row beyond its prompt); a row's first
new token is sampled from the logits at its position len - 1, and decode step i writes its token at
position len + i, overwriting that junk before any query can see it (the causal mask only shows a
query the positions at or before its own). So every row sees exactly its own prompt and its own
continuation, at the positions it would have alone.

Scoring (token_logprobs, ModelRunner.score): the log-probability of every next token of a batch of
rows in one forward pass, for lm_eval's loglikelihood requests and for the logprobs of an echoed
prompt.
"""
import dataclasses
import functools
from typing import Any

from flax import struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jax_pretrain import model as model_lib
from jax_pretrain import multihost
from jax_pretrain.engine import sampling
from jax_pretrain.engine.scheduler import Decode
from jax_pretrain.engine.scheduler import Prefill

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


def decoding_model(config: model_lib.ModelConfig) -> model_lib.Transformer:
  """No remat (nothing is differentiated), unscanned (each layer's cache apart), no mesh (the
  engine maps it over its devices)."""
  return model_lib.Transformer(dataclasses.replace(config, remat='none', scan_layers=False))


def cache_bytes(config: model_lib.ModelConfig, slots: int, context: int, devices: int) -> float:
  """Bytes one device holds of an engine's cache and last logits (`slots` over `devices`)."""
  local = -(-slots // devices)
  kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * (
      config.compute_dtype.itemsize)
  return float(local * (context * kv + config.vocab_size * 4))


@struct.dataclass
class Prompts:
  """A prefill call's prompts, right-padded, [rows × devices, P]: each with its length and its
  local slot (a padding row: the device's slot count, dropped)."""
  tokens_NxP: Array
  lengths_N: Array
  slots_N: Array


@struct.dataclass
class Rows:
  """A decode call's per-row inputs, [rows × devices] each (row d × rows + j: device d's slot j)."""
  positions: Array  # int32: where the row's next token goes (prompt + tokens so far)
  seeds: Array  # uint32: the sequence's seed
  streams: Array  # int32: its stream (sampling.row_streams)
  counts: Array  # int32: tokens it generated so far
  temperature: Array  # float32 (0: greedy)
  top_k: Array  # int32 (0: no cut)
  top_p: Array  # float32 (1: no cut)


def _prefill_local(model, params, cache, logits_SxV, prompts: Prompts, allowed_V):
  """One device's prefill: its prompts, right-padded, run through the model (causal attention over
  themselves), their keys and values written into their slots' rows, each one's last logits kept.
  Padding rows have slot == the device's slots: dropped."""
  N, P_ = prompts.tokens_NxP.shape
  positions_NxP = jnp.broadcast_to(jnp.arange(P_, dtype=jnp.int32), (N, P_))
  use = model_lib.CacheUse(positions_NxP, slots_B=prompts.slots_N,
                           logits_at_B=prompts.lengths_N - 1)
  logits_Nx1xV, cache = model.apply({'params': params}, prompts.tokens_NxP, cache, use)
  last_NxV = jnp.where(allowed_V, logits_Nx1xV[:, 0], -jnp.inf)
  return cache, logits_SxV.at[prompts.slots_N].set(last_NxV, mode='drop')


def _decode_local(model, params, cache, logits_SxV, rows: Rows, allowed_V, steps, *, chunk: int,
                  live: int, top_n: int, cuts: bool):
  """One device's `steps` (<= chunk) decoding steps of its first R slots: each step samples a
  token per row from its logits and runs it at the row's next position, attending over positions
  [0, live). Returns the updated cache and logits, the tokens [R, chunk], their logprobs
  [R, chunk] and with top_n the top_n alternatives ([R, chunk, top_n] logprobs and ids)."""
  R = rows.positions.shape[0]
  context = cache.k[0].shape[1]
  streams_R = sampling.row_streams(rows.seeds, rows.streams)

  def body(i, state):
    cache, logits_RxV, tokens_RxC, logprobs_RxC, *top = state
    keys_R = sampling.token_keys(streams_R, rows.counts + i)
    token_R = sampling.sample_rows(logits_RxV, keys_R, rows.temperature, rows.top_k, rows.top_p,
                                   cuts=cuts)
    all_RxV = jax.nn.log_softmax(logits_RxV, axis=-1)
    if top_n:
      top_lp_RxN, top_ids_RxN = jax.lax.top_k(all_RxV, top_n)
      top = [top[0].at[:, i].set(top_lp_RxN), top[1].at[:, i].set(top_ids_RxN)]
    # A row past its end (finished within this call) keeps writing its last slot: never read.
    positions_Rx1 = jnp.minimum(rows.positions + i, context - 1)[:, None]
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
def _prefill(params, cache, logits_SxV, prompts: Prompts, allowed_V, *, model, mesh):
  """_prefill_local on every device of the mesh, each on its rows of the prompts and the cache."""
  rows = _slots_spec(mesh)
  return jax.shard_map(functools.partial(_prefill_local, model), mesh=mesh,
                       in_specs=(P(), rows, rows, rows, P()), out_specs=(rows, rows),
                       check_vma=False)(params, cache, logits_SxV, prompts, allowed_V)


@functools.partial(jax.jit, static_argnames=('model', 'mesh', 'chunk', 'live', 'top_n', 'cuts'),
                   donate_argnums=(1, 2))
def _decode(params, cache, logits_SxV, rows: Rows, allowed_V, steps, *, model, mesh, chunk: int,
            live: int, top_n: int, cuts: bool):
  """_decode_local on every device of the mesh, each on its first rows (`rows` holds R of them a
  device); the tokens, logprobs and alternatives gathered to every device."""
  split, axes = _slots_spec(mesh), tuple(mesh.axis_names)

  def local(*args):
    cache, logits_SxV, *out = _decode_local(model, *args, chunk=chunk, live=live, top_n=top_n,
                                            cuts=cuts)
    return cache, logits_SxV, *(jax.lax.all_gather(x, axes, tiled=True) for x in out)

  outputs = 2 + (2 if top_n else 0)
  return jax.shard_map(local, mesh=mesh, in_specs=(P(), split, split, split, P(), P()),
                       out_specs=(split, split) + (P(),) * outputs, check_vma=False)(
      params, cache, logits_SxV, rows, allowed_V, steps)


class ModelRunner:
  """The params copy, the cache and the compiled calls of an engine (the module docstring).

  params: the model's (float32, stacked layers, on their devices), abstract ones (for lowering),
  or None (set later: set_params); mesh: the devices that decode (default: those of the params,
  else the first device); slots: over all of them (rounded up to a multiple of the device count).
  """

  def __init__(self, model_config: model_lib.ModelConfig, params, tokenizer, *, slots: int,
               context: int, chunk: int, mesh: Mesh | None = None):
    self.model = decoding_model(model_config)
    self.mesh = mesh if mesh is not None else _mesh_of(params)
    self.devices = self.mesh.size
    self.local_slots = -(-slots // self.devices)  # each device's rows of the cache
    self.slots, self.context, self.chunk = self.local_slots * self.devices, context, chunk
    self.pad_id = tokenizer.pad_id
    self._replicated = NamedSharding(self.mesh, P())
    self._rows = NamedSharding(self.mesh, _slots_spec(self.mesh))
    self._convert = jax.jit(functools.partial(decoding_params, self.model.config),
                            out_shardings=self._replicated)
    self._allowed_host_V = sampling.allowed_ids(model_config.vocab_size, tokenizer)
    self._cache = self._logits_SxV = self._allowed_V = None  # placed at the first use (state)
    self.shapes: set[tuple] = set()  # the compiled shapes asked for so far
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
    """Drops the cache (donated buffers may be gone after a failed call): the next call starts
    afresh."""
    self._cache = self._logits_SxV = None

  def state(self):
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
    """The cache and last logits as state() places them, abstract (ShapeDtypeStructs with their
    sharding): nothing is allocated."""
    c = self.model.config
    cache = jax.eval_shape(lambda: model_lib.KVCache.zeros(c, self.slots, self.context))
    return (_abstract(cache, self._rows),
            jax.ShapeDtypeStruct((self.slots, c.vocab_size), jnp.float32, sharding=self._rows))

  def prefill(self, call: Prefill) -> None:
    """Writes the call's prompts into their slots' rows of the cache, and their last logits."""
    self.shapes.add(('prefill', call.rows, call.length))
    self._cache, self._logits_SxV = _prefill(
        self.params, *self.state(), self._place(self.prompts(call)), self._allowed_V,
        model=self.model, mesh=self.mesh)

  def decode(self, call: Decode):
    """The call's steps: its rows' tokens [rows × devices, chunk], logprobs and with top_n the
    alternatives (host arrays; row d × rows + j is device d's slot j)."""
    self.shapes.add(('decode', call.rows, call.live, call.top_n, call.cuts))
    self._cache, self._logits_SxV, *out = _decode(
        self.params, *self.state(), self._place(self.rows(call)), self._allowed_V,
        multihost.global_array(np.int32(call.steps), self._replicated), model=self.model,
        mesh=self.mesh, chunk=self.chunk, live=call.live, top_n=call.top_n, cuts=call.cuts)
    return jax.device_get(out)

  def lower_prefill(self, rows: int, length: int):
    """The prefill call of `rows` prompts a device padded to `length` tokens, lowered (not run)
    with these params and abstract_state: what that call compiles, e.g. for a GPU this machine
    does not have (plan.py). As warmup's prefills, it writes to no slot."""
    call = Prefill(length, rows, ((),) * self.devices)
    return _prefill.lower(self.params, *self.abstract_state(),
                          _abstract(self.prompts(call), self._rows),
                          _abstract(self._allowed_host_V, self._replicated),
                          model=self.model, mesh=self.mesh)

  def lower_decode(self, rows: int, live: int, top_n: int = 0, cuts: bool = False):
    """The decode call of each device's first `rows` slots (up to `chunk` steps) attending over
    `live` positions, lowered as lower_prefill lowers its call."""
    call = Decode(rows, live, self.chunk, top_n, cuts, self.local_slots, ())
    return _decode.lower(self.params, *self.abstract_state(),
                         _abstract(self.rows(call), self._rows),
                         _abstract(self._allowed_host_V, self._replicated),
                         _abstract(np.int32(self.chunk), self._replicated), model=self.model,
                         mesh=self.mesh, chunk=self.chunk, live=live, top_n=top_n, cuts=cuts)

  def score(self, tokens_BxT1, top_n: int = 0):
    """token_logprobs with these params (on the mesh's devices)."""
    return token_logprobs(self.model, self.params, multihost.global_array(np.asarray(tokens_BxT1),
                                                        self._replicated), top_n=top_n)

  def prompts(self, call: Prefill) -> Prompts:
    """The call's prompts, [devices × rows, length] (device d's pairs in its rows)."""
    N, n = call.rows, self.devices * call.rows
    prompts = Prompts(np.full((n, call.length), self.pad_id, np.int32), np.ones(n, np.int32),
                      np.full(n, self.local_slots, np.int32))
    for d, pairs in enumerate(call.slots):
      for r, (j, seq) in enumerate(pairs):
        q = d * N + r
        prompts.tokens_NxP[q, :len(seq.prompt)] = seq.prompt
        prompts.lengths_N[q], prompts.slots_N[q] = len(seq.prompt), j
    return prompts

  def rows(self, call: Decode) -> Rows:
    """The per-row inputs of a decode call (zeros, greedy, for the rows no sequence holds)."""
    n = call.rows * self.devices
    rows = Rows(positions=np.zeros(n, np.int32), seeds=np.zeros(n, np.uint32),
                streams=np.zeros(n, np.int32), counts=np.zeros(n, np.int32),
                temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32),
                top_p=np.ones(n, np.float32))
    for g, seq in call.busy:
      q = call.row(g)
      rows.positions[q] = len(seq.prompt) + len(seq.tokens)
      rows.seeds[q], rows.streams[q], rows.counts[q] = seq.seed % 2**32, seq.stream, len(seq.tokens)
      rows.temperature[q], rows.top_k[q], rows.top_p[q] = seq.temperature, seq.top_k, seq.top_p
    return rows

  def _place(self, tree):
    """Host arrays onto the mesh, their rows split over its devices."""
    return jax.tree.map(lambda x: multihost.global_array(x, self._rows), tree)


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
