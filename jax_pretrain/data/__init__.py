"""Input pipeline: what the trainer calls to get batches.

  sources = data.open_sources(config)          # data.train / data.val parsed once, the tokenizer
  batches = data.open_batches(resolved_config, sources, process_index, process_count)

`open_batches` returns a `Data` with
  tokenizer      encode/decode, vocab_size, bos_id, eos_id, pad_id
  train          an endless iterator of {'tokens': int32 [local_batch, seq_len + 1]} (SFT rows
                 also 'weights' and 'segments') starting at a given global batch, so a resumed
                 run draws exactly what an uninterrupted one would
  eval_batches() a fresh pass over the fixed held-out set, the same batches every call; rows past
                 the end of the data are filled with pad_id (the loss ignores them)
Each process gets only its own rows: local_batch = batch_size // process_count.
  data.Prefetcher(batches.train, batch_sharding) puts them on the devices ahead of use (a thread).
  data.eval_sets(config, tokenizer, batch_size, data='', split='val', max_tokens=0): a finished
  run's eval data (or other sources), one EvalSet (name, weight, batches in order, the UTF-8
  bytes of its targets) per source, as evaluate.py scores it.

Sources (config.data.train / .val, see docs/data.md): prepared directories (scripts/prepare_data.py,
recommended for real runs), token files (.npy/.bin), raw text (.jsonl/.txt, also gzip or zstd
compressed, .parquet, tfds:NAME, hf:NAME, hf:// Parquet, embedded) tokenized here on the fly, and
synthetic random tokens. Modules: loader (this API), sources (source lists and their kinds),
formats (file formats), hub (Hugging Face datasets), tokenizer, tokenizer_json (a tokenizer as
Hugging Face's tokenizer.json), tokens (token files and streams), prepare (text -> token files),
sft (fine-tuning examples, packed), pipeline (grain), prefetch (Prefetcher), corpus (the
embedded text), errors (DataError).
"""
from jax_pretrain.data.errors import DataError
from jax_pretrain.data.loader import Data
from jax_pretrain.data.loader import EvalSet
from jax_pretrain.data.loader import Sources
from jax_pretrain.data.loader import eval_sets
from jax_pretrain.data.loader import open_batches
from jax_pretrain.data.loader import open_sources
from jax_pretrain.data.prefetch import Prefetcher

__all__ = ['Data', 'DataError', 'EvalSet', 'Prefetcher', 'Sources', 'eval_sets',
           'open_batches', 'open_sources']
