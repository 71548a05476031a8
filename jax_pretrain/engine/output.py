"""The engine's output processor: what the host makes of a decoding call's tokens, one sequence
at a time.

A call returns `chunk` tokens per row (their logprobs, and the TOP_N alternatives where asked);
`OutputProcessor.extend` appends a row's tokens to its sequence up to the first EOS (or another
end id, a generation_config.json's; not kept: its logprob is, for GRPO), max_new_tokens, a stop
string or its grammar's completion (a constrained sequence's matcher takes each token,
engine/grammar.py), decodes the new text incrementally (Sequence.detokenize: a handful of tokens
a chunk, not the whole sequence), and reports it to the sequence's callback (streaming). A stop
string cuts the text before it and keeps the tokens up to the one that completed it (GRPO trains
on them); an EOS sampled after the stop string is not the sequence's own.

A sequence fails alone: an exception in its handling here (its tokenizer's decode, its stop
strings) or in its on_update callback (report) fails that sequence only ('error', the exception's
type and text; the traceback logged; the callback told once more), never the engine or the other
sequences of the call, and it is no failure of the engine's step (core.MAX_FAILURES).
"""
from absl import logging

from jax_pretrain.engine.sequence import Sequence


class OutputProcessor:
  """Turns decoded tokens into each sequence's tokens, text and end (the module docstring)."""

  def __init__(self, tokenizer, end_ids: tuple[int, ...] | None = None):
    self.tokenizer = tokenizer
    self.end_ids = frozenset((tokenizer.eos_id,) if end_ids is None else end_ids)  # EOS and others
    self.tokens_generated = 0

  def extend(self, seq: Sequence, tokens, logprobs, top_lp_CxN, top_ids_CxN) -> None:
    """Appends a chunk's tokens to a sequence, up to EOS, max_new_tokens or a stop string; one
    that raises fails this sequence alone (the module docstring)."""
    try:
      self._extend(seq, tokens, logprobs, top_lp_CxN, top_ids_CxN)
    except Exception as e:  # noqa: BLE001  (that sequence's own failure)
      logging.exception('handling the tokens of a sequence raised: that sequence fails')
      fail(seq, f'{type(e).__name__}: {e}')

  def _extend(self, seq: Sequence, tokens, logprobs, top_lp_CxN, top_ids_CxN) -> None:
    if seq.cancelled:
      finish(seq, 'cancelled')
      return
    before, reason = len(seq.tokens), None
    decoded = seq.read  # (tokens before it are text that had no stop string)
    for j, token in enumerate(tokens.tolist()):
      if token in self.end_ids:
        seq.eos_logprob, reason = float(logprobs[j]), 'stop'
        break
      seq.tokens.append(token)
      seq.logprobs.append(float(logprobs[j]))
      if top_lp_CxN is not None:
        seq.top_logprobs.append(list(zip(top_ids_CxN[j].tolist(), top_lp_CxN[j].tolist())))
      if seq.grammar is not None and seq.grammar.advance(token):
        reason = 'stop'  # the grammar is complete
        break
      if len(seq.tokens) == seq.max_new_tokens:
        reason = 'length'
        break
    searched = len(seq.text)
    text = seq.detokenize(self.tokenizer, final=reason is not None)
    longest = max((len(s) for s in seq.stop), default=0)
    cut = first_stop(text, seq.stop, max(0, searched - longest + 1))
    if cut is not None:
      # Keep the tokens up to the one that completed the stop string (all of them should no
      # prefix decode to a text with it: a tokenizer whose pieces do not add up).
      n = next((n for n in range(decoded + 1, len(seq.tokens) + 1)
                if first_stop(self.tokenizer.decode(seq.tokens[:n]), seq.stop) is not None),
               len(seq.tokens))
      del seq.tokens[n:], seq.logprobs[n:], seq.top_logprobs[n:]
      text, reason = text[:cut], 'stop'
      seq.eos_logprob = None  # it ends at the stop string: an EOS sampled later is not its own
    seq.text = text  # once: a reader in another thread never sees a stop string in it
    self.tokens_generated += max(0, len(seq.tokens) - before)
    if reason:
      finish(seq, reason)
    else:
      report(seq)


def finish(seq: Sequence, reason: str) -> None:
  seq.finish_reason = reason
  report(seq)


def fail(seq: Sequence, error: str) -> None:
  """Ends a sequence with 'error' (unless it has ended already)."""
  if not seq.done:
    seq.error = error  # before finish_reason: a reader that sees it done sees why
    finish(seq, 'error')


def report(seq: Sequence) -> None:
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


def first_stop(text: str, stop, start: int = 0) -> int | None:
  """Where the earliest stop string starts in text (at or after `start`), or None."""
  found = [i for i in (text.find(s, start) for s in stop if s) if i >= 0]
  return min(found) if found else None
