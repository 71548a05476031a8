"""Continued pretraining of Hugging Face checkpoints, end to end on the CPU at reduced size:
random SmolLM-shaped (GQA 9/3, tied, byte-level BPE tokenizer.json) and Llama-3.2-shaped (llama3
rotary scaling, bfloat16 shards, a tokenizer that prepends BOS) checkpoints made with transformers
-> import -> a few training steps on JSONL with the checkpoint's own tokenizer -> export ->
transformers' logits equal ours, and AutoTokenizer gives our ids. Needs torch and transformers
(skipped without them)."""
import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import evaluate
from jax_pretrain import hf
from jax_pretrain import model as model_lib
from jax_pretrain import pretrain
from jax_pretrain import sample
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.data import corpus
from jax_pretrain.data import tokenizer as tokenizer_lib

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
tokenizers = pytest.importorskip('tokenizers')

SENTENCE = 'The for statement iterates over the items of any sequence, in order: 3.14 ünïcödé.'


@dataclasses.dataclass
class Shape:
  name: str
  tokenizer_specials: tuple[str, ...]  # ids 0, 1, ...
  tokenizer_config: dict  # tokenizer_config.json: bos/eos (no pad: ours is appended)
  bos_template: bool  # a post-processor that prepends BOS, as Llama 3's does
  config: dict  # transformers.LlamaConfig arguments
  dtype: str
  max_shard_size: str


SMOLLM = Shape(
    'smollm', ('<|endoftext|>', '<|im_start|>', '<|im_end|>'),
    {'bos_token': '<|endoftext|>', 'eos_token': '<|endoftext|>'}, False,
    dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16,
         intermediate_size=384, num_hidden_layers=2, tie_word_embeddings=True,
         rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0},
         max_position_embeddings=2048, bos_token_id=0, eos_token_id=0),
    'float32', '10GB')
LLAMA32 = Shape(
    'llama3.2', ('<|begin_of_text|>', '<|end_of_text|>'),
    {'bos_token': '<|begin_of_text|>', 'eos_token': '<|end_of_text|>'}, True,
    dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
         intermediate_size=512, num_hidden_layers=2, tie_word_embeddings=True,
         rope_parameters={'rope_type': 'llama3', 'rope_theta': 500000.0, 'factor': 32.0,
                          'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                          'original_max_position_embeddings': 64},
         max_position_embeddings=1024, bos_token_id=0, eos_token_id=1),
    'bfloat16', '300KB')


def make_tokenizer(shape: Shape, directory: str, docs: list[str]) -> int:
  """A byte-level BPE trained with tokenizers, saved with its tokenizer_config.json; returns its
  vocabulary size."""
  byte_level = tokenizers.pre_tokenizers.ByteLevel
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = byte_level(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(docs, tokenizers.trainers.BpeTrainer(
      vocab_size=700, special_tokens=list(shape.tokenizer_specials),
      initial_alphabet=byte_level.alphabet(), show_progress=False))
  if shape.bos_template:
    bos = shape.tokenizer_specials[0]
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=f'{bos} $A', pair=f'{bos} $A {bos} $B', special_tokens=[(bos, 0)])
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump(dict(shape.tokenizer_config, tokenizer_class='PreTrainedTokenizerFast'), f)
  return tok.get_vocab_size()


def make_checkpoint(shape: Shape, directory: str, vocab_size: int):
  """A random LlamaForCausalLM (norm weights random too), saved in shape.dtype."""
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=vocab_size, initializer_range=0.05,
                                    rms_norm_eps=1e-5, **shape.config)
  model = transformers.LlamaForCausalLM(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'norm' in name:
        p.uniform_(0.5, 1.5)
  model.to(getattr(torch, shape.dtype)).save_pretrained(directory,
                                                        max_shard_size=shape.max_shard_size)


def our_logits(workdir: str, tokens_BxT: np.ndarray) -> np.ndarray:
  run = workdir_lib.load(workdir, devices=jax.devices()[:1])
  with jax.default_matmul_precision('float32'):
    return np.asarray(model_lib.Transformer(run.config.model).apply(
        {'params': run.params}, tokens_BxT))


def their_logits(hf_dir: str, tokens_BxT: np.ndarray) -> np.ndarray:
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  with torch.no_grad():
    return model(torch.tensor(tokens_BxT)).logits.numpy()


def relative(ours: np.ndarray, theirs: np.ndarray) -> float:
  return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


@pytest.mark.parametrize('shape', [SMOLLM, LLAMA32], ids=lambda s: s.name)
def test_continued_pretraining_of_a_hugging_face_checkpoint(tmp_path, shape):
  docs = corpus.embedded_documents()
  hf_dir, run_dir, trained_dir, out_dir = (str(tmp_path / d) for d in ('hf', 'imported',
                                                                       'trained', 'exported'))
  vocab_size = make_tokenizer(shape, hf_dir, docs[:40])
  make_checkpoint(shape, hf_dir, vocab_size)
  if shape.max_shard_size != '10GB':
    assert os.path.isfile(os.path.join(hf_dir, 'model.safetensors.index.json'))

  # Import: the checkpoint's tokenizer.json and config; logits equal the original's.
  run = hf.import_run(hf_dir, run_dir, config_lib.preset('test'))
  tok = run.tokenizer
  assert isinstance(tok, tokenizer_lib.HfTokenizer) and tok.num_pieces == vocab_size
  assert tok.pad_id == vocab_size and run.config.model.vocab_size % 128 == 0  # pad appended
  assert run.config.model.num_kv_heads == shape.config['num_key_value_heads']
  ids = tok.encode(SENTENCE)
  assert (ids[0] == 0) == shape.bos_template and ids.max() >= 259  # BPE ids, not bytes
  text_alone = tokenizer_lib.text_ids(tok, SENTENCE)  # what lm_eval scores: no BOS
  assert text_alone.tolist() == ids[int(shape.bos_template):].tolist()
  tokens_BxT = np.stack([ids[:24], tok.encode(docs[75])[:24]])
  imported = relative(our_logits(run_dir, tokens_BxT)[..., :vocab_size],
                      their_logits(hf_dir, tokens_BxT))
  print(f'{shape.name}: imported logits, relative difference {imported:.2e}')
  assert imported < 1e-4

  # Continue pretraining on JSONL, with the imported run's config (its tokenizer, its params).
  data = tmp_path / 'train.jsonl'
  with open(data, 'w', encoding='utf-8') as f:
    f.writelines(json.dumps({'text': d}) + '\n' for d in docs[40:70])
  config = workdir_lib.load_config(run_dir)
  config.data.train = str(data)
  config.train.steps, config.train.batch_size, config.optim.warmup_steps = 3, 4, 1
  config.train.eval_steps, config.train.eval_every = 1, 3
  pretrain.train_and_evaluate(config, trained_dir, devices=jax.devices()[:1])
  trained = workdir_lib.load(trained_dir, devices=jax.devices()[:1])
  assert trained.step == 3 and trained.tokenizer.identity == tok.identity
  assert not np.array_equal(np.asarray(trained.params['embedding']),
                            np.asarray(run.params['embedding']))

  # sample and evaluate use the checkpoint's tokenizer: ids past the byte range, bits per byte.
  new = sample.generate(trained.config.model, trained.params,
                        [tok.encode('The ')], 32, eos_id=tok.eos_id, pad_id=tok.pad_id,
                        vocab_size=tok.vocab_size, sampling=sample.Sampling(temperature=1.0))
  assert max(new[0]) >= 259
  results = evaluate.evaluate(trained_dir, max_tokens=256, devices=jax.devices()[:1])
  assert results[0].bits_per_byte is not None and np.isfinite(results[0].bits_per_byte)

  # Export: transformers computes our logits; AutoTokenizer gives our ids.
  assert hf.export(trained_dir, out_dir) == []
  exported = relative(our_logits(trained_dir, tokens_BxT), their_logits(out_dir, tokens_BxT))
  print(f'{shape.name}: exported logits after training, relative difference {exported:.2e}')
  assert exported < 1e-4
  auto = transformers.AutoTokenizer.from_pretrained(out_dir)
  print(f'{shape.name}: {SENTENCE!r}\n  ours:          {tok.encode(SENTENCE).tolist()}\n'
        f'  AutoTokenizer: {auto(SENTENCE)["input_ids"]}')
  assert auto(SENTENCE)['input_ids'] == tok.encode(SENTENCE).tolist()
  assert (auto.eos_token_id, auto.pad_token_id) == (tok.eos_id, tok.pad_id)
  with open(os.path.join(out_dir, 'config.json'), encoding='utf-8') as f:
    assert json.load(f)['max_position_embeddings'] == shape.config['max_position_embeddings']
