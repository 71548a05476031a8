"""Every default of jax_pretrain, one line of comment each. Presets override only what differs.

Derived values (head_dim, steps from tokens, accumulation steps, ...) are not stored here:
jax_pretrain/config.py computes them once, after command-line overrides, and validates everything.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  c.model = m = ml_collections.ConfigDict()
  m.num_layers = 12            # transformer blocks
  m.d_model = 512              # residual stream width
  m.num_heads = 8              # query heads
  m.num_kv_heads = 8           # key/value heads (grouped-query attention); divides num_heads
  m.head_dim = 0               # 0: d_model // num_heads
  m.mlp_dim = 1408             # SwiGLU hidden width (about 8/3 d_model, a multiple of 128)
  m.vocab_size = 32768         # embedding rows; >= the tokenizer's vocabulary
  m.tie_embeddings = True      # share the input embedding with the output projection
  m.rope_theta = 10000.0       # rotary embedding base
  m.norm_eps = 1e-5            # RMSNorm epsilon
  m.init_std = 0.02            # normal init std (output projections scaled by 1/sqrt(2*layers))
  m.attention = 'auto'         # 'auto' (cuDNN where it runs, else XLA) | 'xla' | 'cudnn' | 'pallas'
  m.remat = 'auto'             # 'auto' (dots with fused attention, else full) | 'none' | 'full' |
                               # 'dots' | 'dots_no_batch' | 'minimal'
  m.scan_layers = True         # scan over stacked layers (compile time independent of depth)
  m.dtype = 'bfloat16'         # compute dtype; params and optimizer state stay float32
  m.param_dtype = 'float32'    # master parameter dtype

  c.data = d = ml_collections.ConfigDict()
  d.seq_len = 2048             # tokens per training sequence
  d.train = ''                 # required: 'SOURCE[#field][:weight],...' (docs/data.md)
  d.val = ''                   # eval sources; '' carves val_ratio from the training data
  d.val_ratio = 0.05           # share of the training data held out for eval when val is ''
  d.tokenizer = ''             # '': from the data (else bytes); 'byte'; or a sentencepiece .model
  d.text_field = 'text'        # JSONL key, Parquet column or TFDS feature that holds the text
  d.tfds_data_dir = ''         # TFDS data_dir for tfds:NAME sources ('' : ~/tensorflow_datasets)
  d.on_bad_record = 'error'    # bad raw-text lines: 'error' | 'skip' (counted, reported per file)
  d.num_workers = 0            # grain worker processes for batches (0: threads in this process)
  d.read_threads = 2           # threads assembling batches in each process
  d.prefetch = 4               # batches buffered ahead of the trainer

  c.train = t = ml_collections.ConfigDict()
  t.steps = 0                  # optimizer steps; 0: derive from total_tokens
  t.total_tokens = 0           # run length in tokens (alternative to steps)
  t.batch_size = 64            # global batch, in sequences
  t.micro_batch_size = 0       # sequences per data-parallel device per forward/backward; 0: on a
                               # GPU the largest that fits (compiled at start-up, printed), else
                               # batch_size / data-parallel devices (no accumulation)
  t.learning_rate = 3e-4       # peak learning rate
  t.min_learning_rate = 3e-5   # end of the cosine decay
  t.warmup_steps = 0           # linear warmup; 0: derive from warmup_tokens
  t.warmup_tokens = 0          # warmup in tokens (alternative to warmup_steps)
  t.b1 = 0.9                   # AdamW beta1
  t.b2 = 0.95                  # AdamW beta2
  t.eps = 1e-8                 # AdamW epsilon
  t.weight_decay = 0.1         # decoupled weight decay (not applied to norms or other 1-D params)
  t.grad_clip = 1.0            # clip by global norm; 0 disables
  t.seed = 0                   # parameter init and data order
  t.log_every = 10             # steps between logged scalars
  t.eval_every = 500           # steps between evals (and at the end)
  t.eval_steps = 20            # eval batches per eval
  t.eval_batch_size = 0        # 0: micro_batch_size × data-parallel devices (one pass, no OOM)
  t.peak_flops = 0.0           # device peak dense bf16 FLOP/s for MFU; 0: look up by device kind
  t.on_nonfinite = 'halt'      # non-finite loss or grad norm: 'halt' (stop, checkpoints intact) | 'skip'
  t.max_consecutive_skips = 10  # with 'skip': halt after this many non-finite steps in a row
  t.sample_prompt = 'The '     # prompt of the continuation printed at the end ('' disables)
  t.sample_tokens = 64         # tokens generated for that continuation

  c.optim = o = ml_collections.ConfigDict()
  o.mu_dtype = 'float32'       # AdamW first-moment dtype; 'bfloat16' halves its memory

  c.mesh = mesh = ml_collections.ConfigDict()
  mesh.data = -1               # data-parallel axis size; -1: all remaining devices
  mesh.fsdp = 1                # parameter-sharded data-parallel axis size
  mesh.tensor = 1              # tensor-parallel axis size (heads, MLP, vocab)

  c.checkpoint = ck = ml_collections.ConfigDict()
  ck.every_steps = 1000        # steps between (asynchronous) saves; 0: only the final save
  ck.keep = 2                  # keep the latest this many checkpoints
  ck.keep_best = 3             # and also the best this many by eval loss (0: none)
  ck.async_save = True         # write in the background while training continues
  ck.save_final = True         # save the state at the end of training
  ck.restore_from = ''         # another run's workdir: start from its params (fresh optimizer, data)
  return c
