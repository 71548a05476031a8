"""Text generation from a trained run, through the engine (engine/, the one decoder).

  python -m jax_pretrain.sample --workdir=runs/x --prompt "The for statement " \
      [--prompt "Another prompt" ...] [--max_new_tokens 200 --temperature 0.8 --top_k 50 \
      --top_p 0.95 --seed 0]

Each prompt decodes in a slot of its own (row b samples with the seed and stream b, as the server's
n choices of one request do), sampling as engine/sampling.py says: temperature 0 is greedy
(argmax); otherwise the logits are divided by the temperature, cut to the top_k most likely tokens
(0: no cut) and then to the smallest set whose probability reaches top_p (1.0: no cut), and
sampled; ids the tokenizer cannot produce are never sampled. A row stops at EOS or after
max_new_tokens.
"""
import dataclasses

from absl import flags
import jax
import numpy as np

from jax_pretrain import cli
from jax_pretrain import engine as engine_lib
from jax_pretrain import model as model_lib
from jax_pretrain import workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 0.8
  top_k: int = 0  # 0: no top-k cut
  top_p: float = 1.0  # 1.0: no nucleus cut


class _Ids:
  """What the engine reads of a tokenizer, for callers that give and take ids (no text)."""

  def __init__(self, vocab_size: int, eos_id: int, pad_id: int):
    self.vocab_size, self.eos_id, self.pad_id = vocab_size, eos_id, pad_id

  def decode(self, ids) -> str:
    return ''


def generate(model_config: model_lib.ModelConfig, params, prompts: list, max_new_tokens: int, *,
             eos_id: int, pad_id: int, vocab_size: int | None = None,
             sampling: Sampling = Sampling(), seed: int = 0,
             kv_cache_dtype: str = 'auto') -> list[list[int]]:
  """New token ids for each prompt (a sequence of ids, at least one), EOS excluded: the engine's
  (engine/), every prompt in a slot of its own, row b sampling with `seed` and stream b.

  vocab_size: ids at or above it are never sampled (default: the model's vocabulary).
  """
  tokenizer = _Ids(vocab_size or model_config.vocab_size, eos_id, pad_id)
  return [seq.tokens for seq in _generate(model_config, params, tokenizer, prompts,
                                          max_new_tokens, sampling, seed, kv_cache_dtype)]


def _generate(model_config, params, tokenizer, prompts: list, max_new_tokens: int,
              sampling: Sampling, seed: int, kv_cache_dtype: str) -> list[engine_lib.Sequence]:
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError('every prompt needs at least one token')
  # A power of two: calls with other lengths share the engine's compiled shapes.
  context = engine_lib.bucket(max(len(p) for p in prompts) + max_new_tokens, 1 << 30,
                              engine_lib.MIN_BUCKET)
  eng = engine_lib.Engine(model_config, params, tokenizer, slots=len(prompts), context=context,
                          kv_cache_dtype=kv_cache_dtype)
  return eng.generate([engine_lib.Sequence(
      prompt=[int(t) for t in p], max_new_tokens=max_new_tokens, temperature=sampling.temperature,
      top_k=sampling.top_k, top_p=sampling.top_p, seed=seed, stream=b)
      for b, p in enumerate(prompts)])


def encode_prompt(tokenizer, prompt: str) -> np.ndarray:
  """The prompt's ids; an empty prompt is [EOS], the start of a new document as in training."""
  ids = np.asarray(tokenizer.encode(prompt), np.int32)
  return ids if len(ids) else np.array([tokenizer.eos_id], np.int32)


def generate_texts(model_config: model_lib.ModelConfig, params, tokenizer, prompts: list[str],
                   max_new_tokens: int, *, temperature: float = 0.8, top_k: int = 0,
                   top_p: float = 1.0, seed: int = 0, kv_cache_dtype: str = 'auto') -> list[str]:
  """Continuations (decoded new tokens only) of a batch of prompts, each stopping at EOS."""
  return [seq.text for seq in _generate(
      model_config, params, tokenizer, [encode_prompt(tokenizer, p) for p in prompts],
      max_new_tokens, Sampling(temperature, top_k, top_p), seed, kv_cache_dtype)]


def generate_text(model_config: model_lib.ModelConfig, params, tokenizer, prompt: str,
                  max_new_tokens: int, temperature: float = 0.8, seed: int = 0,
                  top_k: int = 0, top_p: float = 1.0) -> str:
  """Continuation of one prompt (decoded new tokens only), stopping at EOS."""
  return generate_texts(model_config, params, tokenizer, [prompt], max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)[0]


def main():
  f = flags.FLAGS
  run = workdir_lib.load(f.workdir, f.step, devices=jax.devices()[:1])
  prompts = f.prompt or ['']
  texts = generate_texts(run.config.model, run.engine_params, run.tokenizer, prompts,
                         f.max_new_tokens, temperature=f.temperature, top_k=f.top_k,
                         top_p=f.top_p, seed=f.seed, kv_cache_dtype=f.kv_cache_dtype)
  for k, (prompt, text) in enumerate(zip(prompts, texts)):
    if k:
      print('-' * 40)
    print(f'{prompt}{text}' if f.echo else text, flush=True)


if __name__ == '__main__':
  # Flags only when run as a program: other modules import this one (pretrain.py for its end-of-run
  # sample; lm_eval, serve, evaluate --task, grpo), and lm_eval and evaluate define flags of the
  # same names (--seed, --max_new_tokens).
  cli.define_run_flags()
  flags.DEFINE_multi_string('prompt', [], 'Prompt; repeat the flag for a batch of prompts (none: '
                            'one empty prompt, i.e. the start of a document).')
  flags.DEFINE_integer('max_new_tokens', 200, 'Tokens to generate at most per prompt.')
  flags.DEFINE_float('temperature', 0.8, 'Softmax temperature; 0 is greedy decoding.')
  flags.DEFINE_integer('top_k', 50, 'Sample among the k most likely tokens; 0 disables.')
  flags.DEFINE_float('top_p', 0.95, 'Nucleus sampling: the smallest set of tokens with this '
                     'probability; 1.0 disables.')
  flags.DEFINE_integer('seed', 0, 'Random seed of the sampling.')
  flags.DEFINE_bool('echo', True, 'Print each prompt before its continuation.')
  cli.define_kv_cache_flag()
  cli.run(main)
