"""The peer: the same training step and the same decoding in Hugging Face transformers + PyTorch.

  python scripts/benchmark_peer.py --config=configs/xlarge.py --config.train.batch_size=32 \
      --micro_batch=8 [--steps 5] [--warmup 2] [--nocompile] [--checkpointing] [--notrain] \
      [--nodecode --sequences=64 --prompt_tokens=512 --new_tokens=128] [--markdown] [--check_loss]

Training: LlamaForCausalLM built from the config's model (hf.hf_config: layers, d_model, heads, kv
heads, head_dim, MLP, vocabulary, tied embeddings, RMSNorm epsilon, rotary), random weights (no
download), SDPA attention, torch.compile (--nocompile: eager; --checkpointing: activation
checkpointing), float32 master weights under bfloat16 autocast, fused AdamW with the config's
optimizer settings and gradient clipping, train.batch_size × data.seq_len tokens a step in
micro-batches of --micro_batch (gradient accumulation; 0: train.micro_batch_size, or the whole
batch), a float32 cross-entropy over every next token. The median step of --steps after --warmup:
tokens/s, and MFU by the trainer's count (model.flops_per_token, metrics' peak for the GPU).
Decoding: `generate` with a static cache (compiled by transformers; --nocompile: not) of the model
in bfloat16, --sequences prompts of --prompt_tokens random ids each sampling exactly --new_tokens
tokens at temperature 1 over the whole vocabulary, prefill included, after an untimed run: tokens/s
as scripts/benchmark_engine.py counts them.

--markdown prints only table rows: training in scripts/benchmark.py's columns, decoding in
scripts/benchmark_engine.py's, for scripts/gpu_check.sh to print under ours. --check_loss first
compares the loss at step 0 with ours on the same weights (our init, mapped by hf.to_hf), in
float32 on the CPU. torch and transformers are optional (requirements-dev.txt): without them this
says so in one line and exits 0.
"""
import os
import statistics
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # (jax reads the config only: the GPU is torch's)

from absl import flags

from jax_pretrain import cli

_CONFIG = cli.define_config('xlarge.py', 'Config whose model and batch to run.')
_MICRO_BATCH = flags.DEFINE_integer('micro_batch', 0, 'Sequences per forward/backward (0: the '
                                    "config's train.micro_batch_size, or the whole batch).")
_STEPS = flags.DEFINE_integer('steps', 5, 'Timed training steps (after warm-up).')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed training steps first (compiles).')
_COMPILE = flags.DEFINE_bool('compile', True, 'torch.compile the model (training and decoding).')
_CHECKPOINTING = flags.DEFINE_bool('checkpointing', False, 'Activation checkpointing.')
_TRAIN = flags.DEFINE_bool('train', True, 'Time the training step.')
_DECODE = flags.DEFINE_bool('decode', True, 'Time generate.')
_SEQUENCES = flags.DEFINE_integer('sequences', 64, 'Decoding: sequences at once.')
_PROMPT = flags.DEFINE_integer('prompt_tokens', 512, 'Decoding: tokens of every prompt.')
_NEW = flags.DEFINE_integer('new_tokens', 128, 'Decoding: tokens generated per sequence.')
_MARKDOWN = flags.DEFINE_bool('markdown', False, 'Print table rows only (scripts/gpu_check.sh).')
_CHECK_LOSS = flags.DEFINE_bool('check_loss', False,
                                'Compare the step-0 loss with ours on the same weights first.')


def hf_model(c, torch, transformers, dtype):
  """LlamaForCausalLM of our model config c, random weights, SDPA attention."""
  from jax_pretrain import hf
  fields = hf.hf_config(c, max_position_embeddings=max(c.rope_original_max_len, 8192),
                        bos_id=None, eos_id=None, pad_id=None)
  config = transformers.LlamaConfig(**{k: v for k, v in fields.items() if k != 'rope_scaling'})
  torch.manual_seed(0)
  return transformers.AutoModelForCausalLM.from_config(config, attn_implementation='sdpa',
                                                       dtype=dtype)


def next_token_loss(torch, model, tokens_BxT1):
  """Mean cross-entropy of tokens[:, 1:] given tokens[:, :-1], in float32 (as ours)."""
  logits = model(input_ids=tokens_BxT1[:, :-1]).logits
  return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                           tokens_BxT1[:, 1:].flatten())


def check_loss(c, torch, transformers) -> tuple[float, float]:
  """(our loss, transformers' loss) at step 0 on the same float32 weights and tokens, on the CPU."""
  import dataclasses

  from flax.linen import meta
  import jax
  import numpy as np

  from jax_pretrain import hf
  from jax_pretrain import model as model_lib
  from jax_pretrain import state as state_lib
  m = dataclasses.replace(c.model, dtype='float32')
  tokens = np.random.default_rng(0).integers(0, m.vocab_size, (2, c.data.seq_len + 1))
  model = model_lib.Transformer(m)
  params = meta.unbox(jax.jit(model.init)(jax.random.key(0), tokens[:, :-1])['params'])
  with jax.default_matmul_precision('float32'):
    total, count = state_lib.make_loss_fn(model, pad_id=-1)(params, {'tokens': tokens})
  theirs = hf_model(m, torch, transformers, torch.float32)
  missing, unexpected = theirs.load_state_dict(
      {k: torch.tensor(v) for k, v in hf.to_hf(params, m).items()}, strict=False)
  assert not unexpected and set(missing) <= {'lm_head.weight'}, (missing, unexpected)  # (tied)
  with torch.no_grad():
    loss = next_token_loss(torch, theirs, torch.from_numpy(tokens))
  return float(total / count), float(loss)


def train(c, torch, transformers, device: str, micro_batch: int) -> dict:
  """The training step's median time and what it used (see the module docstring)."""
  from jax_pretrain import metrics as metrics_lib
  from jax_pretrain import model as model_lib
  B, T, o = c.train.batch_size, c.data.seq_len, c.optim
  accumulation = B // micro_batch
  model = hf_model(c.model, torch, transformers, torch.float32).to(device)
  if _CHECKPOINTING.value:
    model.gradient_checkpointing_enable()
  model.train()
  optimizer = torch.optim.AdamW(model.parameters(), lr=o.learning_rate, betas=(o.b1, o.b2),
                                eps=o.eps, weight_decay=o.weight_decay, fused=True)
  forward = torch.compile(model) if _COMPILE.value else model
  generator = torch.Generator(device).manual_seed(0)
  batches = [torch.randint(0, c.model.vocab_size, (B, T + 1), device=device, generator=generator)
             for _ in range(4)]  # rotated, as scripts/benchmark.py does

  def step(tokens_BxT1):
    for tokens in tokens_BxT1.chunk(accumulation):
      with torch.autocast(device, dtype=torch.bfloat16):
        loss = next_token_loss(torch, forward, tokens)
      (loss / accumulation).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip or float('inf'))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm

  def synchronize():
    if device == 'cuda':
      torch.cuda.synchronize()
  times = []
  t0 = time.perf_counter()
  for i in range(_WARMUP.value + _STEPS.value):
    synchronize()
    t = time.perf_counter()
    loss, grad_norm = step(batches[i % len(batches)])
    synchronize()
    if i == 0:
      compile_s = time.perf_counter() - t0
    if i >= _WARMUP.value:
      times.append(time.perf_counter() - t)
  step_s = statistics.median(times)
  tokens_per_s = B * T / step_s
  kind = torch.cuda.get_device_name() if device == 'cuda' else ''
  peak = metrics_lib.peak_flops_per_device(kind, c.train.peak_flops)
  mfu = metrics_lib.mfu(model_lib.flops_per_token(c.model, T), tokens_per_s, 1, peak)
  peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device == 'cuda' else None
  return {'micro_batch': micro_batch, 'accumulation': accumulation, 'step_s': step_s,
          'tokens_per_s': tokens_per_s, 'mfu': mfu, 'peak_gib': peak_gib,
          'compile_s': compile_s, 'loss': loss.item(), 'grad_norm': grad_norm.item()}


def decode(c, torch, transformers, device: str) -> dict:
  """generate's tokens/s (see the module docstring)."""
  n, P, M = _SEQUENCES.value, _PROMPT.value, _NEW.value
  model = hf_model(c.model, torch, transformers, torch.bfloat16).to(device).eval()
  prompts = torch.randint(0, c.model.vocab_size, (n, P), device=device,
                          generator=torch.Generator(device).manual_seed(n))
  settings = dict(attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                  top_k=0, top_p=1.0, max_new_tokens=M, min_new_tokens=M, eos_token_id=None,
                  pad_token_id=0, cache_implementation='static', disable_compile=not _COMPILE.value)

  def generate():
    with torch.no_grad():
      out = model.generate(prompts, **settings)
    if device == 'cuda':
      torch.cuda.synchronize()
    return out
  generate()  # (compiles)
  t = time.perf_counter()
  out = generate()
  seconds = time.perf_counter() - t
  assert out.shape == (n, P + M), out.shape
  return {'sequences': n, 'prompt': P, 'new': M, 'tokens_per_s': n * M / seconds}


def setting(r: dict) -> str:
  how = 'torch.compile' if _COMPILE.value else 'eager'
  remat = ', activation checkpointing' if _CHECKPOINTING.value else ''
  return (f'transformers {how}: sdpa{remat}, mb {r["micro_batch"]} × {r["accumulation"]}, '
          'bf16 autocast')


def train_row(r: dict) -> str:
  """A row in scripts/benchmark.py's Markdown columns."""
  if 'error' in r:
    return f'| transformers: {r["error"]} | failed | | | | | |'
  mfu = f'{r["mfu"]:.1%}' if r['mfu'] is not None else 'n/a'
  mem = f'{r["peak_gib"]:.1f}' if r['peak_gib'] is not None else 'n/a'
  return (f'| {setting(r)} | {r["tokens_per_s"]:,.0f} | {mfu} | {r["step_s"]:.3f} | - / {mem} | '
          f'{r["compile_s"]:.1f} (first step) | {r["loss"]:.4f}, {r["grad_norm"]:.4f} |')


def decode_row(r: dict) -> str:
  """A row in scripts/benchmark_engine.py's Markdown columns."""
  how = 'static cache, compiled' if _COMPILE.value else 'static cache'
  if 'error' in r:
    return f'| transformers generate ({how}): {r["error"]} | failed | | | | | |'
  return (f'| transformers generate ({how}) | {r["sequences"]} × ({r["prompt"]} + {r["new"]}) | '
          f'{r["sequences"]} | {r["tokens_per_s"]:,.0f} | | | |')


def main():
  try:
    import torch
    import transformers
  except ImportError as e:
    print(f'the peer needs torch and transformers (pip install -r requirements-dev.txt): {e}')
    return
  from jax_pretrain import config as config_lib
  c, _ = config_lib.resolve(cli.config_value(_CONFIG), 1, backend='cpu')
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  if _CHECK_LOSS.value:
    ours, theirs = check_loss(c, torch, transformers)
    print(f'loss at step 0 on the same weights: ours {ours:.6f}, transformers {theirs:.6f}')
  micro_batch = _MICRO_BATCH.value or c.train.micro_batch_size or c.train.batch_size
  parts = [(train, train_row, (micro_batch,))] if _TRAIN.value else []
  parts += [(decode, decode_row, ())] if _DECODE.value else []
  rows = []
  for run, row, args in parts:
    try:
      rows.append(row(run(c, torch, transformers, device, *args)))
    except Exception as e:  # noqa: BLE001  (out of memory, a compile failure, ...)
      rows.append(row({'error': f'{type(e).__name__}: {str(e).splitlines()[0][:120]}'}))
    if device == 'cuda':
      torch.cuda.empty_cache()
  versions = (f'transformers {transformers.__version__}, torch {torch.__version__}, '
              f'{torch.cuda.get_device_name() if device == "cuda" else "CPU"}')
  if _MARKDOWN.value:
    print('\n'.join(rows) + f'\n\n(the peer: {versions})')
    return
  print(f'{versions}; batch {c.train.batch_size} × seq {c.data.seq_len}')
  print('\n'.join(rows))


if __name__ == '__main__':
  cli.run(main)
