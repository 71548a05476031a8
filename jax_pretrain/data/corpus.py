"""The embedded corpus: the Python reference manual's text, shipped with every Python in
pydoc_data.topics (about 465 KB of English). Needs no network."""
import numpy as np


def embedded_documents() -> list[str]:
  from pydoc_data import topics  # noqa: PLC0415
  return [topics.topics[k] for k in sorted(topics.topics)]


def concatenate(docs: list[str], tokenizer) -> np.ndarray:
  """Documents joined into one stream, each followed by EOS."""
  parts = []
  for doc in docs:
    parts.append(tokenizer.encode(doc))
    parts.append(np.array([tokenizer.eos_id], np.int32))
  return np.concatenate(parts).astype(np.int32)
