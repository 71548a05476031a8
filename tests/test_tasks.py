"""Task files and rewards: what each reward accepts, user reward functions, tasks from Hugging
Face datasets (hf:, made here) with field mappings, and one error line (naming the file and line,
the dataset and row, or the function) for every mistake."""
import dataclasses
import json

import pytest

from jax_pretrain import tasks
from jax_pretrain.data import tokenizer as tokenizer_lib


def write(path, lines):
  path.write_text(''.join((line if isinstance(line, str) else json.dumps(line)) + '\n'
                          for line in lines))
  return str(path)


def test_the_built_in_rewards():
  item = tasks.Item('2 + 2 = ', '4')
  assert tasks.exact('4\nmore text', item) == 1 and tasks.exact(' 4 ', item) == 1
  assert tasks.exact('44', item) == 0 and tasks.exact('', item) == 0
  assert tasks.number('it is 4.0 apples', item) == 1 and tasks.number('5 or 4', item) == 0
  assert tasks.number('1,234', tasks.Item('q', '#### 1234')) == 1
  mc = tasks.Item('q', 'B', ('aspirin', 'heparin', 'warfarin', 'insulin'))
  assert tasks.choice('B. heparin', mc) == 1 and tasks.choice('(B)', mc) == 1
  assert tasks.choice('The answer is heparin', mc) == 1  # the text of choice B
  assert tasks.choice('A', mc) == 0 and tasks.choice('no letter here', mc) == 0
  by_text = tasks.Item('q', 'heparin', mc.choices)
  assert tasks.choice('B', by_text) == 1


def test_a_users_reward_function_by_file_or_module(tmp_path, monkeypatch):
  (tmp_path / 'my_reward.py').write_text(
      'def length(completion, item):\n  return len(completion) / 10\n'
      'def broken(completion, item):\n  raise ValueError("no")\n')
  fn = tasks.reward_fn(f'{tmp_path}/my_reward.py:length')
  assert tasks.score(fn, 'abcde', tasks.Item('p', 'a')) == 0.5
  monkeypatch.syspath_prepend(str(tmp_path))
  assert tasks.reward_fn('my_reward:length') is not None
  broken = tasks.reward_fn('my_reward:broken')
  with pytest.raises(tasks.TaskError, match=r'reward broken failed on t\.jsonl:3 \(ValueError: no'):
    tasks.score(broken, 'x', tasks.Item('p', 'a', where='t.jsonl:3'))


@pytest.mark.parametrize('spec, message', [
    ('exactly', r"reward 'exactly': no such reward; choose one of \['choice', 'exact', 'number'\]"),
    ('no_such_module_xyz:f', r'cannot import no_such_module_xyz \(ModuleNotFoundError'),
    ('missing.py:f', r'cannot import missing\.py \(FileNotFoundError'),
    ('json:no_function', r"json has no function 'no_function'"),
])
def test_a_reward_that_cannot_be_used_is_one_error(spec, message):
  with pytest.raises(tasks.TaskError, match=message):
    tasks.reward_fn(spec)


@pytest.mark.parametrize('line, message', [
    ('{"prompt": "q"', r't\.jsonl:2: not valid JSON'),
    ({'prompt': 'q'}, r"t\.jsonl:2: no 'answer' field"),
    ({'answer': '1'}, r"t\.jsonl:2: no 'prompt' field"),
    ({'prompt': '', 'answer': '1'}, r't\.jsonl:2: "prompt" must be a non-empty string'),
    ([1, 2], r't\.jsonl:2: a task line is a JSON object'),
])
def test_a_bad_task_line_is_one_error_naming_file_and_line(tmp_path, line, message):
  path = write(tmp_path / 't.jsonl', [{'prompt': 'ok', 'answer': 1}, line])
  with pytest.raises(tasks.TaskError, match=message):
    tasks.load(path)


def test_medqa_and_gsm8k_layouts(tmp_path):
  medqa = write(tmp_path / 'medqa.jsonl', [{
      'question': 'Which drug?', 'options': {'A': 'aspirin', 'B': 'heparin', 'C': 'warfarin',
                                             'D': 'insulin'}, 'answer': 'heparin',
      'answer_idx': 'B'}])
  [item] = tasks.load(medqa, 'medqa')
  assert item.prompt == ('Question: Which drug?\nA. aspirin\nB. heparin\nC. warfarin\n'
                         'D. insulin\nAnswer:')
  assert item.answer == 'B' and tasks.choice(' B', item) == 1
  gsm = write(tmp_path / 'gsm.jsonl', [{'question': 'How many?', 'answer': 'so 3 + 4\n#### 7'}])
  [item] = tasks.load(gsm, 'gsm8k')
  assert item.answer == '7' and tasks.number(' 7 apples', item) == 1


MEDQA = [{'question': 'Which drug?', 'options': {'A': 'aspirin', 'B': 'heparin', 'C': 'warfarin',
                                                  'D': 'insulin'},
          'answer': 'heparin', 'answer_idx': 'B'},
         {'question': 'Which organ?', 'options': {'A': 'liver', 'B': 'lung', 'C': 'heart',
                                                   'D': 'skin'},
          'answer': 'heart', 'answer_idx': 'C'}]
GSM8K = [{'question': 'How many?', 'answer': 'so 3 + 4\n#### 7'},
         {'question': 'How much?', 'answer': '2 * 617 = 1234\n#### 1,234'}]
PLAIN = [{'q': 'Capital of France?', 'label': 'Paris', 'options': ['Rome', 'Paris']},
         {'q': '2 + 2 = ', 'label': '4', 'options': ['3', '4']}]


@pytest.fixture(scope='module')
def hf_tasks(tmp_path_factory):
  """The same rows as JSONL files and as datasets, the ways data sources read them (see
  test_data_hf.py): MedQA as a saved DatasetDict, GSM8K as a local directory with a 'main'
  configuration (its README's), plain rows under other column names as a directory of JSONL files,
  and two saved Datasets with a bad second row."""
  datasets = pytest.importorskip('datasets')
  d = tmp_path_factory.mktemp('hf_tasks')
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(datasets.config, 'HF_DATASETS_CACHE', str(d / 'cache'))  # not ~/.cache
    for name, rows in (('medqa', MEDQA), ('gsm8k', GSM8K), ('plain', PLAIN)):
      write(d / f'{name}.jsonl', rows)
    datasets.DatasetDict({'train': datasets.Dataset.from_list(MEDQA[:1]),
                          'test': datasets.Dataset.from_list(MEDQA)}).save_to_disk(str(d / 'medqa'))
    (d / 'gsm8k' / 'main').mkdir(parents=True)
    write(d / 'gsm8k' / 'main' / 'test.jsonl', GSM8K)
    (d / 'gsm8k' / 'README.md').write_text(
        '---\nconfigs:\n- config_name: main\n  data_files:\n  - split: test\n'
        '    path: main/test.jsonl\n---\n')
    (d / 'plain').mkdir()
    write(d / 'plain' / 'train.jsonl', PLAIN)
    datasets.Dataset.from_list([{'prompt': 'ok', 'answer': '1'}, {'prompt': '', 'answer': '2'}]
                               ).save_to_disk(str(d / 'bad_plain'))
    datasets.Dataset.from_list([GSM8K[0], {'question': 'And?', 'answer': None}]
                               ).save_to_disk(str(d / 'bad_gsm8k'))
    yield d


@pytest.mark.parametrize('source, jsonl, format_name, fields', [
    ('medqa@test', 'medqa.jsonl', 'medqa', ''),
    ('gsm8k:main@test', 'gsm8k.jsonl', 'gsm8k', ''),
    ('plain@train', 'plain.jsonl', 'plain', 'prompt=q, answer=label,choices=options'),
])
def test_a_dataset_gives_the_items_of_the_same_rows_as_jsonl(hf_tasks, source, jsonl, format_name,
                                                             fields):
  items = tasks.load(f'hf:{hf_tasks}/{source}', format_name, fields)
  same = tasks.load(str(hf_tasks / jsonl), format_name, fields)
  assert [dataclasses.replace(item, where='') for item in items] == [
      dataclasses.replace(item, where='') for item in same]
  assert [item.where for item in items] == [f'hf:{hf_tasks}/{source}:{n}' for n in (1, 2)]


def test_the_items_of_each_layout_from_a_dataset(hf_tasks):
  [_, organ] = tasks.load(f'hf:{hf_tasks}/medqa@test', 'medqa')
  assert organ == tasks.Item('Question: Which organ?\nA. liver\nB. lung\nC. heart\nD. skin\n'
                             'Answer:', 'C', ('liver', 'lung', 'heart', 'skin'),
                             f'hf:{hf_tasks}/medqa@test:2')
  assert tasks.choice(' C. heart', organ) == 1 and tasks.choice(' B', organ) == 0
  [_, much] = tasks.load(f'hf:{hf_tasks}/gsm8k:main@test', 'gsm8k')
  assert much.prompt == 'Question: How much?\nAnswer:' and much.answer == '1,234'
  assert tasks.number(' 1234 dollars', much) == 1
  [paris, _] = tasks.load(f'hf:{hf_tasks}/plain@train',
                          fields='prompt=q,answer=label,choices=options')
  assert paris == tasks.Item('Capital of France?', 'Paris', ('Rome', 'Paris'),
                             f'hf:{hf_tasks}/plain@train:1')
  assert tasks.choice('B', paris) == 1


@pytest.mark.parametrize('source, format_name, fields, message', [
    ('plain@train', 'plain', 'prompt=q,answer=lbl',
     "hf:{d}/plain@train: no column 'lbl' (columns: q, label, options), named by the task field "
     'answer=lbl.'),
    ('plain@train', 'plain', 'answer=label',
     "hf:{d}/plain@train: no column 'prompt' (columns: q, label, options), which format 'plain' "
     'reads; name the column to read instead in the task fields: prompt=COLUMN.'),
    ('plain@train', 'plain', 'prompt=q,solution=label',
     "task fields 'prompt=q,solution=label': format 'plain' reads no field 'solution' (its fields: "
     'prompt, answer, choices).'),
    ('gsm8k:main@test', 'gsm8k', 'question', "task fields 'question': 'question' is not "
     'FIELD=COLUMN.'),
    ('plain@train', 'plain', 'prompt=q,prompt=label',
     "task fields 'prompt=q,prompt=label': 'prompt' is mapped twice."),
    ('medqa@validation', 'medqa', '',
     "hf:{d}/medqa@validation: no split 'validation' (splits: train, test)."),
    ('medqa:main@test', 'medqa', '',
     'hf:{d}/medqa:main@test: a saved dataset has no configurations; drop :main.'),
    ('gsm8k:socratic@test', 'gsm8k', '',
     "hf:{d}/gsm8k:socratic@test: cannot open it (ValueError: BuilderConfig 'socratic' not found"),
])
def test_a_task_dataset_or_mapping_that_cannot_work_is_one_error(hf_tasks, source, format_name,
                                                                fields, message):
  with pytest.raises(tasks.TaskError) as e:
    tasks.load(f'hf:{hf_tasks}/{source}', format_name, fields)
  assert str(e.value).startswith(message.format(d=hf_tasks))  # the last: datasets' words follow


def test_a_bad_record_names_its_row_or_line(hf_tasks, tmp_path):
  with pytest.raises(tasks.TaskError) as e:
    tasks.load(f'hf:{hf_tasks}/bad_plain')
  assert str(e.value) == f'hf:{hf_tasks}/bad_plain:2: "prompt" must be a non-empty string.'
  with pytest.raises(tasks.TaskError) as e:
    tasks.load(f'hf:{hf_tasks}/bad_gsm8k', 'gsm8k')
  assert str(e.value) == (f"hf:{hf_tasks}/bad_gsm8k:2: not a 'gsm8k' record (AttributeError: "
                          "'NoneType' object has no attribute 'split').")
  path = write(tmp_path / 't.jsonl', [{'q': 'a', 'label': 'b'}, {'q': 'c', 'answer': 'd'}])
  with pytest.raises(tasks.TaskError) as e:
    tasks.load(path, fields='prompt=q,answer=label')
  assert str(e.value) == f"{path}:2: no 'label' field (task fields 'prompt=q,answer=label')."


def test_a_prompt_longer_than_the_context_is_one_error(tmp_path):
  path = write(tmp_path / 't.jsonl', [{'prompt': 'x' * 10, 'answer': 1},
                                      {'prompt': 'x' * 60, 'answer': 1}])
  items = tasks.load(path)
  tok = tokenizer_lib.ByteTokenizer()
  tasks.check_lengths(items[:1], tok.encode, context=64, new_tokens=8)
  with pytest.raises(tasks.TaskError, match=r't\.jsonl:2: the prompt is \d+ tokens; with 8 new'):
    tasks.check_lengths(items, tok.encode, context=64, new_tokens=8)


def test_evaluate_task_prints_the_greedy_accuracy_under_the_reward(tmp_path, tmp_path_factory):
  import jax  # noqa: PLC0415

  from jax_pretrain import sample as sample_lib  # noqa: PLC0415
  from jax_pretrain import workdir as workdir_lib  # noqa: PLC0415
  from tests import tiny_run  # noqa: PLC0415
  from tests.conftest import run_cli  # noqa: PLC0415
  workdir = tiny_run.train_once(tmp_path_factory)
  run = workdir_lib.load(workdir, devices=jax.devices()[:1])
  prompts = ['The ', 'In the ', 'A ', 'For ', 'This ', 'If ']
  # The model's own greedy continuations, by the other decoder (sample.py): half the items take
  # them as answers (right), half a string the model does not write (wrong).
  greedy = sample_lib.generate_texts(run.config.model, run.params,
                                     run.tokenizer, prompts, 8, temperature=0)
  rows = [{'prompt': p, 'answer': g[:4] if k % 2 == 0 else 'never'}
          for k, (p, g) in enumerate(zip(prompts, greedy))]
  path = write(tmp_path / 'task.jsonl', rows)
  (tmp_path / 'starts.py').write_text(
      'def starts(completion, item):\n  return float(completion.startswith(item.answer))\n')
  out = run_cli('-m', 'jax_pretrain.evaluate', f'--workdir={workdir}', f'--task={path}',
                f'--reward={tmp_path}/starts.py:starts', '--max_new_tokens=8',
                f'--json={tmp_path}/r.json')
  assert f'{path}: accuracy 0.5000 (3 of 6 right under reward' in out, out
  assert 'mean reward 0.5000' in out, out
  result = json.loads((tmp_path / 'r.json').read_text())
  assert [item['completion'] for item in result['items']] == greedy  # the same greedy tokens
  assert [item['reward'] for item in result['items']] == [1.0, 0.0] * 3
