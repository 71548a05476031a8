"""train.profile_steps and jax_pretrain.profile_summary: the trainer's own trace of the test preset
on the CPU, summarised by kind; and a GPU trace (cuDNN attention, nvjet and cuBLAS GEMMs, copies,
NCCL, fusions, a command buffer's kernel) whose every microsecond is known."""
import glob
import gzip
import json
import os

import jax
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import pretrain
from jax_pretrain import profile_summary
from tests.conftest import run_cli

JAX = 'jit(train_step)/while/body/eval_jaxpr/'
MODEL = JAX + 'jvp(Transformer)/while/body/eval_jaxpr/'
BACKWARD = JAX + 'transpose(jvp(Transformer))/'

# name: (what the entry computation holds, its op_name): 'fusion OPCODE' is a fusion of one
# instruction, anything else the instruction itself (custom-call TARGET for a custom call).
INSTRUCTIONS = {
    'gemm_fusion_dot.1': ('fusion dot', MODEL + 'layers/mlp/btd,df->btf/dot_general'),
    'custom-call.7': ('custom-call __cublas$gemm', BACKWARD + 'btd,dv->btv/dot_general'),
    'dot_product_attention_fwd.2': ('custom-call __cudnn$fmhaSoftmax',
                                    MODEL + 'layers/attn/dot_product_attention_fwd'),
    'dot_product_attention_fwd.15': (
        'custom-call __cudnn$fmhaSoftmax',
        BACKWARD + 'while/body/eval_jaxpr/checkpoint/rematted_computation/layers/attn/'
        'dot_product_attention_fwd'),
    'dot_product_attention_bwd.8': (
        'custom-call __cudnn$fmhaSoftmaxBackward',
        BACKWARD + 'while/body/eval_jaxpr/checkpoint/layers/attn/dot_product_attention_bwd'),
    'loop_multiply_fusion.3': ('fusion multiply', MODEL + 'layers/attn_norm/mul'),
    'input_reduce_fusion.5': ('fusion reduce', JAX + 'jvp()/reduce_max'),
    'loop_select_fusion.1': ('fusion select', 'jit(train_step)/jit(_where)/select_n'),
    'input_scatter_fusion.2': ('fusion scatter', BACKWARD + 'jit(_take)/scatter-add'),
    'dynamic-update-slice_fusion.4': ('fusion dynamic-update-slice', MODEL + 'while'),
    'all-reduce-start.1': ('all-reduce-start', JAX + 'psum'),
    'all-gather-start.2': ('all-gather-start', 'jit(train_step)/all_gather'),
    'call.4': ('call', ''),  # a command buffer: its kernels are known by their names alone
}
COMPUTE, COPY, NCCL = 14, 20, 30  # CUDA streams
# (stream, start, end, kernel, hlo_op) in ms of one step, and the kind each is expected to be.
KERNELS = [
    (COMPUTE, 0, 100, 'nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN', 'gemm_fusion_dot.1'),
    (COMPUTE, 100, 150, 'sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x128x32_cublas',
     'custom-call.7'),
    (COMPUTE, 150, 200, 'cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7',
     'dot_product_attention_fwd.2'),
    (COMPUTE, 200, 260, 'cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7',
     'dot_product_attention_fwd.15'),
    (COMPUTE, 260, 400, 'cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3',
     'dot_product_attention_bwd.8'),
    (COMPUTE, 400, 430, 'loop_multiply_fusion', 'loop_multiply_fusion.3'),
    (COMPUTE, 430, 450, 'input_reduce_fusion', 'input_reduce_fusion.5'),
    (COMPUTE, 450, 470, 'loop_select_fusion', 'loop_select_fusion.1'),
    (COMPUTE, 470, 480, 'loop_add_fusion', 'call.4'),
    # 480..500: idle
    (COPY, 500, 520, 'memcpy128', 'dynamic-update-slice_fusion.4'),
    (NCCL, 520, 560, 'ncclDevKernel_AllGather_RING_LL', 'all-gather-start.2'),
    (COMPUTE, 560, 600, 'input_scatter_fusion', 'input_scatter_fusion.2'),
    # Overlapped by computation: no exposed time.
    (COPY, 50, 90, 'MemcpyH2D', ''),
    (NCCL, 80, 130, 'ncclDevKernel_AllReduce_Sum_f32_RING_LL', 'all-reduce-start.1'),
]
EXPECTED_MS = {'matmul': 150, 'attention forward': 50, 'recomputation': 60,
               'attention backward': 140, 'elementwise / norm / rope': 70, 'loss': 20,
               'optimizer': 20, 'other': 10, 'copies': 20, 'collectives': 40, 'idle': 20}


def hlo_text() -> str:
  fused, entry = [], []
  for i, (name, (what, op_name)) in enumerate(INSTRUCTIONS.items()):
    metadata = f'metadata={{op_name="{op_name}"}}'
    opcode, _, target = what.partition(' ')
    if opcode == 'fusion':
      fused.append(f'%fused.{i} (p.{i}: f32[8]) -> f32[8] {{\n  %p.{i} = f32[8]{{0}} parameter(0)\n'
                   f'  ROOT %inner.{i} = f32[8]{{0}} {target}(%p.{i})\n}}\n')
      entry.append(f'  %{name} = f32[8]{{0}} fusion(%x), kind=kLoop, calls=%fused.{i}, {metadata}')
    elif opcode == 'custom-call':
      entry.append(f'  %{name} = f32[8]{{0}} custom-call(%x), custom_call_target="{target}", '
                   f'{metadata}')
    else:
      entry.append(f'  %{name} = f32[8]{{0}} {opcode}(%x), {metadata}')
  return ('HloModule jit_train_step, is_scheduled=true\n\n' + '\n'.join(fused) +
          '\nENTRY %main (x: f32[8]) -> f32[8] {\n  %x = f32[8]{0} parameter(0)\n' +
          '\n'.join(entry) + '\n  ROOT %y = f32[8]{0} copy(%x)\n}\n')


def gpu_trace(steps: int) -> dict:
  """jax.profiler's Perfetto JSON as a GPU run writes it: the device's streams, the 'XLA Ops' line
  derived from them, and the host's launch annotations (the last two repeat the kernels)."""
  gpu, host = 1, 2
  events = [{'ph': 'M', 'name': 'process_name', 'pid': gpu, 'args': {'name': '/device:GPU:0'}},
            {'ph': 'M', 'name': 'process_name', 'pid': host, 'args': {'name': '/host:CPU'}},
            {'ph': 'M', 'name': 'thread_name', 'pid': gpu, 'tid': 1, 'args': {'name': 'XLA Ops'}},
            {'ph': 'M', 'name': 'thread_name', 'pid': host, 'tid': 7, 'args': {'name': 'python'}}]
  events += [{'ph': 'M', 'name': 'thread_name', 'pid': gpu, 'tid': stream,
              'args': {'name': f'Stream #{stream}({kind})'}}
             for stream, kind in ((COMPUTE, 'Compute'), (COPY, 'MemcpyD2D'), (NCCL, 'Nccl'))]
  for step in range(steps):
    t0 = step * 600_000
    for stream, start, end, kernel, hlo_op in KERNELS:
      args = {'hlo_module': 'jit_train_step', 'hlo_op': hlo_op} if hlo_op else {}
      for pid, tid in ((gpu, stream), (gpu, 1), (host, 7)):
        events.append({'ph': 'X', 'pid': pid, 'tid': tid, 'ts': t0 + start * 1000,
                       'dur': (end - start) * 1000, 'name': kernel if tid == stream else hlo_op,
                       'args': args})
  return {'displayTimeUnit': 'ns', 'traceEvents': events}


def write_profile(directory, steps: int) -> None:
  trace = os.path.join('plugins', 'profile', '2026_11_27', profile_summary.TRACE)
  os.makedirs(os.path.dirname(os.path.join(directory, trace)))
  with gzip.open(os.path.join(directory, trace), 'wt', encoding='utf-8') as f:
    json.dump(gpu_trace(steps), f)
  with open(os.path.join(directory, profile_summary.PROGRAM), 'w', encoding='utf-8') as f:
    f.write(hlo_text())
  with open(os.path.join(directory, profile_summary.INFO), 'w', encoding='utf-8') as f:
    json.dump({'first_step': 10, 'last_step': 9 + steps, 'trace': trace}, f)


def test_a_gpu_trace_is_summarised_by_kind(tmp_path):
  """Each kernel by its HLO instruction's JAX name (norm vs loss vs optimizer, recomputed vs
  forward vs backward attention), or by its name where the program does not name it; copies and
  collectives only where nothing else runs; the derived and host lines not counted again."""
  write_profile(tmp_path, steps=2)
  s = profile_summary.summarize(str(tmp_path))
  assert s.steps == 2 and s.traced_ms_per_step == pytest.approx(600)
  assert s.ms_per_step == pytest.approx(EXPECTED_MS)
  kernel_ms = sum(end - start for _, start, end, _, _ in KERNELS)
  assert s.by_name_share == pytest.approx((10 + 40) / kernel_ms)  # the command buffer's, H2D
  table = profile_summary.markdown(s)
  assert '| attention backward | 140.0 | 23.3% |' in table and 'by kernel name alone' in table


def test_a_kernel_is_known_by_its_name_where_its_instruction_is_not():
  names = {'nvjet_hsh_128x256_64x4_1x2_h_bz_coopB_TNT': 'matmul',
           'sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64': 'matmul',
           'cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16': 'matmul',
           'cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16': 'attention backward',
           'cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16': 'attention forward',
           'ncclDevKernel_ReduceScatter_Sum_f32_RING_LL': 'collectives',
           'memcpy32': 'copies', 'Memset (Device)': 'copies', 'loop_add_fusion': 'other'}
  for kernel, kind in names.items():
    assert profile_summary.classify(profile_summary.Op(kernel)) == kind, kernel


@pytest.fixture(scope='module')
def profiled_run(tmp_path_factory):
  """The test preset trained 4 steps with full remat, steps 2..3 traced."""
  workdir = tmp_path_factory.mktemp('profiled')
  c = config_lib.preset('test')
  c.train.steps, c.train.eval_every, c.train.sample_prompt = 4, 4, ''
  c.optim.warmup_steps = 1
  c.model.remat = 'full'
  c.train.profile_steps = '2:3'
  pretrain.train_and_evaluate(c, str(workdir), devices=jax.devices()[:1])
  return workdir


def test_profile_steps_writes_a_trace_of_the_train_step_and_its_program(profiled_run):
  profile = os.path.join(profiled_run, 'profile')
  traces = glob.glob(os.path.join(profile, 'plugins', 'profile', '*', '*.xplane.pb'))
  assert traces, os.listdir(profiled_run)
  with open(traces[0], 'rb') as f:
    assert b'jit(train_step)' in f.read()  # the trainer's jitted step, by name
  with gzip.open(os.path.join(os.path.dirname(traces[0]), profile_summary.TRACE), 'rt',
                 encoding='utf-8') as f:  # what ui.perfetto.dev opens
    assert 'train_step' in f.read()
  with open(os.path.join(profile, profile_summary.INFO), encoding='utf-8') as f:
    assert json.load(f)['first_step'] == 2
  with open(os.path.join(profile, profile_summary.PROGRAM), encoding='utf-8') as f:
    assert f.read().startswith('HloModule jit_train_step')


def test_a_cpu_profile_of_the_trainer_adds_up_and_names_every_kind_of_work(profiled_run):
  s = profile_summary.summarize(os.path.join(profiled_run, 'profile'))
  assert s.steps == 2
  assert sum(s.ms_per_step.values()) == pytest.approx(s.traced_ms_per_step)
  for kind in ('matmul', 'attention forward', 'attention backward', 'recomputation',
               'elementwise / norm / rope', 'loss', 'optimizer'):
    assert s.ms_per_step[kind] > 0, (kind, s.ms_per_step)
  assert s.ms_per_step['other'] < 0.02 * s.traced_ms_per_step, s.ms_per_step
  assert s.by_name_share == 0  # every event's instruction is in the program
  out = run_cli('-m', 'jax_pretrain.profile_summary', f'--workdir={profiled_run}')
  assert '| recomputation |' in out and '| traced |' in out
