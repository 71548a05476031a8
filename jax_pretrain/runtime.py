"""Process settings for training fast on GPUs, applied before jax starts its backend.

`configure()` (called by the trainer, the plan and the benchmarks, before anything runs on a
device) sets, unless the user already did:

XLA_FLAGS, each added only when the user's XLA_FLAGS does not name it (the user's value wins).
They change only how XLA:GPU schedules collectives; the CPU ignores them. The defaults they
change were read from the compile options XLA 0.12.0.1's GPU compiler dumps (`--xla_dump_to`),
and their memory cost from `python -m jax_pretrain.plan` (xlarge, H100, remat dots, micro-batch 8).
  --xla_gpu_enable_latency_hiding_scheduler=true   off by default. Lets XLA run a collective
      while independent kernels run: FSDP's per-layer all-gathers and reduce-scatters overlap the
      neighbouring layer's compute instead of stalling it. (NVIDIA's JAX-Toolbox GPU performance
      guide; MaxText's GPU scripts set it too.) Memory: +0 on 1 GPU and data=8, +1.2 GiB at fsdp=8.
  --xla_gpu_enable_pipelined_all_gather=true   off by default (reduce-scatter pipelining is on).
      The collective pipeliner issues the next layer's FSDP weight gather during this layer of the
      scan, so no layer waits for its own weights (same guide). Memory: +0 in all three cases.
  Not set:
  --xla_gpu_enable_while_loop_double_buffering (the same guide suggests it for FSDP): it unrolls
      every scan by two and costs +2.2 GiB on one GPU, where there is nothing to overlap.
  the collective combine thresholds (30 MB by default): the per-layer FSDP gathers fit under
      them already, and the data-parallel gradient reduction is one all-reduce per parameter
      array of 0.1-1 GB after the accumulation loop (state.make_train_step), too large to combine.

XLA_CLIENT_MEM_FRACTION=0.9, unless it or its deprecated name XLA_PYTHON_CLIENT_MEM_FRACTION is
  set (jaxlib refuses both): JAX preallocates 75% of GPU memory by default; training wants the most
  it can get while leaving room for the CUDA context, cuBLAS/cuDNN and NCCL buffers (~8 GB on an
  80 GB card; NVIDIA's JAX-Toolbox guide suggests 0.8-0.9). jax_pretrain.plan reports "fits"
  against this fraction.

The persistent compilation cache: jax_compilation_cache_dir = $JAX_COMPILATION_CACHE_DIR, else
  $XDG_CACHE_HOME/jax_pretrain/xla (~/.cache/jax_pretrain/xla), so a restarted run (or the same
  step compiled by the plan or the benchmarks) loads the compiled program instead of compiling it
  again. JAX_ENABLE_COMPILATION_CACHE=false turns it off.
"""
import os

GPU_XLA_FLAGS = (
    '--xla_gpu_enable_latency_hiding_scheduler=true',
    '--xla_gpu_enable_pipelined_all_gather=true',
)
MEM_FRACTION = '0.9'
_MEM_FRACTION_VARIABLES = ('XLA_CLIENT_MEM_FRACTION', 'XLA_PYTHON_CLIENT_MEM_FRACTION')


def mem_fraction() -> float:
  """The fraction of device memory JAX may preallocate in this process."""
  return float(next((os.environ[v] for v in _MEM_FRACTION_VARIABLES if os.environ.get(v)),
                    MEM_FRACTION))


def default_cache_dir() -> str:
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(base, 'jax_pretrain', 'xla')


def merge_xla_flags(user: str, defaults=GPU_XLA_FLAGS) -> str:
  """The user's XLA_FLAGS plus each default flag the user did not set."""
  named = {f.split('=')[0] for f in user.split()}
  added = [f for f in defaults if f.split('=')[0] not in named]
  return ' '.join(([user.strip()] if user.strip() else []) + added)


def configure(cache: bool = True) -> list[str]:
  """Applies the settings above to this process; returns settings()'s lines for a GPU.

  Must run before jax initializes its backend (the first jax.devices() or computation).
  cache=False turns the persistent compilation cache off instead (jax_pretrain.plan: a program
  compiled without a GPU was not autotuned, and must never be what a training run loads).
  """
  os.environ['XLA_FLAGS'] = merge_xla_flags(os.environ.get('XLA_FLAGS', ''))
  if not any(os.environ.get(v) for v in _MEM_FRACTION_VARIABLES):
    os.environ['XLA_CLIENT_MEM_FRACTION'] = MEM_FRACTION
  import jax  # noqa: PLC0415
  if not cache:
    jax.config.update('jax_enable_compilation_cache', False)
  elif not jax.config.jax_compilation_cache_dir:
    jax.config.update('jax_compilation_cache_dir', default_cache_dir())
  return settings('gpu')


def settings(platform: str) -> list[str]:
  """The settings in force, one line each, for a run on `platform` ('gpu', 'cpu', ...): the GPU
  ones only on a GPU."""
  import jax  # noqa: PLC0415
  cache = (jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache
           else 'off') or 'off'
  lines = [f'compile cache     {cache} (JAX_COMPILATION_CACHE_DIR)']
  if platform == 'gpu':
    lines = [f'XLA_FLAGS         {os.environ.get("XLA_FLAGS", "")}',
             f'GPU memory        {mem_fraction():.0%} preallocated (XLA_CLIENT_MEM_FRACTION)',
             *lines]
  return lines
