"""Text from the Hugging Face ecosystem: datasets (`hf:NAME_OR_PATH[:CONFIG][@SPLIT]`,
sources.HfDataset and task files in tasks.py) and Parquet files on URLs that fsspec opens
(`hf://datasets/...`, sources.RemoteFiles).

A dataset is opened the way its name says:
  hf:PATH              a directory written by Dataset.save_to_disk (a DatasetDict: its SPLIT,
                       default train): Arrow files, memory-mapped
  hf:PATH@SPLIT        any other local directory: datasets.load_dataset(PATH, split=SPLIT)
                       (data files such as *.jsonl or *.parquet; cached as Arrow files)
  hf:OWNER/NAME@SPLIT  a dataset on the Hub: load_dataset(..., streaming=True), nothing downloaded
                       ahead of use
A `:CONFIG` after the name or path (hf:openai/gsm8k:main@test) is the dataset's configuration,
load_dataset's second argument; a saved directory has none.
A local dataset is random access: work items are row ranges, read in any process, and its tokens
are the same on every start, so runs on it are deterministic and resume exactly. A streamed one
has no random access: one work item per shard (data file), read in order; its data is the same
only while the dataset's files on the Hub do not change, which nothing checks, and a resumed run
reads it again. work_items() says so in a warning. To pin such data, prepare it once with
scripts/prepare_data.py, or read its Parquet files at a revision: hf://datasets/NAME@REV/*.parquet.

Needs the datasets package (hf:) or huggingface_hub (hf://), imported only when used.
"""
import functools
import os

from absl import logging

from jax_pretrain.data import formats
from jax_pretrain.data.errors import DataError

_ROWS_PER_ITEM = 2048  # rows of a local dataset per work item


def _datasets():
  try:
    import datasets  # noqa: PLC0415  (slow, and optional)
  except ImportError:
    raise DataError('hf: sources need the datasets package: `pip install datasets`.') from None
  datasets.disable_progress_bars()  # our own log lines say what was read
  return datasets


def is_saved(path: str) -> bool:
  """A directory written by save_to_disk (a Dataset or a DatasetDict)."""
  return any(os.path.isfile(os.path.join(path, f)) for f in ('state.json', 'dataset_dict.json'))


def parse(text: str) -> tuple[str, str]:
  """(NAME, SPLIT) of hf:NAME_OR_PATH[:CONFIG][@SPLIT]: NAME keeps its :CONFIG, SPLIT is '' when
  none is given (the default)."""
  name, _, split = text.removeprefix('hf:').partition('@')
  return name, split


def spec(name: str, split: str) -> str:
  """hf:NAME[@SPLIT], as messages name a dataset."""
  return f'hf:{name}' + (f'@{split}' if split else '')


def _path_and_config(name: str) -> tuple[str, str]:
  """NAME_OR_PATH and CONFIG of NAME_OR_PATH[:CONFIG] (CONFIG '': none). The colon counts only in
  the last path component, and not when the whole name is a directory."""
  path, sep, config = name.rpartition(':')
  if not sep or '/' in config or os.path.isdir(name):
    return name, ''
  return path, config


@functools.lru_cache(maxsize=16)
def open_dataset(name: str, split: str):
  """(dataset, streamed) for hf:NAME[:CONFIG]@SPLIT (split '' : the default), opened once per
  process."""
  datasets = _datasets()
  where = spec(name, split)
  path, config = _path_and_config(name)
  try:
    if os.path.isdir(path) and is_saved(path):
      if config:
        raise DataError(f'{where}: a saved dataset has no configurations; drop :{config}.')
      ds = datasets.load_from_disk(path)
      if isinstance(ds, datasets.DatasetDict):
        if (split or 'train') not in ds:
          raise DataError(f'{where}: no split {split or "train"!r} (splits: {", ".join(ds)}).')
        return ds[split or 'train'], False
      if split:
        raise DataError(f'{where}: a saved Dataset has no splits; drop @{split}.')
      return ds, False
    streamed = not os.path.isdir(path)
    named = (path, config) if config else (path,)
    return datasets.load_dataset(*named, split=split or 'train', streaming=streamed), streamed
  except DataError:
    raise
  except Exception as e:  # noqa: BLE001  (datasets raises many types)
    raise DataError(f'{where}: cannot open it ({type(e).__name__}: {str(e).strip()[:300]}).'
                    ) from None


def work_items(reader: str, name: str, split: str, field: str) -> list[formats.WorkItem]:
  """Work items of a dataset (see the module docstring); item.path is NAME@SPLIT."""
  ds, streamed = open_dataset(name, split)
  where = spec(name, split)
  columns = ds.column_names  # None for a streamed dataset without declared features
  if columns is not None and field not in columns:
    raise DataError(f'{where}: no column "{field}" (columns: {", ".join(columns)}); write '
                    f'{where}#COLUMN or set data.text_field.')
  if streamed:
    logging.warning(
        '%s is streamed from the Hub: its data is the same on every read only while the '
        "dataset's files there do not change (nothing checks it), and a resumed run reads it "
        'again. To pin it, prepare it once with scripts/prepare_data.py, or read its Parquet '
        'files at a revision (hf://datasets/%s@REVISION/...).', where,
        _path_and_config(name)[0])
    return [formats.WorkItem(reader, f'{name}@{split}', k, k + 1, 1, field)
            for k in range(ds.num_shards)]
  if len(ds) == 0:
    raise DataError(f'{where}: the split is empty.')
  return [formats.WorkItem(reader, f'{name}@{split}', i, min(i + _ROWS_PER_ITEM, len(ds)), i + 1,
                           field) for i in range(0, len(ds), _ROWS_PER_ITEM)]


def read(item: formats.WorkItem):
  """The records of one work item: rows [start, stop), or (streamed) shard `start` in order."""
  ds, streamed = open_dataset(*item.path.rsplit('@', 1))
  if streamed:
    for n, example in enumerate(ds.shard(num_shards=ds.num_shards, index=item.start), 1):
      if item.field not in example:
        yield n, None, f'no "{item.field}" field'
      else:
        yield (n, *formats.text_value(example[item.field], item.field))
    return
  values = ds.select_columns(item.field)[item.start:item.stop][item.field]
  for n, value in enumerate(values, item.first):
    yield (n, *formats.text_value(value, item.field))


def location(item: formats.WorkItem, n: int) -> str:
  _, streamed = open_dataset(*item.path.rsplit('@', 1))
  name = spec(*item.path.rsplit('@', 1))
  return f'{name}: shard {item.start}, record {n}' if streamed else f'{name}: row {n}'


def glob(pattern: str) -> list[str]:
  """The Parquet files a URL glob matches (hf://datasets/OWNER/NAME[@REVISION]/..., or any URL
  fsspec opens: s3://, gs://, file://), sorted, as URLs."""
  try:
    import fsspec  # noqa: PLC0415
    fs, path = fsspec.core.url_to_fs(pattern)
  except (ImportError, ValueError) as e:
    raise DataError(f'{pattern}: cannot open this URL ({e}); hf:// paths need huggingface_hub: '
                    '`pip install huggingface_hub`.') from None
  try:
    urls = [fs.unstrip_protocol(p) for p in sorted(fs.glob(path))]
  except Exception as e:  # noqa: BLE001  (network, permissions, no such repo)
    raise DataError(f'{pattern}: cannot list it ({type(e).__name__}: {str(e).strip()[:300]}).'
                    ) from None
  if not urls:
    raise DataError(f'{pattern}: matches no files.')
  for url in urls:
    if formats.find(url) is not formats.Parquet:
      raise DataError(f'{url}: only Parquet files are read from URLs; download other files '
                      'first.')
  return urls
