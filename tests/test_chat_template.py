"""One rendering of a chat (data/chat.py): a conversation rendered once and encoded once, to the ids
transformers' apply_chat_template gives (a byte-level BPE, a Metaspace tokenizer.json and a
sentencepiece model; Qwen3-, Llama-3- and Mistral-style templates; single- and multi-turn); SFT's
assistant turns equal to transformers' assistant mask; the template from chat_template.jinja or
tokenizer_config.json, travelling to the run's tokenizer/, through the HF import and the HF
export."""
import dataclasses
import json
import os
import shutil

from flax.core import meta
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import hf
from jax_pretrain import model as model_lib
from jax_pretrain.data import chat
from jax_pretrain.data import sft
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data import tokenizer_json
from jax_pretrain.data.errors import DataError
from tests import chat_templates
from tests.chat_templates import CONVERSATIONS
from tests.chat_templates import QWEN3_MARKED
from tests.chat_templates import QWEN3_TRAINING
from tests.chat_templates import R1_LIKE
from tests.chat_templates import SYSTEM
from tests.chat_templates import TEMPLATES

transformers = pytest.importorskip('transformers')

BUILD = {'bytelevel': chat_templates.bytelevel, 'metaspace': chat_templates.metaspace,
         'sentencepiece': chat_templates.sentencepiece}


@pytest.fixture(scope='module')
def tokenizer_files(tmp_path_factory):
  """kind -> a directory with the tokenizer's file (built once)."""
  out = {}
  for kind, build in BUILD.items():
    directory = tmp_path_factory.mktemp(kind)
    shutil.rmtree(directory)
    build(directory)
    out[kind] = directory
  return out


def _directory(files, kind: str, name: str, where, template_file: bool = False) -> str:
  """A tokenizer directory of this kind with template `name`: its tokenizer_config.json names the
  template's BOS and EOS; the template there, or in chat_template.jinja."""
  template, bos, eos = TEMPLATES[name] if name in TEMPLATES else (name, '<s>', '</s>')
  shutil.copytree(files[kind], where)
  config = {'eos_token': eos, **({'bos_token': bos} if bos else {})}
  if kind == 'sentencepiece':  # (ids 1 and 2 are its BOS and EOS, whatever the template says)
    config.update(tokenizer_class='LlamaTokenizer', legacy=True, bos_token='<s>', eos_token='</s>')
  if template_file:
    with open(os.path.join(where, 'chat_template.jinja'), 'w', encoding='utf-8') as f:
      f.write(template)
  else:
    config['chat_template'] = template
  with open(os.path.join(where, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f)
  return str(where)


def _ours(directory: str):
  tok = tokenizer_lib.load(directory)
  template = chat.tokenizer_template(tok)
  assert template is not None
  return tok, template


def _theirs(directory: str, messages, **kw) -> list[int]:
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  return list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


@pytest.mark.parametrize('kind', list(BUILD))
@pytest.mark.parametrize('name', list(TEMPLATES))
@pytest.mark.parametrize('turns', list(CONVERSATIONS))
def test_a_chat_prompt_is_the_ids_transformers_gives(tokenizer_files, kind, name, turns,
                                                      tmp_path):
  directory = _directory(tokenizer_files, kind, name, tmp_path / 'tok')
  messages = ([] if name == 'mistral' else [SYSTEM]) + CONVERSATIONS[turns]
  tok, template = _ours(directory)
  ours = chat.prompt_ids(template, messages, tok).tolist()
  assert ours == _theirs(directory, messages, add_generation_prompt=True)
  if turns == 'multi' and name == 'qwen3':  # (the <think> of an earlier turn is dropped)
    assert 'hmm' not in template.render(messages, True)
  if kind == 'sentencepiece':  # HF export's tokenizer.json, read by transformers: the same ids
    assert tokenizer_json.write(str(tmp_path / 'hf'), tok) == []
    assert _theirs(str(tmp_path / 'hf'), messages, add_generation_prompt=True) == ours


@pytest.mark.parametrize('kind', list(BUILD))
@pytest.mark.parametrize('name', ['qwen3', 'qwen3_training', 'llama3', 'mistral'])
def test_sft_trains_on_the_ids_transformers_gives_and_its_assistant_tokens(
    tokenizer_files, kind, name, tmp_path):
  """An SFT conversation's ids are apply_chat_template's; its targets are transformers' assistant
  mask where the template marks the turns ({% generation %}), else the turns found by rendering
  prefixes (compared with the same template with the marks added): Qwen3's own, which drops the
  earlier turn's <think>, included."""
  template_text = QWEN3_TRAINING if name == 'qwen3_training' else TEMPLATES[name][0]
  directory = _directory(tokenizer_files, kind, 'qwen3' if name == 'qwen3_training' else name,
                         tmp_path / 'tok')
  messages = [*CONVERSATIONS['multi'], {'role': 'assistant', 'content': 'It is 7.'}]
  tok = tokenizer_lib.load(directory)
  specials = tokenizer_lib.hf_special_tokens(directory)
  ids, is_target = chat.example_ids(chat.ChatTemplate(template_text, specials, 'test'),
                                    messages, tok)
  if name == 'qwen3_training':
    marked = template_text
  elif name == 'qwen3':
    marked = QWEN3_MARKED
  else:  # the assistant's output (its content and end of turn) marked
    end = {'llama3': "'<|eot_id|>' %}", 'mistral': "{{ message['content'] + eos_token}}"}[name]
    marked = template_text.replace(end, {
        'llama3': "'<|eot_id|>' %}{% if message['role'] == 'assistant' %}{% set content = "
                  "'<|start_header_id|>assistant<|end_header_id|>\n\n' %}{{ content }}"
                  "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
                  "{% endgeneration %}{% set content = '' %}{% endif %}",
        'mistral': "{% generation %}{{ message['content'] + eos_token}}{% endgeneration %}"}[name])
    assert marked != template_text
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  out = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, chat_template=marked,
                                   return_assistant_tokens_mask=True)
  assert ids.tolist() == list(out['input_ids'])
  assert is_target.tolist() == [bool(x) for x in out['assistant_masks']]
  assert tok.decode(ids[is_target]).replace(' ', '').count('Itis') == 2  # both turns
  assert 'What' not in tok.decode(ids[is_target])
  assert ('hmm' in tok.decode(ids[is_target])) == (name != 'qwen3')  # (Qwen3's drops it)
  if name != 'qwen3_training':  # ids and targets unchanged by the marks
    marked_ids, marked_targets = chat.example_ids(chat.ChatTemplate(marked, specials, 'test'),
                                                  messages, tok)
    assert (marked_ids.tolist(), marked_targets.tolist()) == (ids.tolist(), is_target.tolist())


def test_a_template_whose_generation_prompt_the_turns_lack_needs_generation_marks(
    tokenizer_files, tmp_path):
  """A generation prompt that opens a <think> the rendered turns do not have (DeepSeek-R1's kind):
  served as is, but SFT cannot find the turn by rendering prefixes: the example is refused with
  the way out."""
  tok, template = _ours(_directory(tokenizer_files, 'bytelevel', R1_LIKE, tmp_path / 'tok'))
  messages = CONVERSATIONS['multi'][:2]
  assert chat.prompt_ids(template, messages[:1], tok).tolist() == _theirs(
      str(tmp_path / 'tok'), messages[:1], add_generation_prompt=True)
  with pytest.raises(ValueError, match=r'before message 1 .*\{% generation %\}'):
    chat.example_ids(template, messages, tok)
  example, error = sft.example_tokens(json.dumps({'messages': messages}), template, tok, 'a:1')
  assert example is None and 'rendering prefixes' in error
  # A template that drops an earlier turn's text: its '\n' alone is not taken for the turn.
  dropping = chat.ChatTemplate("{% for m in messages %}{{ (m['content'] if m['role'] == 'user' "
                               "or loop.last else '') + '\n' }}{% endfor %}", {}, 'test')
  with pytest.raises(ValueError, match='before message 1 '):
    dropping.assistant_spans([*messages, {'role': 'user', 'content': 'u'},
                              {'role': 'assistant', 'content': 'a'}])


@pytest.mark.parametrize('in_file', [False, True], ids=['tokenizer_config', 'chat_template_jinja'])
def test_the_template_travels_to_the_run_the_hf_export_and_import(tokenizer_files, in_file,
                                                                  tmp_path):
  """From chat_template.jinja (transformers' save_pretrained since 4.47) or tokenizer_config.json:
  kept in the run's tokenizer/, written by HF export, brought by HF import; the same ids."""
  directory = _directory(tokenizer_files, 'bytelevel', 'qwen3', tmp_path / 'tok',
                         template_file=in_file)
  messages = [SYSTEM, *CONVERSATIONS['multi']]
  tok, template = _ours(directory)
  expected = _theirs(directory, messages, add_generation_prompt=True)
  assert chat.prompt_ids(template, messages, tok).tolist() == expected
  tokenizer_lib.save(tok, str(tmp_path / 'run_tokenizer'))  # the run's tokenizer/
  assert os.path.isfile(tmp_path / 'run_tokenizer' / 'chat_template.jinja') == in_file
  kept, kept_template = _ours(str(tmp_path / 'run_tokenizer'))
  assert chat.prompt_ids(kept_template, messages, kept).tolist() == expected
  assert tokenizer_json.write(str(tmp_path / 'hf'), kept) == []  # hf.export's tokenizer files
  assert _theirs(str(tmp_path / 'hf'), messages, add_generation_prompt=True) == expected
  # HF import of a checkpoint whose tokenizer directory has the template.
  config, _ = config_lib.resolve(config_lib.preset('test'), num_devices=1, backend='cpu')
  c = dataclasses.replace(config.model, vocab_size=512)
  params = meta.unbox(model_lib.Transformer(c).init(jax.random.key(0),
                                                    jnp.zeros((1, 8), jnp.int32))['params'])
  hf.save(str(tmp_path / 'checkpoint'), jax.tree.map(np.asarray, params), c,
          max_position_embeddings=32)
  for name in os.listdir(directory):
    shutil.copyfile(os.path.join(directory, name), tmp_path / 'checkpoint' / name)
  run = hf.import_run(str(tmp_path / 'checkpoint'), str(tmp_path / 'run'),
                      config_lib.preset('test'))
  imported = chat.tokenizer_template(run.tokenizer)
  assert imported is not None
  assert chat.prompt_ids(imported, messages, run.tokenizer).tolist() == expected


def test_a_chat_prompt_is_what_sft_trained_on_before_the_assistants_turn(tokenizer_files,
                                                                         tmp_path):
  tok, template = _ours(_directory(tokenizer_files, 'metaspace', 'mistral', tmp_path / 'tok'))
  conversation = CONVERSATIONS['multi']
  example = [*conversation, {'role': 'assistant', 'content': 'It is 7.'}]
  (ids, is_target), error = sft.example_tokens(json.dumps({'messages': example}), template, tok,
                                               'test')
  assert error is None
  starts = np.flatnonzero(np.diff(is_target.astype(int), prepend=0) == 1)  # of each turn
  assert len(starts) == 2
  assert chat.prompt_ids(template, conversation, tok).tolist() == ids[:starts[-1]].tolist()
  assert tok.decode(ids[starts[-1]:]).replace(' ', '') == 'Itis7.'  # (</s> decodes to nothing)
  assert ids[-1] == tok.eos_id and ids[-2] != tok.eos_id  # the template's </s>: no second EOS


def test_a_tokenizer_without_a_chat_template_has_none(tmp_path):
  tokenizer_lib.save(tokenizer_lib.ByteTokenizer(), str(tmp_path))
  assert chat.tokenizer_template(tokenizer_lib.load(str(tmp_path))) is None
  assert chat.tokenizer_template(tokenizer_lib.load('byte')) is None


def test_a_template_file_missing_or_not_a_template_is_one_error(tmp_path):
  with pytest.raises(DataError, match=r'nothing\.jinja: chat template file not found\.$'):
    chat.template_file(str(tmp_path / 'nothing.jinja'))
  (tmp_path / 'bad.jinja').write_text('{% for m in messages %}{{ m }')
  with pytest.raises(DataError, match=r'bad\.jinja: the chat template does not parse \('):
    chat.template_file(str(tmp_path / 'bad.jinja'))
