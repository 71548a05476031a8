"""GRPO's rollouts: completions sampled by the engine (engine/), as a training batch."""
import dataclasses

import numpy as np

from jax_pretrain import engine as engine_lib

# Decoding steps per engine call in rollouts: one host round trip per 16 tokens (nothing streams;
# a row's tokens do not depend on it). 16 against 8 measured 4% faster on one H100 (BENCHMARKS.md).
ROLLOUT_CHUNK = 16


@dataclasses.dataclass
class Rollouts:
  """num_samples completions of each prompt, as a training batch: rows grouped by prompt."""
  tokens_BxT1: np.ndarray  # int32: prompt, completion (with its EOS, if one ended it), pad_id
  mask_BxT: np.ndarray  # float32: 1 where the target tokens_BxT1[:, t + 1] is a completion token
  logp_BxT: np.ndarray  # float32: the rollout's log-probability of each such target (else 0)
  completions: list[str]  # the text (before a stop string) that the reward scores
  lengths: np.ndarray  # int32 [B]: completion tokens, EOS included


def rollouts(eng, prompts: list[list[int]], num_samples: int, *, max_new_tokens: int,
             temperature: float, seed: int, pad_id: int, eos_id: int | None = None,
             stop: tuple[str, ...] = (), width: int = 0) -> Rollouts:
  """Samples num_samples completions of each prompt with the engine (KV-cached, batched; sample
  k of prompt p uses the seed seed + p and stream k, so a run's rollouts are reproducible) and
  keeps each sampled token's log-probability. A completion that ended with EOS (eos_id given)
  has it as its last token; one that ended at a stop string keeps the token that completed it.
  width: the rows' tokens (0: the longest row's)."""
  sequences = eng.generate([
      engine_lib.Sequence(prompt=list(prompt), max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=(seed + p) % 2**32, stream=k, stop=stop)
      for p, prompt in enumerate(prompts) for k in range(num_samples)])
  rows = []
  for seq in sequences:
    new, logp = list(seq.tokens), list(seq.logprobs)
    if eos_id is not None and seq.eos_logprob is not None:
      new, logp = new + [eos_id], logp + [seq.eos_logprob]
    rows.append((seq.prompt, new, logp))
  width = width or max(len(prompt) + len(new) for prompt, new, _ in rows)
  tokens = np.full((len(rows), width), pad_id, np.int32)
  mask = np.zeros((len(rows), width - 1), np.float32)
  logps = np.zeros((len(rows), width - 1), np.float32)
  for b, (prompt, new, logp) in enumerate(rows):
    start, end = len(prompt), len(prompt) + len(new)
    tokens[b, :end] = prompt + new
    mask[b, start - 1:end - 1] = 1.0  # target t is token t + 1
    logps[b, start - 1:end - 1] = logp
  return Rollouts(tokens, mask, logps, [s.text for s in sequences],
                  np.array([len(new) for _, new, _ in rows], np.int32))


