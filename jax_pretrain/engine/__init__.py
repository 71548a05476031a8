"""Batched decoding and scoring of many requests at once: the one decoder behind GRPO's rollouts
(grpo/rollout.py), the server (serve.py), the harness (lm_eval.py), task evaluation and sample.py.

A fixed number of slots, each a row of one KV cache allocated once, so memory is bounded by slots
× context whatever the traffic. A request (a Sequence) waits until a slot is free; its prompt is
then prefilled into that slot's row (once for all the sequences of one prompt: GRPO's num_samples
completions, a request's n choices), and it decodes together with every other busy slot, up to
`chunk` tokens per compiled call; between calls its new tokens are appended, its text decoded and
reported, and it ends at EOS, max_new_tokens or a stop string, freeing its slot for the next one
(continuous batching). Its slot keeps its keys and values until a new sequence needs it (least
recently used first): a prompt that starts with what a slot holds reuses that prefix and
prefills only the rest (prefix caching, scheduler.py).

The parts, each changeable on its own:
  sequence   Sequence: what a request asks, and what the engine fills in (tokens, logprobs,
             text, finish_reason); its incremental detokenization
  scheduler  slots, the waiting queue, admission, the prefix cache, and the bucketed shape of each
             prefill and decode call (PrefillShape, DecodeShape); the calls of a workload without
             a model (Scheduler.dry_run; plain Python: tested without a model)
  runner     the model runner: the engine's copy of the params, the KV cache, the compiled
             prefill and decode calls (over a mesh's devices), their lowering for plan.py, and
             the scoring pass
  programs   the compiled program of each call shape, the warmup (the programs that cover
             every call first, the others in a background compiler) and which one runs a call
  sampling   the next token of each row: logit_bias, presence and frequency penalties, a
             constrained row's grammar mask, temperature, top-k, top-p, per-row random streams
  grammar    constrained decoding (llguidance): a JSON schema compiled for the tokenizer, each
             constrained sequence's matcher (its mask before a token, advanced after it)
  output     the output processor: a call's tokens into each sequence (EOS, max_new_tokens, stop
             strings, a grammar's completion, detokenization, logprobs), the callbacks
  core       Engine: the loop (generate, run_forever, stop) and its failure policy
  client     EngineClient: the engine for an asyncio server (serve.py): its supervised thread,
             one request's life (submit, its updates, cancel), backpressure, health
"""
from jax_pretrain.engine.core import MAX_FAILURES
from jax_pretrain.engine.core import Engine
from jax_pretrain.engine.core import EngineFailed
from jax_pretrain.engine.runner import cache_bytes
from jax_pretrain.engine.runner import decoding_params
from jax_pretrain.engine.runner import token_logprobs
from jax_pretrain.engine.sampling import MAX_LOGIT_BIAS
from jax_pretrain.engine.sampling import TOP_N
from jax_pretrain.engine.sampling import filter_logits
from jax_pretrain.engine.sampling import penalized
from jax_pretrain.engine.sampling import sample_rows
from jax_pretrain.engine.scheduler import MIN_BUCKET
from jax_pretrain.engine.scheduler import EngineStopped
from jax_pretrain.engine.scheduler import bucket
from jax_pretrain.engine.scheduler import live_bucket
from jax_pretrain.engine.sequence import STOPPED
from jax_pretrain.engine.sequence import Sequence

__all__ = ['MAX_FAILURES', 'MAX_LOGIT_BIAS', 'MIN_BUCKET', 'STOPPED', 'TOP_N', 'Engine',
           'EngineFailed', 'EngineStopped', 'Sequence', 'bucket', 'cache_bytes',
           'decoding_params', 'filter_logits', 'live_bucket', 'penalized', 'sample_rows',
           'token_logprobs']
