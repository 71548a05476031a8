"""TFDS sources through tfds.data_source (array_record, no TensorFlow), on a dataset built here."""
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain.data import prepare
from jax_pretrain.data.errors import DataError
from tests.conftest import build_data

tfds = pytest.importorskip('tensorflow_datasets')

NAME = 'jax_pretrain_tiny_text'


class JaxPretrainTinyText(tfds.core.GeneratorBasedBuilder):
  """30 train and 10 test documents with a 'text' and a 'title' feature."""
  VERSION = tfds.core.Version('1.0.0')
  # Not 'tests.test_data_tfds': for a module inside a package, tfds looks up the builder's code
  # with the importlib_resources backport, which is not installed (and not needed here).
  __module__ = 'test_data_tfds'

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'text': tfds.features.Text(), 'title': tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples(30, 'train'),
            'test': self._generate_examples(10, 'test')}

  def _generate_examples(self, n, split):
    for i in range(n):
      yield i, {'text': f'{split} document {i}: ' + 'the quick brown fox ' * (i + 3),
                'title': f'title {i}'}


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp('tfds'))
  JaxPretrainTinyText(data_dir=directory, file_format='array_record').download_and_prepare()
  return directory


def make_config(train, data_dir, **data):
  c = config_lib.preset('test')
  c.data.train, c.data.tfds_data_dir = train, data_dir
  for k, v in data.items():
    c.data[k] = v
  return c


def test_tfds_source_trains_and_evaluates(data_dir):
  data = build_data(make_config(f'tfds:{NAME}:0.5,embedded:0.5', data_dir,
                                    val=f'tfds:{NAME}@test'))
  tokens = next(data.train)['tokens']
  assert tokens.shape == (16, 33)
  text = ''.join(data.tokenizer.decode(r) for r in tokens)
  assert 'quick brown fox' in text
  eval_text = ''.join(data.tokenizer.decode(r) for b in data.eval_batches() for r in b['tokens'])
  assert 'test document' in eval_text and 'train document' not in eval_text


def test_tfds_feature_and_dataset_errors(data_dir):
  with pytest.raises(DataError, match=f'tfds:{NAME}@train: no feature "body"'):
    build_data(make_config(f'tfds:{NAME}#body', data_dir))
  with pytest.raises(DataError, match='tfds:no_such_dataset_xyz@train: cannot open it'):
    build_data(make_config('tfds:no_such_dataset_xyz', data_dir))


def test_prepare_a_tfds_source(tmp_path, data_dir):
  meta = prepare.prepare(f'tfds:{NAME}', str(tmp_path / 'out'), val=f'tfds:{NAME}@test#title',
                         tfds_data_dir=data_dir, workers=1, log=lambda _: None)
  assert meta['train'][0]['documents'] == 30 and meta['val'][0]['documents'] == 10
  data = build_data(make_config(str(tmp_path / 'out'), ''))
  assert next(data.train)['tokens'].shape == (16, 33)
  rows = np.concatenate([b['tokens'] for b in data.eval_batches()])
  assert 'title' in data.tokenizer.decode(rows[0])
