"""DPO (python -m jax_pretrain.dpo): each loss against a float64 NumPy reference of TRL 1.16's
formula; the loss, every logged metric and every gradient against TRL's DPOTrainer itself on an
exported model; the pairs as TRL tokenizes them; the program: resume, a mesh, bad input."""
import dataclasses
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import hf
from jax_pretrain import model as model_lib
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data import tokenizer_json
from jax_pretrain.data.errors import DataError
from jax_pretrain.dpo import config as dpo_config
from jax_pretrain.dpo import data as data_lib
from jax_pretrain.dpo import objective
from tests.conftest import ROOT
from tests.conftest import subprocess_env
from tests.test_hf import preset_config
from tests.test_hf import random_params

# A ChatML template, and the texts the test tokenizers are trained on.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXTS = ['user assistant system hello 2 + 3 = 5, and 4 + 3 = 7. Be brief.'] * 20


def _log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


def _reference(logps, ref, lengths, loss_type, beta, ls):
  """float64: TRL 1.16's per-pair loss (trl/trainer/dpo_trainer.py, _compute_loss)."""
  chosen, rejected = logps[:, 0] - ref[:, 0], logps[:, 1] - ref[:, 1]
  delta = chosen - rejected
  if loss_type == 'sigmoid':
    return -_log_sigmoid(beta * delta)
  if loss_type == 'hinge':
    return np.maximum(0.0, 1 - beta * delta)
  if loss_type == 'ipo':
    return (chosen / lengths[:, 0] - rejected / lengths[:, 1] - 1 / (2 * beta)) ** 2
  clean = -(1 - ls) * _log_sigmoid(beta * delta)
  flipped = -ls * _log_sigmoid(-beta * delta)
  return (clean - flipped) / (1 - 2 * ls)


@pytest.mark.parametrize('loss_type, beta, ls', [
    ('sigmoid', 0.1, 0.0), ('sigmoid', 2.0, 0.0), ('hinge', 0.5, 0.0), ('ipo', 0.1, 0.0),
    ('ipo', 0.7, 0.0), ('robust', 0.1, 0.0), ('robust', 0.3, 0.2)])
def test_each_loss_its_gradient_and_metrics_equal_the_float64_reference(loss_type, beta, ls):
  """Log-probabilities spread so that margins fall on both sides (hinge's kink and sigmoid's
  saturation included): each pair's loss, its gradient in the policy's log-probabilities (by
  central differences of the float64 formula) and the metrics, to 1e-5."""
  rng = np.random.default_rng(0)
  B = 16
  logps = rng.normal(-30, 10, (B, 2))
  ref = logps + rng.normal(0, 8, (B, 2))
  lengths = rng.integers(1, 40, (B, 2)).astype(np.float64)
  want = _reference(logps, ref, lengths, loss_type, beta, ls)
  f = lambda x: objective.pair_losses(x, jnp.asarray(ref, jnp.float32),
                                      jnp.asarray(lengths, jnp.float32), loss_type=loss_type,
                                      beta=beta, label_smoothing=ls)
  got = f(jnp.asarray(logps, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  grad = jax.grad(lambda x: jnp.sum(f(x)))(jnp.asarray(logps, jnp.float32))
  h = 1e-6
  for k in range(2):
    e = np.zeros_like(logps)
    e[:, k] = h
    numeric = (_reference(logps + e, ref, lengths, loss_type, beta, ls)
               - _reference(logps - e, ref, lengths, loss_type, beta, ls)) / (2 * h)
    np.testing.assert_allclose(np.asarray(grad)[:, k], numeric, rtol=1e-4, atol=1e-6)
  rewards = beta * (logps - ref)
  m = objective.pair_metrics(jnp.asarray(logps, jnp.float32), jnp.asarray(ref, jnp.float32),
                             beta)
  np.testing.assert_allclose(m['rewards/chosen'], rewards[:, 0], rtol=1e-5)
  np.testing.assert_allclose(m['rewards/rejected'], rewards[:, 1], rtol=1e-5)
  np.testing.assert_allclose(m['rewards/margins'], rewards[:, 0] - rewards[:, 1], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_array_equal(m['rewards/accuracies'], rewards[:, 0] > rewards[:, 1])
  assert 0 < float(np.mean(m['rewards/accuracies'])) < 1
  np.testing.assert_allclose(m['logps/chosen'], logps[:, 0], rtol=1e-6)
  np.testing.assert_allclose(m['logps/rejected'], logps[:, 1], rtol=1e-6)


# TRL's agreement: the text pairs of every shape a batch can hold (completions of different
# lengths, a completion that ends with the EOS, a pair whose completions share a beginning).
TEXT_PAIRS = [{'prompt': 'Q: 2+2? A:', 'chosen': ' 4', 'rejected': ' five, I think'},
              {'prompt': 'Sky colour:', 'chosen': ' blue', 'rejected': ' blunt'},
              {'prompt': 'x', 'chosen': 'yz yz yz', 'rejected': 'q'},
              {'prompt': 'Say hi. ', 'chosen': 'hi there', 'rejected': 'hi'}]


def _trl_trainer(hf_dir, ref_dir, out_dir, rows, **args):
  """TRL's DPOTrainer on the exported policy and reference models, on the CPU in float32."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  datasets = pytest.importorskip('datasets')
  trl = pytest.importorskip('trl')
  config = trl.DPOConfig(output_dir=str(out_dir), use_cpu=True, bf16=False, report_to='none',
                         per_device_train_batch_size=len(rows), logging_steps=1,
                         max_length=None, **args)
  load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
  return trl.DPOTrainer(model=load(hf_dir), ref_model=load(ref_dir), args=config,
                        train_dataset=datasets.Dataset.from_list(rows),
                        processing_class=transformers.AutoTokenizer.from_pretrained(str(hf_dir)))


@pytest.mark.parametrize('loss_type, ls, rpo_alpha', [
    ('sigmoid', 0.0, 0.0), ('hinge', 0.0, 0.0), ('ipo', 0.0, 0.0), ('robust', 0.2, 0.0),
    ('sigmoid', 0.0, 0.5)])
def test_the_loss_metrics_and_gradients_equal_trls(tmp_path, monkeypatch, loss_type, ls,
                                                   rpo_alpha):
  """TRL's DPOTrainer and ours on the same exported policy and reference (the policy moved a
  little from it, as after some steps: with equal params every log-ratio is 0) and the same
  text pairs: TRL's own code tokenizes them (ours: data.encode_pair, the same ids), collates
  them, and computes the loss (compute_loss), its metrics and, by backward, every parameter's
  gradient; ours (objective.make_loss_fn, the train step's loss, on data.rows' batch) agree to
  1e-5 relative. rpo_alpha: TRL's loss_type [loss_type, 'sft'] with loss_weights [1, alpha]."""
  pytest.importorskip('torch')
  monkeypatch.setenv('CI', '1')  # (no telemetry from a test)
  c = preset_config()
  ref_params = random_params(c, seed=3)
  rng = np.random.default_rng(7)
  params = jax.tree.map(lambda x: x + np.float32(0.05) * rng.standard_normal(
      x.shape, np.float32), ref_params)
  tok = tokenizer_lib.ByteTokenizer()
  hf.save(str(tmp_path / 'hf'), params, c, max_position_embeddings=64, tokenizer=tok)
  hf.save(str(tmp_path / 'ref'), ref_params, c, max_position_embeddings=64, tokenizer=tok)
  beta = 0.1 if loss_type != 'ipo' else 0.5
  args = dict(loss_type=[loss_type] + (['sft'] if rpo_alpha else []), beta=beta,
              label_smoothing=ls)
  if rpo_alpha:
    args['loss_weights'] = [1.0, rpo_alpha]
  trainer = _trl_trainer(tmp_path / 'hf', tmp_path / 'ref', tmp_path / 'out', TEXT_PAIRS, **args)
  examples = [trainer.train_dataset[i] for i in range(len(TEXT_PAIRS))]
  pairs = [data_lib.encode_pair(r['prompt'], r['chosen'], r['rejected'], tok, None)
           for r in TEXT_PAIRS]
  for pair, theirs in zip(pairs, examples):  # the same ids, the same split
    assert isinstance(pair, data_lib.Pair)
    assert pair.prompt.tolist() == theirs['prompt_ids']
    assert pair.chosen.tolist() == theirs['chosen_ids']
    assert pair.rejected.tolist() == theirs['rejected_ids']
  trainer.model.train()
  inputs = trainer.data_collator(examples)
  loss = trainer.compute_loss(trainer.model, inputs)
  loss.backward()
  theirs = {name: p.grad.numpy() for name, p in trainer.model.named_parameters()}
  metrics = {k: v[0] for k, v in trainer._metrics['train'].items()}  # noqa: SLF001

  model = model_lib.Transformer(c)
  batch = data_lib.rows(pairs, data_lib.width(pairs, 64), tok.pad_id, rpo=rpo_alpha > 0)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  with jax.default_matmul_precision('float32'):
    batch['ref_logps'] = objective.sequence_logps(model, ref_params, batch)[0]
    loss_fn = objective.make_loss_fn(model, loss_type=loss_type, beta=beta, label_smoothing=ls,
                                     rpo_alpha=rpo_alpha)
    (loss_sum, (count, sums)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
  assert float(count) == len(TEXT_PAIRS)
  np.testing.assert_allclose(float(loss_sum / count), loss.item(), rtol=1e-5)
  for name in objective.METRICS:
    np.testing.assert_allclose(float(sums[name] / count), metrics[name], rtol=1e-5, atol=1e-7,
                               err_msg=name)
  assert 0 < metrics['rewards/accuracies'] < 1 or loss_type != 'sigmoid'
  ours = hf.to_hf(jax.tree.map(lambda x: np.asarray(x) / float(count), grads), c)
  assert ours.keys() == theirs.keys()
  for name, grad in theirs.items():
    np.testing.assert_allclose(ours[name], grad, rtol=1e-5, atol=1e-5 * np.abs(grad).max(),
                               err_msg=name)


CHAT_PAIRS = [  # TRL's forms: explicit prompt (text, messages), implicit prompt (text, messages)
    {'prompt': 'Is 2 + 3 = 5? ', 'chosen': 'Yes, it is.', 'rejected': 'No.'},
    {'prompt': [{'role': 'user', 'content': '2 + 3 ='}],
     'chosen': [{'role': 'assistant', 'content': '5'}],
     'rejected': [{'role': 'assistant', 'content': '7, and 4 + 3 = 5'}]},
    {'chosen': 'hello and 4 + 3 = 7', 'rejected': 'hello and 4 + 3 = 5'},
    {'chosen': [{'role': 'system', 'content': 'Be brief.'},
                {'role': 'user', 'content': 'and 4 + 3 ='},
                {'role': 'assistant', 'content': '7'}],
     'rejected': [{'role': 'system', 'content': 'Be brief.'},
                  {'role': 'user', 'content': 'and 4 + 3 ='},
                  {'role': 'assistant', 'content': 'assistant 5'}]}]


def test_every_form_of_pair_tokenizes_as_trls(tmp_path):
  """Text and conversational pairs (rendered with the run's chat template), with the prompt given
  or implicit (the shared beginning): a byte-level BPE whose merges cross the prompt's end, as
  TRL's own _prepare_dataset (extract_prompt, tokenize_fn) splits them, token for token."""
  transformers = pytest.importorskip('transformers')
  datasets = pytest.importorskip('datasets')
  trl = pytest.importorskip('trl')
  tok = tokenizer_lib.train_bytelevel_bpe(TEXTS, str(tmp_path / 'tok' / 'tokenizer.json'), 300)
  path = tmp_path / 'tok' / tokenizer_lib.HF_CONFIG_FILE
  path.write_text(json.dumps({**json.loads(path.read_text()), 'chat_template': CHATML}))
  tok = tokenizer_lib.load(str(tmp_path / 'tok' / 'tokenizer.json'))
  assert tokenizer_json.write(str(tmp_path / 'hf'), tok) == []
  theirs_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'hf'))
  (tmp_path / 'pairs.jsonl').write_text(''.join(json.dumps(p) + '\n' for p in CHAT_PAIRS))
  ours = data_lib.open_pairs(str(tmp_path / 'pairs.jsonl'), '', 0.0, tok, (0, 0), 512)
  assert len(ours.train) == len(CHAT_PAIRS) and ours.dropped == 0
  args = trl.DPOConfig(output_dir=str(tmp_path / 'out'), report_to='none', max_length=None,
                       use_cpu=True, bf16=False)
  prepare = trl.DPOTrainer._prepare_dataset  # noqa: SLF001  (TRL's preparation, alone)
  for pair, row in zip(ours.train, CHAT_PAIRS):  # (one form a dataset, as TRL reads them)
    theirs = prepare(types.SimpleNamespace(_tokenizer=theirs_tok), datasets.Dataset.from_list(
        [row]), theirs_tok, args, 'train')[0]
    assert pair.prompt.tolist() == theirs['prompt_ids'], row
    assert pair.chosen.tolist() == theirs['chosen_ids'], row
    assert pair.rejected.tolist() == theirs['rejected_ids'], row
  assert tok.decode(ours.train[3].chosen.tolist()) == '7<|im_end|>\n'


def test_truncation_keeps_the_prompts_end_the_completions_start_and_drops_as_trl():
  """dpo.max_prompt_tokens keeps a prompt's last tokens, dpo.max_completion_tokens each
  completion's first, then each sequence keeps its first max_length (TRL's keep_start), and a
  pair whose prompt alone fills max_length is dropped (TRL's filter)."""
  pair = data_lib.Pair(np.arange(10, 20, dtype=np.int32), np.arange(30, 38, dtype=np.int32),
                       np.arange(40, 43, dtype=np.int32))
  cut = data_lib.truncate(pair, 4, 5, 100)
  assert (cut.prompt.tolist(), cut.chosen.tolist(), cut.rejected.tolist()) == (
      [16, 17, 18, 19], [30, 31, 32, 33, 34], [40, 41, 42])
  cut = data_lib.truncate(pair, 0, 0, 12)
  assert (len(cut.prompt), cut.chosen.tolist(), cut.rejected.tolist()) == (10, [30, 31], [40, 41])
  assert data_lib.truncate(pair, 0, 0, 10) is None and data_lib.truncate(pair, 6, 0, 10)


@pytest.mark.parametrize('line, message', [
    ('{"prompt": "a", "chosen": "b"}', 'no "chosen" and "rejected" fields'),
    ('{"prompt": "a", "chosen": "b", "rejected": 3}', 'must all be strings or all lists'),
    ('{"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}',
     'must all be strings or all lists'),
    ('{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", '
     '"content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]}',
     'need a chat template'),
    ('{"prompt": "", "chosen": "b", "rejected": "c"}', 'the prompt has no tokens'),
    ('{"chosen": "same", "rejected": "same"}', 'are the same'),
    ('{"chosen": "", "rejected": "hi!"}', 'is empty'),
    ('not json', 'pairs.jsonl:3')])
def test_a_bad_pair_is_one_error_naming_its_file_and_line(tmp_path, line, message):
  good = json.dumps({'prompt': 'a', 'chosen': 'b', 'rejected': 'c'})
  (tmp_path / 'pairs.jsonl').write_text(f'{good}\n{good}\n{line}\n{good}\n')
  with pytest.raises(DataError, match=message) as e:
    data_lib.open_pairs(str(tmp_path / 'pairs.jsonl'), '', 0.0, tokenizer_lib.ByteTokenizer(),
                        (0, 0), 64)
  assert f'{tmp_path}/pairs.jsonl:3: ' in str(e.value)


def test_pairs_from_parquet_and_a_hugging_face_dataset_equal_the_jsonl_ones(tmp_path):
  """The same pairs (text, messages with the prompt given and implicit) as JSONL, as a Parquet
  file and as a saved Hugging Face dataset (hf:DIR) tokenize to the same ids; a bad row is named
  by its row."""
  import pyarrow  # noqa: PLC0415
  import pyarrow.parquet as pq  # noqa: PLC0415
  datasets = pytest.importorskip('datasets')
  tok = tokenizer_lib.train_bytelevel_bpe(TEXTS, str(tmp_path / 'tok' / 'tokenizer.json'), 300)
  path = tmp_path / 'tok' / tokenizer_lib.HF_CONFIG_FILE
  path.write_text(json.dumps({**json.loads(path.read_text()), 'chat_template': CHATML}))
  tok = tokenizer_lib.load(str(tmp_path / 'tok' / 'tokenizer.json'))
  rows = [p for p in CHAT_PAIRS if isinstance(p['chosen'], list)]  # one form a file (a column type)
  (tmp_path / 'pairs.jsonl').write_text(''.join(json.dumps(p) + '\n' for p in rows))
  pq.write_table(pyarrow.Table.from_pylist(rows), tmp_path / 'pairs.parquet')
  datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / 'saved'))
  read = lambda source: data_lib.open_pairs(source, '', 0.0, tok, (0, 0), 512).train
  want = read(str(tmp_path / 'pairs.jsonl'))
  assert len(want) == len(rows)
  for source in (str(tmp_path / 'pairs.parquet'), f'hf:{tmp_path / "saved"}'):
    got = read(source)
    assert [[x.tolist() for x in dataclasses.astuple(p)] for p in got] == [
        [x.tolist() for x in dataclasses.astuple(p)] for p in want], source
  pq.write_table(pyarrow.Table.from_pylist([TEXT_PAIRS[0], {**TEXT_PAIRS[0], 'rejected': ' 4'}]),
                 tmp_path / 'bad.parquet')
  with pytest.raises(DataError, match=r'bad\.parquet:row 2: "chosen" and "rejected" are the same'):
    read(str(tmp_path / 'bad.parquet'))


# The program.

@pytest.fixture(scope='module')
def prefs(tmp_path_factory):
  """(the tiny pretrained run, a preference file: 'e' answers chosen over 'xyz' ones)."""
  from tests import tiny_run  # noqa: PLC0415
  base = tiny_run.train_once(tmp_path_factory)
  path = tmp_path_factory.mktemp('prefs') / 'pairs.jsonl'
  with open(path, 'w', encoding='utf-8') as f:
    for i in range(40):
      f.write(json.dumps({'prompt': f'Item {i}: ', 'chosen': 'e' * (1 + i % 2),
                          'rejected': 'xyz' * (1 + i % 3)}) + '\n')
  return base, str(path)


def _config(prefs, steps: int, **fields):
  base, path = prefs
  c = config_lib.load_file(f'{ROOT}/configs/dpo.py')
  config_lib.fine_tune(c, base, 'configs/dpo.py')
  c.data.train, c.data.val_ratio = path, 0.2
  c.train.batch_size, c.train.steps, c.train.log_every, c.train.eval_every = 8, steps, 1, 4
  c.optim.learning_rate = c.optim.min_learning_rate = 1e-3
  c.checkpoint.every_steps = 4
  for name, value in fields.items():
    group, field = name.split('__')
    c[group][field] = value
  return c


def _records(workdir) -> dict[int, dict]:
  """step -> every scalar logged for it (train and eval), from metrics.jsonl."""
  steps: dict[int, dict] = {}
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    for record in map(json.loads, f):
      steps.setdefault(record.pop('step'), {}).update(record)
  return steps


def _params(workdir):
  from jax_pretrain import workdir as workdir_lib  # noqa: PLC0415
  return workdir_lib.load(str(workdir), devices=jax.devices()[:1]).params


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit_and_learns(prefs, tmp_path):
  """8 steps straight, and 4 then 4 more in the same workdir (the reference restored from the
  init run again): every logged scalar and the final params equal, bit for bit; the held-out
  pairs' reward accuracy and margin rise."""
  from jax_pretrain import train as train_lib  # noqa: PLC0415
  from jax_pretrain.dpo import program  # noqa: PLC0415
  one = jax.devices()[:1]
  train_lib.train(_config(prefs, 8), str(tmp_path / 'whole'), program.DPO(), one)
  train_lib.train(_config(prefs, 4), str(tmp_path / 'split'), program.DPO(), one)
  train_lib.train(_config(prefs, 8), str(tmp_path / 'split'), program.DPO(), one)
  whole, split = _records(tmp_path / 'whole'), _records(tmp_path / 'split')
  assert sorted(whole) == list(range(9))  # (step 0: the eval before training)
  assert whole[0]['eval/rewards/margins'] == 0 and whole[0]['eval/loss'] == pytest.approx(
      np.log(2), abs=1e-6)  # (the policy is the reference)
  for step in range(9):
    got = {k: v for k, v in split[step].items() if not k.startswith('perf/')}
    want = {k: v for k, v in whole[step].items() if not k.startswith('perf/')}
    assert got == want, step
  assert whole[1]['train/loss'] == pytest.approx(np.log(2), abs=1e-6)  # the policy is the ref
  assert whole[8]['eval/rewards/accuracies'] == 1.0 and whole[8]['eval/rewards/margins'] > 0.5
  assert set(whole[8]) >= {f'{split}/{k}' for split in ('train', 'eval')
                           for k in objective.METRICS}
  jax.tree.map(np.testing.assert_array_equal, _params(tmp_path / 'split'),
               _params(tmp_path / 'whole'))


def test_dpo_on_a_mesh_and_with_precomputed_references_agrees_with_one_device(prefs, tmp_path):
  """One device holding the reference, and a data=2 × fsdp=2 mesh (2 micro-batches a device, the
  reference held in the policy's shardings) with dpo.precompute_ref_logps (scored once before
  training, nothing held) and rpo_alpha: the same losses, metrics and grad norms to 1e-5."""
  from jax_pretrain import train as train_lib  # noqa: PLC0415
  from jax_pretrain.dpo import program  # noqa: PLC0415
  records = {}
  for name, devices, mesh, precompute in (('one', 1, (1, 1), False), ('held', 4, (2, 2), False),
                                          ('mesh', 4, (2, 2), True)):
    c = _config(prefs, 4, dpo__rpo_alpha=0.5, dpo__precompute_ref_logps=precompute)
    c.mesh.data, c.mesh.fsdp = mesh
    c.train.micro_batch_size = 8 // (2 * mesh[0] * mesh[1])
    train_lib.train(c, str(tmp_path / name), program.DPO(), jax.devices()[:devices])
    records[name] = _records(tmp_path / name)
  for name in ('held', 'mesh'):
    for step in range(1, 5):
      for key, want in records['one'][step].items():
        # (step 1: the policy is the reference, each margin 0 up to rounding, the share of
        # positive ones a coin's)
        if not key.startswith('perf/') and (step, key) != (1, 'train/rewards/accuracies'):
          np.testing.assert_allclose(records[name][step][key], want, rtol=1e-5, atol=1e-6,
                                     err_msg=f'{name} {key} {step}')


def test_bad_input_is_one_error_line(prefs, tmp_path):
  """A bad pair stops the command before any work: one error line naming its file and line."""
  base, _ = prefs
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a"}\n')
  out = subprocess.run([sys.executable, '-m', 'jax_pretrain.dpo', f'--workdir={tmp_path}/w',
                        f'--init={base}', f'--config.data.train={bad}'], cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 1
  assert out.stderr.strip().splitlines() == [
      f'error: {bad}:2: no "chosen" and "rejected" fields: ' + data_lib._FORMS + '.']  # noqa: SLF001
  assert not os.path.exists(tmp_path / 'w' / 'checkpoints')


@pytest.mark.parametrize('values, message', [
    ({'loss_type': 'kto'}, "dpo.loss_type='kto': choose one of"),
    ({'beta': 0.0}, 'dpo.beta=0.0 must be positive'),
    ({'label_smoothing': 0.1}, "acts only with dpo.loss_type='robust'"),
    ({'loss_type': 'robust', 'label_smoothing': 0.5}, r'must lie in \[0, 0.5\)'),
    ({'rpo_alpha': -1.0}, 'dpo.rpo_alpha=-1.0 must be >= 0'),
    ({'max_prompt_tokens': -1}, 'dpo.max_prompt_tokens=-1 must be >= 0')])
def test_a_bad_dpo_value_is_one_config_error_naming_its_field(values, message):
  c = config_lib.preset('dpo')
  for name, value in values.items():
    c.dpo[name] = value
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.resolve(c, 1, backend='cpu')
  c = config_lib.preset('dpo')
  resolved, _ = config_lib.resolve(c, 1, backend='cpu')
  assert dpo_config.of(resolved).dpo == dpo_config.DpoConfig()  # (TRL's: sigmoid, beta 0.1)


def test_dpo_fields_declare_their_resume_policy():
  """A change of the objective on resume is accepted and recorded; one of the truncation (which
  changes the pairs' tokens a step) is refused, as data.train is."""
  saved = config_lib.as_dict(config_lib.typed(dpo_config.defaults()))
  for f in dpo_config.FIELDS:
    c = dpo_config.defaults()
    after = (not f.default if isinstance(f.default, bool)
             else 'ipo' if isinstance(f.default, str) else f.default + 1)
    c.dpo[f.name] = after
    if f.name.startswith('max_'):
      with pytest.raises(config_lib.ConfigError, match=f'dpo.{f.name} '):
        config_lib.resume_changes(saved, config_lib.typed(c))
    else:
      assert config_lib.resume_changes(saved, config_lib.typed(c)) == {
          f'dpo.{f.name}': (f.default, after)}


def test_plan_shows_a_dpo_step_with_the_reference_beside_it():
  """python -m jax_pretrain.plan --dpo (compiled here for the CPU): the update on pairs of
  data.seq_len + 1 tokens, the held reference's params (the policy's, float32) among what stays
  on the device beside it; with dpo.precompute_ref_logps none."""
  from jax_pretrain import memory  # noqa: PLC0415
  from jax_pretrain.dpo import plan as dpo_plan  # noqa: PLC0415
  c = config_lib.load_file(f'{ROOT}/configs/dpo.py')
  config_lib.fine_tune(c, 'test', 'configs/dpo.py:test')  # (a preset's model, no params)
  c.train.batch_size = 8
  r = dpo_plan.plan(c, 'cpu', 1)
  params = r['update']['params']
  assert r['dpo']['sequence_tokens'] == c.data.seq_len + 1 and r['dpo']['reference'] == 'held'
  assert r['update']['alongside_gib'] == {'reference params': params * 4 / memory.GIB}
  assert r['update']['tokens_per_step'] == 8 * 2 * (c.data.seq_len + 1)
  assert 'reference held' in dpo_plan.format_report(r)
  c.dpo.precompute_ref_logps = True
  r = dpo_plan.plan(c, 'cpu', 1)
  assert r['update']['alongside_gib'] == {} and r['dpo']['reference_gib'] == 0
