"""A tokenizer's chat template, from data.tokenizer to the run's tokenizer/ (which the server reads)
and to a Hugging Face export (which transformers reads), and a chat's prompt: the ids that SFT
trained on before the assistant's turn."""
import json
import os

import numpy as np
import pytest

from jax_pretrain.data import sft
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data import tokenizer_json

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
CONVERSATION = [{'role': 'system', 'content': 'Be brief.'},
                {'role': 'user', 'content': '2 + 3 ='},
                {'role': 'assistant', 'content': '5'},
                {'role': 'user', 'content': 'and 4 + 3 ='}]
TEXTS = ['user assistant system hello 2 + 3 = 5, and 4 + 3 = 7. Be brief.'] * 20


def _with_template(directory) -> None:
  """Adds CHATML to directory's tokenizer_config.json (written if absent)."""
  path = os.path.join(directory, tokenizer_lib.HF_CONFIG_FILE)
  config = tokenizer_lib.read_hf_file(str(directory), tokenizer_lib.HF_CONFIG_FILE) or {}
  with open(path, 'w', encoding='utf-8') as f:
    json.dump({**config, 'chat_template': CHATML}, f)


def _data_tokenizer(kind: str, directory) -> str:
  """data.tokenizer for a tokenizer of this kind whose tokenizer_config.json has CHATML."""
  if kind == 'byte':  # a tokenizer directory (a run's tokenizer/, say)
    tokenizer_lib.save(tokenizer_lib.ByteTokenizer(), str(directory))
    spec = str(directory)
  elif kind == 'sentencepiece':  # a file, its tokenizer_config.json beside it
    os.makedirs(directory)
    spec = str(directory / 'sp.model')
    tokenizer_lib.train_sentencepiece(TEXTS, spec, 300, num_threads=1)
  else:
    spec = str(directory / 'tokenizer.json')
    tokenizer_lib.train_bytelevel_bpe(TEXTS, spec, 300)
  _with_template(directory)
  return spec


@pytest.mark.parametrize('kind', ['byte', 'sentencepiece', 'bytelevel'])
def test_a_chat_template_travels_to_the_run_and_to_the_hf_export(kind, tmp_path):
  transformers = pytest.importorskip('transformers')
  data = tokenizer_lib.load(_data_tokenizer(kind, tmp_path / 'data_tokenizer'))
  prompt = sft.chat_prompt(sft.tokenizer_chat_template(data), CONVERSATION, data).tolist()
  # The run's tokenizer/ (workdir.save_tokenizer), as the server loads it.
  tokenizer_lib.save(data, str(tmp_path / 'run_tokenizer'))
  served = tokenizer_lib.load(str(tmp_path / 'run_tokenizer'))
  template = sft.tokenizer_chat_template(served)
  assert template is not None
  assert sft.chat_prompt(template, CONVERSATION, served).tolist() == prompt
  # hf.export's tokenizer files, read by transformers: the same ids for a first turn (one piece:
  # SFT encodes a conversation piece by piece, transformers its whole text).
  assert tokenizer_json.write(str(tmp_path / 'hf'), served) == []
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'hf'))
  first = CONVERSATION[:2]
  assert list(theirs.apply_chat_template(first, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)) == (
      sft.chat_prompt(template, first, served).tolist())


def test_a_chat_prompt_is_what_sft_trained_on_before_the_assistants_turn(tmp_path):
  tok = tokenizer_lib.load(_data_tokenizer('bytelevel', tmp_path))
  template = sft.tokenizer_chat_template(tok)
  example = [*CONVERSATION, {'role': 'assistant', 'content': '7'}]
  pieces, error = sft.example_pieces(json.dumps({'messages': example}), template, 'test')
  assert error is None
  ids, is_target = sft.encode_pieces(pieces, tok)
  starts = np.flatnonzero(np.diff(is_target.astype(int), prepend=0) == 1)  # of each turn
  last_turn = starts[-1]
  assert sft.chat_prompt(template, CONVERSATION, tok).tolist() == ids[:last_turn].tolist()
  assert tok.decode(ids[last_turn:]).startswith('7<|im_end|>')


def test_a_tokenizer_without_a_chat_template_has_none(tmp_path):
  tokenizer_lib.save(tokenizer_lib.ByteTokenizer(), str(tmp_path))
  assert sft.tokenizer_chat_template(tokenizer_lib.load(str(tmp_path))) is None
  assert sft.tokenizer_chat_template(tokenizer_lib.load('byte')) is None
