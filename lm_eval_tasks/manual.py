"""Two small tasks on the end of the embedded manual (the part the embedded default holds out for
eval), so that the harness runs on runs/default with no network:

- manual_mc: which of four continuations follows a 64-character passage (acc, acc_norm);
- manual_gen: the next word after a passage, generated greedily (exact_match).

  python -m jax_pretrain.lm_eval --workdir=runs/default --tasks=manual_mc,manual_gen \
      --include_path=lm_eval_tasks

The YAMLs name these functions (`custom_dataset: !function manual.mc`); lm_eval calls them with
the task's metadata. They read the manual as jax_pretrain.data.corpus does, without importing
jax_pretrain, so that any lm_eval installation runs them (its Hugging Face backend on an export).
"""
from pydoc_data import topics

import datasets

HELD_OUT_CHARS = 20_000  # the end of the manual: inside the 5% that training holds out
CONTEXT, CONTINUATION, STRIDE = 64, 24, 100


def _held_out() -> str:
  return '\n'.join(topics.topics[k] for k in sorted(topics.topics))[-HELD_OUT_CHARS:]


def mc(**kwargs):
  """Docs {context, choices, label}: the true continuation among three from other passages."""
  del kwargs
  text = _held_out()
  passages = [(text[s:s + CONTEXT], text[s + CONTEXT:s + CONTEXT + CONTINUATION])
              for s in range(0, len(text) - CONTEXT - CONTINUATION, STRIDE)]
  docs = []
  for i, (context, true) in enumerate(passages):
    others = [passages[(i + 7 * k) % len(passages)][1] for k in (1, 2, 3)]
    label = i % 4
    docs.append({'context': context, 'choices': others[:label] + [true] + others[label:],
                 'label': label})
  return {'test': datasets.Dataset.from_list(docs)}


def gen(**kwargs):
  """Docs {context, word}: a passage that ends with a space, and the word after it."""
  del kwargs
  text = _held_out()
  docs = []
  for start in range(CONTEXT, len(text) - CONTINUATION, STRIDE):
    space = text.index(' ', start)
    word = text[space + 1:].split(' ', 1)[0].split('\n', 1)[0]
    if word.isalpha():
      docs.append({'context': text[space + 1 - CONTEXT:space + 1], 'word': word})
  return {'test': datasets.Dataset.from_list(docs)}
