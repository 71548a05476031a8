"""Text generation from trained params (full forward per token; no cache yet)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_pretrain import model as model_lib


@functools.partial(jax.jit, static_argnames=('model', 'prompt_len', 'temperature'))
def _generate(model, params, tokens_1xS, rng, *, prompt_len: int, temperature: float):
  def body(t, carry):
    tokens, rng = carry
    logits_1xSxV = model.apply({'params': params}, tokens)
    logits_V = jax.lax.dynamic_index_in_dim(logits_1xSxV[0], t - 1, keepdims=False)
    rng, key = jax.random.split(rng)
    if temperature > 0:
      nxt = jax.random.categorical(key, logits_V / temperature)
    else:
      nxt = jnp.argmax(logits_V)
    return tokens.at[0, t].set(nxt.astype(tokens.dtype)), rng
  tokens, _ = jax.lax.fori_loop(prompt_len, tokens_1xS.shape[1], body, (tokens_1xS, rng))
  return tokens


def generate_text(model_config: model_lib.ModelConfig, params, tokenizer, prompt: str,
                  max_new_tokens: int, temperature: float = 0.8, seed: int = 0) -> str:
  """Continuation of prompt (decoded new tokens only), stopping at EOS."""
  # Plain XLA attention and no remat: runs anywhere, and no mesh (params are gathered by jit).
  model = model_lib.Transformer(dataclasses.replace(model_config, attention='xla', remat='none'))
  prompt_ids = np.asarray(tokenizer.encode(prompt), np.int32)
  tokens = np.full((1, len(prompt_ids) + max_new_tokens), tokenizer.pad_id, np.int32)
  tokens[0, :len(prompt_ids)] = prompt_ids
  out = np.asarray(_generate(model, params, jnp.asarray(tokens), jax.random.key(seed),
                             prompt_len=len(prompt_ids), temperature=temperature))
  new = out[0, len(prompt_ids):].tolist()
  if tokenizer.eos_id in new:
    new = new[:new.index(tokenizer.eos_id)]
  return tokenizer.decode(new)
