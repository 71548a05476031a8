"""Supervised fine-tuning: the completion-only loss, packing with segment-masked attention, the
data format and its bad input, and an SFT run through the trainer that resumes bitwise."""
import json
import os
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import model as model_lib
from jax_pretrain import sharding
from jax_pretrain import state as state_lib
from jax_pretrain.data import chat
from jax_pretrain.data import sft
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data.errors import DataError
from tests.conftest import ROOT
from tests.conftest import build_data
from tests.conftest import build_setup
from tests.conftest import logged_losses
from tests.conftest import run_cli
from tests.conftest import subprocess_env

V, PAD = 384, 383


def random_examples(lengths, prompt_lengths, seed=0) -> sft.Examples:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 256, sum(lengths)).astype(np.int32)
  is_target = np.concatenate([np.arange(n) >= p for n, p in zip(lengths, prompt_lengths)])
  return sft.Examples('test', 1.0, tokens, is_target, np.cumsum(lengths))


def stack(rows) -> dict:
  return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


class _LogitsAsParams:
  """A stand-in model whose logits are its params: the loss as a function of the logits. As the
  loss asks it (logits=False), its final hidden states are the logits and its output projection
  the identity, which gives the same logits exactly. (Its params run as given: layers 'scan'.)"""
  mesh = None
  config = config_lib.ModelConfig(layers='scan')

  def apply(self, variables, inputs_BxT, segments_BxT=None, logits=True):
    del inputs_BxT, segments_BxT
    logits_BxTxV = variables['params']
    if logits:
      return logits_BxTxV
    return logits_BxTxV, jnp.eye(logits_BxTxV.shape[-1], dtype=logits_BxTxV.dtype)


def test_loss_counts_completion_tokens_only_and_prompt_positions_get_no_gradient():
  examples = random_examples([9, 14, 6], [4, 10, 1])
  rows = sft.PackedRows(examples, seq_len=31, pad_id=PAD)
  batch = stack([rows[i] for i in range(len(rows))])
  tokens = np.asarray(batch['tokens'])
  logits = jax.random.normal(jax.random.key(0), tokens[:, :-1].shape + (V,), jnp.float32)
  loss_fn = state_lib.make_loss_fn(_LogitsAsParams(), PAD)
  (total, count), grad = jax.value_and_grad(loss_fn, has_aux=True)(logits, batch)

  # float64 NumPy: the NLL of each target that is a completion token of the same example.
  l64 = np.asarray(logits, np.float64)
  m = l64.max(-1, keepdims=True)
  logz = (m + np.log(np.exp(l64 - m).sum(-1, keepdims=True)))[..., 0]
  nll = logz - np.take_along_axis(l64, tokens[:, 1:, None], -1)[..., 0]
  completion = np.zeros(tokens[:, 1:].shape, bool)
  start = 0
  for end, is_target in zip(examples.ends, np.split(examples.is_target, examples.ends[:-1])):
    completion[0, start:end - 1] = is_target[1:]  # target t+1 of input t, within the example
    start = end
  assert completion.sum() == (9 - 4) + (14 - 10) + (6 - 1)  # the completion tokens and EOS
  np.testing.assert_allclose(float(total), nll[completion].sum(), rtol=1e-6)
  assert float(count) == completion.sum()
  # No gradient reaches a position whose target is a prompt token, padding, or the next example.
  grad = np.asarray(grad)
  assert np.all(grad[~completion] == 0)
  assert np.all(np.abs(grad[completion]).sum(-1) > 0)


def tiny_model(attention='xla'):
  c = config_lib.preset('test')
  c.model.attention = attention
  resolved, _ = config_lib.resolve(c, 1, backend='cpu')
  model = model_lib.Transformer(resolved.model)
  params = model.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))['params']
  return model, jax.tree.map(lambda x: x.value if hasattr(x, 'value') else x, params)


def test_packed_batch_equals_examples_one_by_one():
  """Examples packed into rows (positions running on along the row, attention masked by segment)
  give the loss they give one per row at position 0: rotary scores depend only on distances."""
  model, params = tiny_model()
  examples = random_examples([7, 12, 5, 9, 11, 3], [3, 6, 1, 4, 10, 1], seed=2)
  T = 31
  packed = sft.PackedRows(examples, T, PAD)
  assert len(packed) < len(examples)  # some rows hold several examples
  loss_fn = jax.jit(state_lib.make_loss_fn(model, PAD))
  total, count = loss_fn(params, stack([packed[i] for i in range(len(packed))]))
  alone = [sft.PackedRows(examples.take(k, k + 1), T, PAD)[0] for k in range(len(examples))]
  one_by_one = [loss_fn(params, stack([row])) for row in alone]
  assert float(count) == sum(float(c) for _, c in one_by_one) == examples.is_target.sum() == 22
  np.testing.assert_allclose(float(total), sum(float(loss) for loss, _ in one_by_one), rtol=2e-6)
  # Without the segment mask the examples would see each other: the loss differs.
  unmasked = stack([packed[i] for i in range(len(packed))])
  del unmasked['segments']
  assert abs(float(loss_fn(params, unmasked)[0]) - float(total)) > 1e-3


def write_jsonl(path, records) -> str:
  with open(path, 'w', encoding='utf-8') as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + '\n')
  return str(path)


def sft_config(train, **data):
  c = config_lib.preset('test')
  c.data.format, c.data.train, c.train.batch_size, c.train.eval_batch_size = 'sft', train, 4, 4
  c.model.attention = 'xla'
  for k, v in data.items():
    c.data[k] = v
  return c


def test_prompt_completion_rows(tmp_path):
  path = write_jsonl(tmp_path / 'a.jsonl', [{'prompt': f'Q{i % 10}: ', 'completion': f'A{i % 10}'}
                                            for i in range(20)])
  data = build_data(sft_config(path, val_ratio=0.1))
  batch = next(data.train)
  assert set(batch) == {'tokens', 'weights', 'segments'} and batch['tokens'].shape == (4, 33)
  tok = tokenizer_lib.ByteTokenizer()
  for tokens, weights, segments in zip(batch['tokens'], batch['weights'], batch['segments']):
    # whole examples 'Qi: Ai<EOS>' (7 tokens: 4 fit a row of 33), then padding
    n = int(segments.max())
    assert n in (2, 4) and np.all(tokens[7 * n:] == tok.pad_id)
    assert np.all(np.diff(segments[:7 * n]) >= 0) and np.all(segments[7 * n:] == 0)
    trained = tokens[1:][weights > 0]
    assert tok.decode(trained).count('A') == n and 'Q' not in tok.decode(trained)
    assert list(trained).count(tok.eos_id) == n  # EOS is trained on
    assert len(trained) == 3 * n
  held_out = list(data.eval_batches())[0]  # the last 2 examples, in one row; the rest padding
  assert int(held_out['segments'].max()) == 2 and held_out['weights'][1:].sum() == 0


def test_chat_template_assistant_turns_are_the_completion():
  template = chat.ChatTemplate(
      "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
      "{% if add_generation_prompt %}<assistant>{% endif %}", {'bos_token': '<bos>'}, 'test')
  messages = [{'role': 'system', 'content': 'S'}, {'role': 'user', 'content': 'U1'},
              {'role': 'assistant', 'content': 'A1'}, {'role': 'user', 'content': 'U2'},
              {'role': 'assistant', 'content': 'A2'}]
  text, spans = template.assistant_spans(messages)
  assert text == '<bos><system>S</s><user>U1</s><assistant>A1</s><user>U2</s><assistant>A2</s>'
  assert [text[start:end] for start, end in spans] == ['A1</s>', 'A2</s>']


@pytest.mark.parametrize('line, message', [
    ({'prompt': 'p'}, 'a.jsonl:2: no "completion" field'),
    ({'completion': 'c'}, 'a.jsonl:2: no "prompt" field'),
    ({'prompt': 'p', 'completion': ''}, 'a.jsonl:2: "completion" is empty'),
    ('{"prompt": "p", ', 'a.jsonl:2: invalid JSON'),
    ({'prompt': 'p', 'completion': 'x' * 40}, 'a.jsonl:2: the example is 42 tokens, more than '
                                              'data.seq_len + 1 = 33'),
    ({'messages': [{'role': 'user', 'content': 'u'}]}, 'a.jsonl:2: "messages" needs a chat '
                                                       'template'),
])
def test_bad_lines_name_the_file_and_line(tmp_path, line, message):
  path = write_jsonl(tmp_path / 'a.jsonl', [{'prompt': 'p', 'completion': 'c'}, line])
  with pytest.raises(DataError) as e:
    build_data(sft_config(path))
  assert message in str(e.value)


def test_sources_other_than_jsonl_are_refused(tmp_path):
  with pytest.raises(DataError, match="embedded: data.format='sft' reads JSONL files"):
    build_data(sft_config('embedded'))


def test_bad_lines_can_be_skipped(tmp_path):
  good = [{'prompt': 'p', 'completion': 'c'}] * 4
  path = write_jsonl(tmp_path / 'a.jsonl', good + [{'prompt': 'p'}, 'nonsense'] + good)
  data = build_data(sft_config(path, on_bad_record='skip', val_ratio=0.25))
  assert int(next(data.train)['segments'].max()) > 0


def test_pallas_attention_is_refused_for_packed_data():
  c = sft_config('x.jsonl')
  c.model.attention = 'pallas'
  with pytest.raises(config_lib.ConfigError, match="model.attention='pallas'"):
    config_lib.resolve(c, 1, backend='cpu')


def test_sft_run_through_the_trainer_resumes_bitwise(tmp_path):
  """A tiny pretrained run, fine-tuned with configs/sft.py; stopped by SIGTERM and resumed, its
  losses equal those of a straight run, and its completion loss on held-out examples falls.
  The straight run names the model and restore_from; the stopped one `configs/sft.py:BASE`."""
  base = tmp_path / 'base'
  shape = [f'--config.model.{k}={v}' for k, v in (('num_layers', 2), ('d_model', 64),
                                                   ('mlp_dim', 128), ('num_heads', 4),
                                                   ('num_kv_heads', 2), ('remat', 'none'))]
  shape.append('--config.data.seq_len=32')
  common = ['--config.train.batch_size=8', '--config.train.log_every=1']

  def run(workdir, config, *extra):
    out = subprocess.run([sys.executable, '-m', 'jax_pretrain.main', f'--config={config}',
                          f'--workdir={workdir}', *common, *extra], cwd=ROOT,
                         env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr

  run(base, f'{ROOT}/configs/test.py', *shape, '--config.train.steps=6',
      '--config.optim.warmup_steps=2', '--config.train.eval_every=6')
  data = write_jsonl(tmp_path / 'sft.jsonl', [{'prompt': f'{i} + {i} = ', 'completion': str(2 * i)}
                                              for i in range(60)])
  sft_args = [f'--config.data.train={data}', '--config.train.eval_every=5',
              '--config.train.eval_steps=1', '--config.checkpoint.every_steps=6',
              '--config.optim.warmup_steps=2', '--config.train.steps=10']
  straight, stopped = tmp_path / 'straight', tmp_path / 'stopped'
  run(straight, f'{ROOT}/configs/sft.py', *shape, f'--config.checkpoint.restore_from={base}',
      *sft_args)
  # SIGTERM once step 5 is logged: the trainer stops after the step in flight, saves, exits 0.
  proc = subprocess.Popen([sys.executable, '-m', 'jax_pretrain.main',
                           f'--config={ROOT}/configs/sft.py:{base}', f'--workdir={stopped}',
                           *common, *sft_args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=subprocess_env(), cwd=ROOT)
  for line in proc.stdout:
    if line.startswith('step 5/'):
      proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=300) == 0
  saved = max(logged_losses(stopped))
  assert saved < 10
  out = run(stopped, f'{ROOT}/configs/sft.py:{base}', *sft_args)
  assert f'resuming from step {saved}' in out
  assert logged_losses(straight) == logged_losses(stopped)
  assert sorted(logged_losses(straight)) == list(range(1, 11))
  with open(os.path.join(straight, 'metrics.jsonl'), encoding='utf-8') as f:
    evals = [r['eval/loss'] for r in map(json.loads, f) if 'eval/loss' in r]
  assert len(evals) == 2 and evals[1] < evals[0]
  # evaluate scores a fine-tuned run as training did: the held-out examples' completion loss.
  run_cli('-m', 'jax_pretrain.evaluate', f'--workdir={straight}', f'--json={tmp_path}/eval.json')
  with open(tmp_path / 'eval.json', encoding='utf-8') as f:
    assert json.load(f)[0]['loss'] == pytest.approx(evals[1], rel=1e-5)


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_messages_render_as_transformers_does_and_train_on_assistant_turns(tmp_path):
  transformers = pytest.importorskip('transformers')
  directory = tmp_path / 'tok'
  tokenizer_lib.train_bytelevel_bpe(['user assistant system hello 2 + 3 = 5'] * 20,
                                    str(directory / 'tokenizer.json'), 300)
  with open(directory / 'tokenizer_config.json', encoding='utf-8') as f:
    tokenizer_config = json.load(f)
  tokenizer_config['chat_template'] = CHATML
  with open(directory / 'tokenizer_config.json', 'w', encoding='utf-8') as f:
    json.dump(tokenizer_config, f)
  conversations = [[{'role': 'system', 'content': 'Be brief.'},
                    {'role': 'user', 'content': f'{i} + 3 ='},
                    {'role': 'assistant', 'content': str(i + 3)},
                    {'role': 'user', 'content': 'and 2 + 3 ='},
                    {'role': 'assistant', 'content': '5'}] for i in range(8)]
  template = chat.find_template([str(directory)])
  theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
  for messages in conversations:
    assert template.render(messages, False) == theirs.apply_chat_template(
        messages, tokenize=False)

  path = write_jsonl(tmp_path / 'chat.jsonl', [{'messages': m} for m in conversations])
  c = sft_config(path, tokenizer=str(directory), seq_len=320)
  c.train.batch_size = c.train.eval_batch_size = 2
  data = build_data(c)
  batch = next(data.train)
  tok = data.tokenizer
  for tokens, weights, segments in zip(batch['tokens'], batch['weights'], batch['segments']):
    targets = tokens[1:][weights > 0]
    n = int(segments.max())
    # exactly the two assistant turns of each example (with the template's end of turn), and EOS
    assert re.fullmatch(r'(\d+<\|im_end\|>\n5<\|im_end\|>\n){%d}' % n,
                        tok.decode(targets[targets != tok.eos_id]))
    assert n >= 1 and list(targets).count(tok.eos_id) == n
  # A run's tokenizer/ keeps the template, so an SFT run restored from it can render messages.
  tokenizer_lib.save(data.tokenizer, str(tmp_path / 'run_tokenizer'))
  kept = chat.find_template([str(tmp_path / 'run_tokenizer')])
  assert kept is not None and kept.render(conversations[0], False) == template.render(
      conversations[0], False)


def test_sft_steps_on_a_mesh_with_accumulation_agree_with_one_device():
  """Weights and segments travel with the tokens: split over data, fsdp and tensor, and cut
  into micro-batches, they give the losses of one device."""
  lengths = np.random.default_rng(3).integers(4, 20, 120)
  examples = random_examples(lengths, lengths // 2, seed=4)
  packed = sft.PackedRows(examples, 32, PAD)
  batches = [{k: np.stack([packed[(16 * b + r) % len(packed)][k] for r in range(16)])
              for k in ('tokens', 'weights', 'segments')} for b in range(3)]

  def run(mesh, micro_batch_size):
    c = sft_config('unused.jsonl')
    c.model.num_heads = c.model.num_kv_heads = 4
    c.train.batch_size, c.train.micro_batch_size, c.train.steps = 16, micro_batch_size, 5
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
    s = build_setup(c, devices=jax.devices()[:int(np.prod(mesh))])
    state, step = state_lib.init_state(s), state_lib.jit_train_step(s, pad_id=PAD)
    losses = []
    for batch in batches:
      state, metrics = step(state, jax.device_put(batch, s.batch_sharding))
      losses.append(float(metrics['loss']))
    return np.array(losses)

  with jax.default_matmul_precision('float32'):
    np.testing.assert_allclose(run((2, 2, 2), 2), run((1, 1, 1), 0), rtol=1e-5)


def test_fused_attention_path_passes_the_segment_mask_under_shard_map(monkeypatch):
  """The cuDNN path (GPU only) with its kernel replaced by XLA's: the mask reaches each device's
  rows under shard_map, and a packed batch gives the loss of the 'xla' path."""
  import functools  # noqa: PLC0415

  from jax_pretrain.kernels import attention  # noqa: PLC0415
  monkeypatch.setattr(attention, '_fused', lambda implementation: functools.partial(
      jax.nn.dot_product_attention, is_causal=True, implementation='xla'))
  examples = random_examples([7, 12, 5, 9, 11, 3, 8, 6], [3, 6, 1, 4, 10, 1, 2, 2], seed=5)
  packed = sft.PackedRows(examples, 31, PAD)
  batch = stack([packed[i % len(packed)] for i in range(8)])
  losses = {}
  for implementation in ('xla', 'cudnn'):
    c = sft_config('unused.jsonl')
    c.model.attention, c.mesh.data, c.mesh.tensor = implementation, 4, 2
    resolved, _ = config_lib.resolve(c, 8, backend='gpu')
    model = model_lib.Transformer(resolved.model,
                                  mesh=sharding.make_mesh((4, 1, 2), jax.devices()))
    params = model.init(jax.random.key(1), jnp.zeros((8, 31), jnp.int32))['params']
    params = jax.tree.map(lambda x: x.value if hasattr(x, 'value') else x, params)
    losses[implementation] = jax.jit(state_lib.make_loss_fn(model, PAD))(params, batch)[0]
  np.testing.assert_allclose(float(losses['cudnn']), float(losses['xla']), rtol=1e-6)
