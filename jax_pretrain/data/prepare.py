"""Tokenizing text sources once into a prepared directory that training memory-maps.

  OUTPUT/meta.json          what is inside: tokenizer record, sources with weights and counts,
                            and the fingerprint of the inputs (re-running on the same is a no-op)
  OUTPUT/tokenizer.model    the sentencepiece model, or tokenizer.json (none for the byte tokenizer)
  OUTPUT/train/K-NAME.bin   token ids of source K, documents each followed by EOS (tokens.py)
  OUTPUT/train/K-NAME.json  its sidecar; K-NAME.docs.npy its document index
  OUTPUT/val/...            the same for the eval split (--val sources, or carved by --val-ratio)

Work items (Source.work_items) are tokenized by a pool of processes, in order, so the output does
not depend on the number of workers. Everything is written into OUTPUT.tmp-PID and renamed to OUTPUT
only when complete: an interrupted run never leaves anything that training would read.
"""
import glob
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import time

from jax_pretrain.data import formats
from jax_pretrain.data import sources
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data import tokens as tokens_lib
from jax_pretrain.data.errors import DataError

FORMAT = 'jax_pretrain.prepared/1'

_worker: dict = {}  # per worker process: the tokenizer and on_bad_record


def _init_worker(tokenizer_spec: str, on_bad_record: str) -> None:
  _worker['tokenizer'] = tokenizer_lib.load(tokenizer_spec)
  _worker['on_bad_record'] = on_bad_record


def _encode(item: formats.WorkItem) -> sources.Encoded:
  return sources.encode(item, _worker['tokenizer'], _worker['on_bad_record'])


def _name(k: int, source: sources.Source) -> str:
  """K-SLUG: K keeps names unique and ordered; SLUG (from the last two path parts) is for people."""
  tail = os.path.join(*source.text.replace('*', '').rstrip('/').split('/')[-2:])
  slug = re.sub(r'[^A-Za-z0-9._-]+', '_', tail).strip('_.')[:60]
  return f'{k}-{slug or "source"}'


def _fingerprint(planned, tokenizer, val_ratio: float, on_bad_record: str) -> str:
  """Everything the output depends on: sources, their files (size, mtime), tokenizer, options."""
  inputs = [FORMAT, tokenizer.identity, val_ratio, on_bad_record]
  for split, source, items in planned:
    stamps = [_stamps(p) for p in sorted({i.path for i in items})]
    inputs.append([split, source.text, source.weight, items[0].field, len(items), stamps])
  return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()


def _stamps(path: str) -> list:
  """(path, size, mtime) of a file, or of every file in the local directory that a dataset's
  work items name (hf:DIR@SPLIT); a remote source only by its name."""
  local = path if os.path.isfile(path) else path.rsplit('@', 1)[0]
  files = [local] if os.path.isfile(local) else sorted(
      os.path.join(d, f) for d, _, names in os.walk(local) for f in names)
  return [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files] or [path]


def prepare(train: str, output_dir: str, tokenizer: str = 'byte', val: str = '',
            val_ratio: float = 0.0, text_field: str = 'text', on_bad_record: str = 'error',
            tfds_data_dir: str = '', workers: int = 0, log=print) -> dict:
  """Tokenizes the sources of `train` (and `val`) into output_dir; returns its meta.json.

  workers: processes that tokenize (0: one per core; 1: this process only).
  """
  if val and val_ratio:
    raise DataError('give either val sources or a val ratio, not both.')
  if not 0 <= val_ratio < 1:
    raise DataError(f'val ratio {val_ratio} must lie in [0, 1).')
  if on_bad_record not in ('error', 'skip'):
    raise DataError(f"on_bad_record={on_bad_record!r}: choose 'error' or 'skip'.")
  if os.path.exists(output_dir) and not os.path.isfile(os.path.join(output_dir, 'meta.json')):
    raise DataError(f'{output_dir}: exists and is not prepared data; refusing to replace it.')
  tok = tokenizer_lib.load(tokenizer)
  options = sources.ReadOptions(text_field, tfds_data_dir, on_bad_record)
  planned = []  # (split, source, work items)
  for split, specs in (('train', train), ('val', val)):
    for source in sources.parse(specs, f'--{split}') if specs else []:
      if not source.is_text:
        raise DataError(f'{source.text}: holds no text to tokenize (token ids or synthetic) and '
                        'needs no preparation; give it to training directly.')
      planned.append((split, source, source.work_items(options)))

  fingerprint = _fingerprint(planned, tok, val_ratio, on_bad_record)
  meta_path = os.path.join(output_dir, 'meta.json')
  if os.path.isfile(meta_path):
    with open(meta_path, encoding='utf-8') as f:
      meta = json.load(f)
    if meta.get('fingerprint') == fingerprint:
      log(f'{output_dir} is up to date (same sources, files and tokenizer): nothing to do.')
      return meta

  for stale in glob.glob(glob.escape(output_dir) + '.tmp-*'):  # left by interrupted runs
    shutil.rmtree(stale, ignore_errors=True)
  tmp = f'{output_dir}.tmp-{os.getpid()}'
  os.makedirs(os.path.join(tmp, 'train'))
  os.makedirs(os.path.join(tmp, 'val'))
  workers = workers or os.cpu_count() or 1
  pool = None
  if workers > 1:
    pool = multiprocessing.get_context('spawn').Pool(
        workers, initializer=_init_worker, initargs=(tokenizer, on_bad_record))
  else:
    _init_worker(tokenizer, on_bad_record)
  try:
    t0 = time.perf_counter()
    meta = dict(format=FORMAT, fingerprint=fingerprint, tokenizer=tokenizer_lib.save(tok, tmp),
                val_ratio=val_ratio, train=[], val=[])
    record = dict(meta['tokenizer'])  # each token file's sidecar: its file is one level up
    if 'tokenizer_file' in record:
      record['tokenizer_file'] = '../' + record['tokenizer_file']
    dtype = tokens_lib.token_dtype(tok.vocab_size)
    log(f'{"source":<48} {"documents":>12} {"tokens":>14} {"skipped":>8} {"MB text":>9}')
    text_bytes = 0
    for k, (split, source, items) in enumerate(planned):
      name = _name(k, source)
      writer = tokens_lib.Writer(os.path.join(tmp, split, name), dtype)
      stats = sources.FileStats()
      results = pool.imap(_encode, items) if pool else map(_encode, items)
      for encoded in results:
        writer.append(encoded.tokens, encoded.doc_lengths)
        stats.add(encoded)
      stats.check()
      info = writer.close(dict(record, source=source.text))
      total = stats.total()
      text_bytes += total.text_bytes
      entry = dict(name=name, source=source.text, weight=source.weight, documents=total.documents,
                   tokens=total.tokens, skipped=total.skipped, text_bytes=total.text_bytes,
                   files=sorted(stats.by_path))
      meta[split].append(entry)
      log(f'{source.text + " (" + split + ")":<48} {total.documents:>12,} {total.tokens:>14,} '
          f'{total.skipped:>8,} {total.text_bytes / 1e6:>9.1f}')
      for line in stats.skip_report():
        log(f'  {line}')
      if split == 'train' and val_ratio > 0:
        _carve_val(tmp, name, info, tok.eos_id, val_ratio, entry, meta, log)
    seconds = time.perf_counter() - t0
    meta['seconds'] = round(seconds, 3)
    tokens_lib.write_json(os.path.join(tmp, 'meta.json'), meta)
    _replace(tmp, output_dir)
    cores = min(workers, os.cpu_count() or 1)
    log(f'prepared {text_bytes / 1e6:.1f} MB of text in {seconds:.1f} s with {workers} worker '
        f'process(es): {text_bytes / 1e6 / seconds:.2f} MB/s, '
        f'{text_bytes / 1e6 / seconds / cores:.2f} MB/s per core -> {output_dir}')
    return meta
  finally:
    if pool is not None:
      pool.terminate()
    shutil.rmtree(tmp, ignore_errors=True)


def _carve_val(tmp: str, name: str, info: dict, eos_id: int, val_ratio: float, entry: dict,
               meta: dict, log) -> None:
  """Moves the last val_ratio of a written train source (from a document start) to val/."""
  stem = os.path.join(tmp, 'train', name)
  stream, _ = tokens_lib.open_stream([stem + '.bin'], name)
  train_part, _ = tokens_lib.carve(stream, eos_id, val_ratio)
  cut = len(train_part)
  del stream, train_part  # release the memory map before truncating the file
  if cut == info['num_tokens']:
    log(f'  {entry["source"]}: too small to hold out {val_ratio:.1%}; no val split from it')
    return
  train_info, val_info = tokens_lib.split_file(stem, cut, os.path.join(tmp, 'val', name), info)
  entry.update(tokens=train_info['num_tokens'], documents=train_info['num_documents'])
  meta['val'].append(dict(name=name, source=entry['source'], weight=entry['weight'],
                          documents=val_info['num_documents'], tokens=val_info['num_tokens']))
  log(f'  held out for val: {val_info["num_documents"]:,} documents, '
      f'{val_info["num_tokens"]:,} tokens')


def _replace(tmp: str, output_dir: str) -> None:
  """Puts the complete tmp directory in place of output_dir (renames, no partial state)."""
  if os.path.exists(output_dir):
    old = f'{output_dir}.old-{os.getpid()}'
    os.rename(output_dir, old)
    os.rename(tmp, output_dir)
    shutil.rmtree(old)
  else:
    os.rename(tmp, output_dir)
