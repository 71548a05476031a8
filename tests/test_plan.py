"""jax_pretrain.plan and hlo: what the compiled train step does per device, read without running it.

The GPU-target tests compile the real H100 program on this CPU with jax's CUDA plugin
(requirements-gpu.txt, ~5.5 GB). CI does not install it: there they are skipped, with the reason.
"""
import json
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import gpu_targets
from jax_pretrain import hlo
from jax_pretrain import memory
from jax_pretrain import model as model_lib
from jax_pretrain import plan
from jax_pretrain import runtime
from jax_pretrain.grpo import config as grpo_config
from jax_pretrain.grpo import plan as grpo_plan
from tests.conftest import ROOT
from tests.conftest import run_cli
from tests.conftest import subprocess_env

requires_plugin = pytest.mark.skipif(
    gpu_targets.plugin_library() is None,
    reason="jax's CUDA plugin is not installed (pip install -r requirements-gpu.txt): the "
           'deviceless H100 compiles are skipped')


def _compiled_text(fn, *shapes):
  return jax.jit(fn).lower(*shapes).compile().as_text()


def test_hlo_counts_dot_flops_times_loop_trips():
  def five_matmuls(x_MxK, w_KxK):
    return jax.lax.scan(lambda x, _: (jnp.tanh(x @ w_KxK), None), x_MxK, None, length=5)[0]
  text = _compiled_text(five_matmuls, jax.ShapeDtypeStruct((32, 64), jnp.float32),
                        jax.ShapeDtypeStruct((64, 64), jnp.float32))
  stats = hlo.analyze(text)
  assert stats.matmul_flops == 5 * 2 * 32 * 64 * 64
  assert stats.unknown_trip_counts == 0


def test_hlo_counts_a_conditional_by_its_usual_branch_where_the_other_is_rare():
  """A conditional counts as its costliest branch, except one traced under hlo.RARE_BRANCH (FP8's
  first step: state.py), which runs on few steps: then the usual one's FLOPs are counted."""
  def flops(rare: bool, k: int) -> float:
    def first(x_MxK, w_KxK):  # three matmuls
      with jax.named_scope(hlo.RARE_BRANCH if rare else 'first'):
        return jnp.tanh(jnp.tanh(x_MxK @ w_KxK) @ w_KxK) @ w_KxK
    step = lambda p, x_MxK, w_KxK: jax.lax.cond(p, first, lambda x, w: x @ w, x_MxK, w_KxK)
    # (k apart: jax's compilation caches, the tests' persistent one too, key a program without
    # its names, the scope included)
    return hlo.analyze(_compiled_text(step, jax.ShapeDtypeStruct((), jnp.bool_),
                                      jax.ShapeDtypeStruct((32, k), jnp.float32),
                                      jax.ShapeDtypeStruct((k, k), jnp.float32))).matmul_flops
  assert flops(rare=False, k=48) == 3 * 2 * 32 * 48 * 48
  assert flops(rare=True, k=40) == 2 * 32 * 40 * 40


def test_hlo_counts_collectives_in_loops_with_their_group_size():
  mesh = jax.make_mesh((8,), ('d',))
  sharded = jax.sharding.NamedSharding(mesh, jax.P('d'))

  def three_psums(x):
    return jax.lax.scan(lambda c, _: (c + jax.lax.psum(c, 'd'), None), x, None, length=3)[0]
  fn = jax.shard_map(three_psums, mesh=mesh, in_specs=jax.P('d'), out_specs=jax.P('d'))
  stats = hlo.analyze(_compiled_text(fn, jax.ShapeDtypeStruct((64, 4), jnp.float32,
                                                              sharding=sharded)))
  all_reduce = stats.collectives['all-reduce']
  assert all_reduce.count == 3 and all_reduce.bytes == 3 * 8 * 4 * 4  # [8, 4] f32 per device
  assert all_reduce.wire_bytes == pytest.approx(2 * 7 / 8 * all_reduce.bytes)
  assert all_reduce.cross_node_wire_bytes == 0


_KINDS_HLO = """HloModule kinds
%moved (p: bf16[4096,2048]) -> bf16[2048,4096] {
  %p = bf16[4096,2048]{1,0} parameter(0)
  ROOT %t = bf16[2048,4096]{1,0} transpose(%p), dimensions={1,0}
}

ENTRY %main (a, b, c, d) -> (bf16[4096,4096], f32[4096,4096]) {
  %a = bf16[4096,2048]{1,0} parameter(0)
  %b = bf16[2048,4096]{1,0} parameter(1)
  %c = f32[4096,2048]{1,0} parameter(2)
  %d = f32[2048,4096]{1,0} parameter(3)
  %dot.1 = bf16[4096,4096]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %dot.2 = f32[4096,4096]{1,0} dot(%c, %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %copy.1 = bf16[2048,4096]{0,1} copy(%b)
  %fusion.1 = bf16[2048,4096]{1,0} fusion(%a), kind=kLoop, calls=%moved
  %tanh.1 = f32[4096,4096]{1,0} tanh(%dot.2)
  ROOT %out = (bf16[4096,4096]{1,0}, f32[4096,4096]{1,0}) tuple(%dot.1, %tanh.1)
}
"""


def test_hlo_tells_kernels_apart_by_kind_and_the_roofline_adds_them_up():
  """bf16 and float32 (TF32) matmuls, copies (a copy, a fusion that only transposes) and
  elementwise work; the roofline's time by kind adds up to its kernels' time."""
  stats = hlo.analyze(_KINDS_HLO)
  assert {k.name: k.kind for k in stats.kernels} == {
      'dot.1': 'matmul', 'dot.2': 'matmul_f32', 'copy.1': 'copy', 'fusion.1': 'copy',
      'tanh.1': 'elementwise'}
  h100 = gpu_targets.TARGETS['h100']
  r = gpu_targets.roofline(stats, h100)
  assert sum(r.by_kind.values()) == pytest.approx(r.compute_s)
  # float32 matmuls at the TF32 rate: 2.9x the time of the same FLOPs in bf16
  assert r.by_kind['matmul_f32'] == pytest.approx(2 * 4096 * 4096 * 2048 / h100.f32_matmul_flops)
  assert r.by_kind['matmul_f32'] / r.by_kind['matmul'] == pytest.approx(2.89, abs=0.01)
  assert list(plan.kernels_by_kind(stats, r))[0] in r.by_kind


def test_hlo_by_op_sums_a_kind_over_the_model_place_each_kernel_comes_from(tmp_path):
  """scripts/hlo_by_op.py: the same operation in every layer is one line, and the lines add up to
  the kind's bytes as hlo.py counts them."""
  def two_layers(x):
    for i in range(2):
      with jax.named_scope(f'layers_{i}'):
        x = jnp.tanh(x) * 3.0
    return x
  text = _compiled_text(two_layers, jax.ShapeDtypeStruct((256, 256), jnp.float32))
  (tmp_path / 'step.hlo').write_text(text)
  out = subprocess.run([sys.executable, f'{ROOT}/scripts/hlo_by_op.py', str(tmp_path / 'step.hlo'),
                        '--kind=elementwise'], capture_output=True, text=True, check=True,
                       env=subprocess_env()).stdout.splitlines()
  total = sum(k.hbm_bytes * k.times for k in hlo.analyze(text).kernels
              if k.kind == 'elementwise')
  assert out[0] == f'elementwise: {total / 1e9:.1f} GB a step'
  assert not any('layers_0' in line or 'layers_1' in line for line in out)
  assert any('layers_i' in line for line in out[1:]), out


def test_hlo_counts_cublas_fp8_gemms_as_fp8_matmuls():
  """What XLA's GEMM rewriter makes of a scaled FP8 dot for cuBLAS (the scales are operands)."""
  dims = '"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]'
  text = f"""HloModule f8
ENTRY %main (a, b, s, t) -> bf16[4096,1024] {{
  %a = f8e4m3fn[4096,2048]{{1,0}} parameter(0)
  %b = f8e4m3fn[2048,1024]{{1,0}} parameter(1)
  %s = f32[] parameter(2)
  %t = f32[] parameter(3)
  %gemm = (bf16[4096,1024]{{1,0}}, s8[4194304]{{0}}) custom-call(%a, %b, %s, %t), \
custom_call_target="__cublas$lt$matmul$f8", \
backend_config={{"gemm_backend_config":{{"dot_dimension_numbers":{{{dims}}}}}}}
  ROOT %out = bf16[4096,1024]{{1,0}} get-tuple-element(%gemm), index=0
}}
"""
  stats = hlo.analyze(text)
  assert stats.fp8_matmuls == 1
  assert stats.fp8_matmul_flops == stats.matmul_flops == 2 * 4096 * 2048 * 1024
  assert [k.kind for k in stats.kernels] == ['matmul_fp8']


@pytest.mark.parametrize('groups, size, spans', [
    ("replica_groups=mesh['data'=2,'fsdp'=8,'tensor'=1] {'fsdp'}", 8, False),
    ("replica_groups=mesh['data'=2,'fsdp'=8,'tensor'=1] {'data'}", 2, True),
    ('replica_groups=[2,8]<=[16]', 8, False),
    ('replica_groups=[8,2]<=[2,8]T(1,0)', 2, True),
    ('replica_groups={{0,1,2,3},{4,5,6,7}}', 4, False),
])
def test_replica_groups_in_each_printed_form(groups, size, spans):
  instruction = hlo.Instruction('ar', 'f32[4]', 'all-reduce', ['x'], '%x', f', {groups}, x=1')
  assert hlo.group_size_and_span(instruction, devices_per_node=8) == (size, spans)


def test_micro_batch_search_finds_the_largest_fitting_in_few_compiles():
  compiled = []

  def measure(m):  # 10 GiB of state, 1.5 GiB per sequence; from 48 on, XLA recomputes 10% more
    compiled.append(m)
    return (10 + 1.5 * m) * memory.GIB, 1e9 * (1.1 if m >= 48 else 1.0)

  assert memory.micro_batch_candidates(96) == [1, 2, 4, 8, 16, 32, 96]
  chosen, tried = memory.search_micro_batch(memory.micro_batch_candidates(256), measure,
                                            60 * memory.GIB)
  assert chosen == 32 and compiled == [1, 256, 32] and set(tried) == {1, 32, 256}
  assert memory.search_micro_batch([1, 2, 4], measure, 11 * memory.GIB)[0] is None  # not even one
  assert memory.search_micro_batch([1, 2, 4], measure, 99 * memory.GIB)[0] == 4
  # 96 fits the memory but recomputes 10% more: 32 is faster.
  assert memory.search_micro_batch([1, 2, 32, 96], measure, 999 * memory.GIB)[0] == 32


def test_layout_candidates_prefer_less_sharding_then_less_recompute():
  both = memory.layout_candidates(8, 2560, 1, 'dots', fsdp_auto=True, remat_auto=True)
  assert both == [(1, 'dots', 'unroll'), (1, 'full', 'unroll'), (2, 'dots', 'unroll'),
                  (2, 'full', 'unroll'), (4, 'dots', 'unroll'), (4, 'full', 'unroll'),
                  (8, 'dots', 'unroll'), (8, 'full', 'unroll')]
  # fsdp divides the data-parallel devices and d_model: powers of two, and all of them.
  assert [x[0] for x in memory.layout_candidates(6, 12, 1, 'full', True, True)] == [1, 2, 6]
  assert [x[0] for x in memory.layout_candidates(8, 68, 1, 'full', True, True)] == [1, 2, 4]
  # An explicit value is the only one; 'auto' that resolved to 'full' has nothing to add.
  assert _pairs(memory.layout_candidates(8, 2560, 2, 'dots', False, True)) == [
      (2, 'dots'), (2, 'full')]
  assert _pairs(memory.layout_candidates(8, 2560, 1, 'dots', True, False)) == [
      (1, 'dots'), (2, 'dots'), (4, 'dots'), (8, 'dots')]
  assert _pairs(memory.layout_candidates(8, 2560, 1, 'full', False, True)) == [(1, 'full')]
  # The layers as given (the fit asks again with 'scan' where nothing unrolled fits).
  assert {x[2] for x in memory.layout_candidates(8, 2560, 1, 'dots', True, True, 'scan')} == {
      'scan'}


def _pairs(layouts):
  """(fsdp, remat) of each (fsdp, remat, layers) layout."""
  return [x[:2] for x in layouts]


def _fake_search(table):
  """A layout search over {layout: (micro-batch or None, tokens/s)}, recording the order."""
  searched = []

  def search(layout):
    searched.append(layout[:2])
    micro_batch, tokens_per_s = table.get(layout[:2], (None, None))
    return micro_batch, (1 / tokens_per_s if micro_batch else None)
  return search, searched


def test_layout_search_keeps_what_fits_and_otherwise_ranks_by_the_roofline():
  layouts = memory.layout_candidates(2, 2560, 1, 'dots', True, True)
  pairs = _pairs(layouts)
  # xxlarge on 2 × A100 40 GB: data parallelism fits no sequence, with either remat.
  table = {(2, 'dots'): (1, 10_512), (2, 'full'): (8, 17_539)}
  search, searched = _fake_search(table)
  chosen, results = memory.search_layouts(layouts, search, per_device=128, ranked=True)
  assert chosen[:2] == (2, 'full') and searched == pairs
  assert results[(1, 'full', 'unroll')] == (None, None)
  assert results[(2, 'dots', 'unroll')][0] == 1
  # Without a roofline: the first that fits, less sharding first, then less recompute.
  search, searched = _fake_search(table)
  assert memory.search_layouts(layouts, search, 128, ranked=False)[0][:2] == (2, 'dots')
  assert searched == pairs[:3]
  # What fits as resolved is kept, even where another layout would be faster.
  search, searched = _fake_search({**table, (1, 'dots'): (1, 5_000)})
  assert memory.search_layouts(layouts, search, 128, ranked=True)[0][:2] == (1, 'dots')
  assert searched == [(1, 'dots')]
  # Nothing fits: None, and everything was tried.
  search, searched = _fake_search({})
  chosen, results = memory.search_layouts(layouts, search, 128, ranked=True)
  assert chosen is None and list(results) == layouts and searched == pairs


def test_layout_search_skips_layouts_that_cannot_be_faster(monkeypatch):
  monkeypatch.setattr(memory, 'MAX_FITTING_LAYOUTS', 99)
  layouts = memory.layout_candidates(16, 2560, 1, 'dots', True, True)
  pairs = _pairs(layouts)
  # (2, dots) fits the whole batch: every layout of more sharding and recompute is no faster.
  search, searched = _fake_search({(2, 'dots'): (8, 100), (4, 'dots'): (8, 90),
                                   (1, 'full'): (2, 50)})
  assert memory.search_layouts(layouts, search, per_device=8, ranked=True)[0][:2] == (2, 'dots')
  assert searched == [(1, 'dots'), (1, 'full'), (2, 'dots')]
  # full got slower from fsdp 1 to 2: not tried at 4; dots improved from 2 to 4, not to 8.
  search, searched = _fake_search({(1, 'full'): (1, 50), (2, 'full'): (2, 40),
                                   (2, 'dots'): (1, 60), (4, 'dots'): (2, 80),
                                   (8, 'dots'): (4, 70), (16, 'dots'): (8, 200)})
  assert memory.search_layouts(layouts, search, per_device=8, ranked=True)[0][:2] == (4, 'dots')
  assert searched == [(1, 'dots'), (1, 'full'), (2, 'dots'), (2, 'full'), (4, 'dots'),
                      (8, 'dots')]
  # At most MAX_FITTING_LAYOUTS that fit are compared.
  monkeypatch.setattr(memory, 'MAX_FITTING_LAYOUTS', 4)
  search, searched = _fake_search({layout: (1, 10 + i) for i, layout in enumerate(pairs[1:])})
  chosen, results = memory.search_layouts(layouts, search, per_device=8, ranked=True)
  assert sum(m is not None for m, _ in results.values()) == memory.MAX_FITTING_LAYOUTS
  assert chosen[:2] == searched[-1]


@pytest.mark.parametrize('fsdp, remat, layers, micro_batch', [
    (2, 'dots', 'scan', 1), (4, 'full', 'unroll', 2), (1, 'full', 'scan', 4)])
def test_a_fitted_layout_is_what_resolving_with_it_gives(fsdp, remat, layers, micro_batch):
  """The fit re-derives the resolved config for each layout (mesh.fsdp, model.remat) instead of
  resolving again, and must agree with resolving those values given explicitly."""
  c = config_lib.preset('test')
  c.model.remat = 'auto'
  resolved, run = config_lib.resolve(c, 4, backend='cpu')  # fsdp 0: 1; remat auto: full (xla)
  assert run.mesh_shape == (4, 1, 1) and resolved.model.remat == 'full'
  fitted, fitted_run = memory.with_micro_batch(c, *memory.with_layout(resolved, run,
                                                                       (fsdp, remat, layers)),
                                               micro_batch)
  c.mesh.fsdp, c.train.micro_batch_size = fsdp, micro_batch
  c.model.remat = 'auto' if remat == 'full' else remat
  c.model.layers = 'auto' if layers == 'scan' else layers  # (the CPU's auto: scan)
  expected, expected_run = config_lib.resolve(c, 4, backend='cpu')
  assert fitted == expected and fitted_run == expected_run
  assert fitted_run.mesh_shape == (4 // fsdp, fsdp, 1)


class _FakeDevice:
  """A GPU as the fit reads it (the compiles are faked)."""
  platform, process_index = 'gpu', 0
  client = types.SimpleNamespace(process_index=lambda: 0)

  def __init__(self, kind: str = 'NVIDIA A100-SXM4-40GB'):
    self.device_kind = kind

  def memory_stats(self):
    return {'bytes_limit': 0.9 * 40 * memory.GIB}


def _fake_compiles(monkeypatch, state_gib=40.0, per_sequence_gib=None, scan_saves_gib=0.0):
  """memory.fit_micro_batch's compiles replaced by a model: a peak of the state over fsdp plus
  each sequence's activations by remat, less scan_saves_gib with the layers scanned; a roofline
  of 1 s a step plus 1 s per micro-batch (an FSDP gather each), 0.3 s more with full remat and
  0.5 s more scanned. Returns the list of what was compiled: (fsdp, remat, micro-batch), and
  'scan' after them where the layers were scanned."""
  per_sequence_gib = per_sequence_gib or {'dots': 10.0, 'full': 1.5}
  compiled = []

  def compile_step(c, run, devices, autotune=True, batch=None, loss=None):
    layout = (c.mesh.fsdp, c.model.remat, c.train.micro_batch_size)
    scanned = c.model.layers == 'scan'
    compiled.append(layout + (('scan',) if scanned else ()))
    peak = (state_gib / c.mesh.fsdp + per_sequence_gib[c.model.remat] * layout[2]
            - scan_saves_gib * scanned) * memory.GIB
    text = json.dumps([*layout, run.grad_accum_steps, scanned])
    analysis = types.SimpleNamespace(argument_size_in_bytes=peak, output_size_in_bytes=0,
                                     alias_size_in_bytes=0, temp_size_in_bytes=0)
    return (types.SimpleNamespace(run=run),
            types.SimpleNamespace(memory_analysis=lambda: analysis, as_text=lambda: text))

  def roofline(stats, target):
    fsdp, remat, _, accum, scanned = stats.layout
    step = 1 + (accum if fsdp > 1 else 0) + (0.3 if remat == 'full' else 0) + 0.5 * scanned
    return gpu_targets.Roofline(step, 0.0)

  monkeypatch.setattr(memory, 'compile_step', compile_step)
  monkeypatch.setattr(hlo, 'analyze', lambda text, *_: types.SimpleNamespace(
      flops=1e12, layout=json.loads(text)))
  monkeypatch.setattr(gpu_targets, 'roofline', roofline)
  return compiled


def _gpu_preset():
  """The test preset as on a GPU: bfloat16, remat automatic ('dots': attention cudnn)."""
  c = config_lib.preset('test')  # batch 16: 8 sequences a device on 2
  c.model.dtype, c.model.remat = 'bfloat16', 'auto'
  return c


def _fit(c, devices=2, target='a100-40'):
  resolved, run = config_lib.resolve(c, devices, backend='gpu')
  return memory.fit_micro_batch(c, resolved, run, [_FakeDevice()] * devices,
                                gpu_targets.TARGETS[target] if target else None)


def test_the_fit_chooses_fsdp_and_remat_where_data_parallelism_does_not_fit(monkeypatch):
  """CPU, the compiles faked: 2 A100 40 GB, a state of 40 GiB: only fsdp=2 fits; with full remat
  8 sequences a device (no accumulation), faster than dots' 1 × 8."""
  compiled = _fake_compiles(monkeypatch)
  resolved, run, lines = _fit(_gpu_preset())
  assert (resolved.mesh.data, resolved.mesh.fsdp, resolved.model.remat) == (1, 2, 'full')
  assert run.mesh_shape == (1, 2, 1) and run.grad_accum_steps == 1
  assert resolved.train.micro_batch_size == 8 and resolved.train.eval_batch_size == 16
  assert not any(x.startswith('remat ') for x in run.choices)  # the resolve's 'dots' is gone
  mesh_line, micro_line = lines
  assert mesh_line.startswith('mesh data=1 fsdp=2, remat full (auto: data parallelism with remat '
                              'dots does not fit 95% of 35.5 GiB even with one sequence per '
                              'device (1 -> 50.0 GiB); the fastest by the a100-40 roofline')
  assert 'fsdp 1 full does not fit (1 -> 41.5 GiB); fsdp 2 dots -> micro-batch 1' in mesh_line
  assert 'fsdp 2 full -> micro-batch 8' in mesh_line
  assert micro_line.startswith('micro-batch 8 (auto: the largest within 95% of 35.5 GiB')
  assert compiled[:2] == [(1, 'dots', 1), (1, 'full', 1)] and len(compiled) <= 7


def test_the_fit_never_replaces_an_explicit_fsdp_or_remat(monkeypatch):
  _fake_compiles(monkeypatch)
  c = _gpu_preset()
  c.model.remat = 'dots'  # fsdp automatic: only the sharding is searched
  resolved, run, lines = _fit(c)
  assert (resolved.mesh.fsdp, resolved.model.remat, resolved.train.micro_batch_size) == (
      2, 'dots', 1)
  assert 'fsdp 2 dots -> micro-batch 1' in lines[0] and 'full' not in lines[0]
  c = _gpu_preset()
  c.mesh.fsdp, c.model.layers = 1, 'unroll'  # remat automatic: full is tried, does not fit
  with pytest.raises(config_lib.ConfigError) as e:
    _fit(c)
  assert str(e.value) == (
      'the train step does not fit 95% of the 35.5 GiB per device even with one sequence per '
      'device (compiled: fsdp 1 dots: 1 -> 50.0 GiB; fsdp 1 full: 1 -> 41.5 GiB): shard the '
      'state (--config.mesh.fsdp), or scan the layers (--config.model.layers=scan).')
  c.model.remat, c.model.layers = 'dots', 'scan'  # all explicit: no layout searched
  with pytest.raises(config_lib.ConfigError, match=r'\(compiled: 1 -> 50.0 GiB\): shard the state '
                     r'\(--config.mesh.fsdp\), or set --config.model.remat=full \(now dots\)\.$'):
    _fit(c)
  c.model.layers = 'auto'  # scanned after unrolled: both listed
  with pytest.raises(config_lib.ConfigError, match=r'\(compiled: fsdp 1 dots: 1 -> 50.0 GiB; '
                     r'fsdp 1 dots scanned: 1 -> 50.0 GiB\): shard the state'):
    _fit(c)


def test_the_fit_without_a_roofline_takes_the_first_layout_that_fits(monkeypatch):
  compiled = _fake_compiles(monkeypatch)
  c = _gpu_preset()
  resolved, run = config_lib.resolve(c, 2, backend='gpu')
  resolved, run, lines = memory.fit_micro_batch(c, resolved, run, [_FakeDevice('NVIDIA H100 '
                                                                               'PCIe')] * 2)
  assert (resolved.mesh.fsdp, resolved.model.remat) == (2, 'dots')
  assert 'no roofline for NVIDIA H100 PCIe (not in gpu_targets): the first that fits' in lines[0]
  assert {x[:2] for x in compiled} == {(1, 'dots'), (1, 'full'), (2, 'dots')}


def test_nothing_fits_anywhere_lists_every_layout_tried(monkeypatch):
  _fake_compiles(monkeypatch, state_gib=100.0)
  with pytest.raises(config_lib.ConfigError, match=r'compiled: fsdp 1 dots: 1 -> 110.0 GiB; '
                     r'fsdp 1 full: .*; fsdp 2 full: 1 -> 51.5 GiB; fsdp 1 dots scanned: 1 -> '
                     r'110.0 GiB; .*; fsdp 2 full scanned: 1 -> 51.5 GiB\): shard the state over '
                     r'more devices \(mesh.fsdp\), or split the layers too '
                     r'\(--config.mesh.tensor\)\.$'):
    _fit(_gpu_preset())


def test_the_fit_scans_the_layers_only_where_no_unrolled_layout_fits(monkeypatch):
  """model.layers 'auto' (unrolled on a GPU): xxlarge on 2 × A100 40GB, modelled: no unrolled
  layout fits one sequence; scanned, fsdp 2 with full remat fits 8. Where an unrolled layout
  fits, it is kept, though scanning would fit more sequences."""
  compiled = _fake_compiles(monkeypatch, state_gib=66.0, scan_saves_gib=12.0)
  resolved, run, lines = _fit(_gpu_preset())
  assert (resolved.mesh.fsdp, resolved.model.remat, resolved.model.layers) == (2, 'full', 'scan')
  assert resolved.train.micro_batch_size == 8
  assert not any(x.startswith(('layers ', 'remat ')) for x in run.choices)  # the resolve's
  layout_line, micro_line = lines
  assert layout_line.startswith('mesh data=1 fsdp=2, remat full, layers scan (auto: data '
                                'parallelism with remat dots does not fit 95% of 35.5 GiB even '
                                'with one sequence per device (1 -> 76.0 GiB); no layout fits '
                                'with the layers unrolled, so scanned: the fastest by the '
                                'a100-40 roofline')
  assert 'fsdp 2 full does not fit (1 -> 34.5 GiB)' in layout_line
  assert 'fsdp 2 full scanned -> micro-batch 8' in layout_line
  assert micro_line.startswith('micro-batch 8 (auto:')
  assert [x for x in compiled if x[-1] != 'scan'] == [(1, 'dots', 1), (1, 'full', 1),
                                                      (2, 'dots', 1), (2, 'full', 1)]
  # An unrolled layout fits (fsdp 2, full, 1 sequence): kept, no scanned step compiled.
  compiled = _fake_compiles(monkeypatch, state_gib=64.0, scan_saves_gib=12.0)
  resolved, run, lines = _fit(_gpu_preset())
  assert (resolved.mesh.fsdp, resolved.model.layers, resolved.train.micro_batch_size) == (
      2, 'unroll', 1)
  assert 'layers' not in lines[0] and not any(x[-1] == 'scan' for x in compiled)
  # Given explicitly, the layers are never changed.
  c = _gpu_preset()
  c.model.layers = 'unroll'
  _fake_compiles(monkeypatch, state_gib=66.0, scan_saves_gib=12.0)
  with pytest.raises(config_lib.ConfigError, match=r'34.5 GiB\): scan the layers '
                     r'\(--config.model.layers=scan\)\.$'):
    _fit(c)


def test_on_one_device_the_fit_changes_only_the_remat(monkeypatch):
  _fake_compiles(monkeypatch, state_gib=20.0, per_sequence_gib={'dots': 20.0, 'full': 1.5})
  resolved, run, lines = _fit(_gpu_preset(), devices=1)
  assert run.mesh_shape == (1, 1, 1) and resolved.model.remat == 'full'
  assert lines[0].startswith('remat full (auto: data parallelism with remat dots does not fit')
  assert lines[0].endswith('fsdp 1 full -> micro-batch 8, 394 tokens/s)')  # 16 × 32 in 1.3 s


def test_user_xla_flags_win_over_the_defaults():
  merged = runtime.merge_xla_flags(
      '--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=x')
  assert '--xla_gpu_enable_latency_hiding_scheduler=false' in merged.split()
  assert '--xla_gpu_enable_latency_hiding_scheduler=true' not in merged.split()
  assert '--xla_gpu_enable_pipelined_all_gather=true' in merged.split()
  assert runtime.merge_xla_flags('') == ' '.join(runtime.GPU_XLA_FLAGS)


def test_cpu_plan_of_data_parallel_step_reduces_gradients_once():
  c = config_lib.preset('test')
  c.mesh.data = 8
  r = plan.plan(c, target='cpu', num_devices=8)
  n = r['params']
  for key in ('target', 'num_devices', 'attention', 'remat', 'micro_batch_size', 'peak_memory_gib',
              'device_memory_gib', 'fits', 'compute_flops_per_step', 'model_flops_per_step',
              'collective_bytes_per_step'):
    assert key in r, key
  assert (r['target'], r['num_devices'], r['attention'], r['remat']) == ('cpu', 8, 'xla', 'none')
  assert r['collective_bytes_per_step']['all-reduce'] == 4 * n + 8  # float32 grads, loss, count
  assert r['fits'] and r['tokens_per_s'] is None  # no roofline for the CPU
  resolved, run = config_lib.resolve(c, num_devices=8, backend='cpu')
  per_token = model_lib.flops_per_token(resolved.model, c.data.seq_len)
  assert r['model_flops_per_step'] == pytest.approx(per_token * run.tokens_per_step / 8)


def test_plan_cli_prints_json_and_config_errors_as_one_line():
  r = json.loads(run_cli('-m', 'jax_pretrain.plan', '--config=configs/test.py', '--target=cpu',
                         '--num_devices=2', '--json'))
  assert r['num_devices'] == 2 and r['mesh'] == {'data': 2, 'fsdp': 1, 'tensor': 1}
  out = subprocess.run([sys.executable, '-m', 'jax_pretrain.plan', '--config=configs/test.py',
                        '--target=cpu', '--config.mesh.tensor=3', '--num_devices=3'],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 1
  assert out.stderr.strip().splitlines() == [
      'error: mesh.tensor=3 must divide model.num_heads=4 and model.num_kv_heads=2.']


def test_plan_main_imported_plans_as_the_command_does():
  """plan.main called from Python, as `python -m jax_pretrain.plan` calls it once its flags are
  read (in a fresh interpreter: main sets jax's CPU devices), prints the plan."""
  code = ('from jax_pretrain import config, plan; '
          'plan.main(config.preset("test"), "cpu", 2, as_json=True)')
  r = json.loads(run_cli('-c', code))
  assert (r['target'], r['num_devices']) == ('cpu', 2)
  assert r['mesh'] == {'data': 2, 'fsdp': 1, 'tensor': 1}
  assert r['tokens_per_step'] == 16 * 32  # configs/test.py: 16 sequences of 32 tokens a step


def test_a_gpu_target_without_the_plugin_says_what_to_install(monkeypatch):
  monkeypatch.setattr(gpu_targets, 'plugin_library', lambda: None)
  with pytest.raises(plan.PlanError, match=r'pip install -r requirements-gpu.txt'):
    plan.devices_for(gpu_targets.TARGETS['h100'], 1)


@requires_plugin
@pytest.mark.parametrize('target', ['h100', 'a100-80', 'a100-40'])
def test_shipped_target_descriptions_are_the_plugins(target):
  t = gpu_targets.TARGETS[target]
  ours = ''.join(line for line in t.config_text().splitlines(keepends=True)
                 if not line.startswith('#') and line.strip())
  theirs = ''.join(line for line in gpu_targets.from_plugin(t.device_kind).splitlines(
      keepends=True) if not line.startswith('#') and line.strip())
  assert ours == theirs


@requires_plugin
def test_xlarge_defaults_on_one_h100_are_cudnn_dots_and_fit():
  r = plan.plan(config_lib.preset('xlarge'), target='h100', num_devices=1)
  assert (r['attention'], r['remat'], r['micro_batch_size']) == ('cudnn', 'dots', 8)
  assert r['fits'] and 40 < r['peak_memory_gib'] < 0.95 * r['usable_memory_gib']
  # 'dots' recomputes no matmul of the layers: compiled matmul FLOPs are the model's 6·N·tokens,
  # and 2·D·V a token more: the output head's logits, recomputed chunk by chunk in the backward.
  tokens = 256 * 2048
  assert r['matmul_flops_per_step'] == pytest.approx(
      (6 * 1_478_492_160 + 2 * 1920 * 32768) * tokens, rel=1e-3)
  kinds = r['kernels_by_kind']
  # No float32 (TF32) GEMM: the head's run on bf16 operands (kernels/logprobs.py) ...
  assert 'matmul_f32' not in kinds and kinds['matmul']['flops'] == r['matmul_flops_per_step']
  # ... and cuDNN's forward runs once per layer and micro-batch: 'dots' keeps its output.
  assert kinds['attention']['launches'] == kinds['attention_backward']['launches'] == 32 * 32
  assert not any(r['collective_bytes_per_step'].values())


@requires_plugin
def test_xlarge_data8_all_reduces_gradients_once_per_step_on_h100():
  c = config_lib.preset('xlarge')
  c.train.micro_batch_size = 8  # 4 micro-batches per step on each of 8 GPUs
  r = plan.plan(c, target='h100', num_devices=8)
  assert r['grad_accum_steps'] == 4 and r['mesh']['data'] == 8
  collectives = {k: v for k, v in r['collective_bytes_per_step'].items() if v}
  assert list(collectives) == ['all-reduce']
  assert collectives['all-reduce'] <= 1.1 * 4 * r['params']
  # 'dots' recomputes no matmul but the head's logits (1.4%); attention's forward runs once
  np.testing.assert_allclose(r['flops_ratio'], 1.026, atol=0.005)


@requires_plugin
def test_xxlarge_on_two_a100_40gb_chooses_fsdp_full_remat_and_scanned_layers_and_says_why():
  """Issues 19 and 45's case: data parallelism does not fit one sequence per card with either
  remat, nor does fsdp=2 with the layers unrolled (an unrolled step holds more at once: 40.4 GiB
  at one sequence with full remat); scanned, the fit shards the state (fsdp=2) and, by the
  roofline, prefers full remat's 8 sequences a card to dots' 1 (a weight gather per
  micro-batch)."""
  r = plan.plan(config_lib.preset('xxlarge'), target='a100-40', num_devices=2)
  assert r['mesh'] == {'data': 1, 'fsdp': 2, 'tensor': 1} and r['remat'] == 'full'
  assert r['layers'] == 'scan'
  assert r['micro_batch_size'] >= 8 and r['grad_accum_steps'] == 128 // r['micro_batch_size']
  assert r['fits'] and r['peak_memory_gib'] < 0.95 * r['usable_memory_gib']
  mesh = [x for x in r['choices'] if x.startswith('mesh ')]
  assert len(mesh) == 1 and mesh[0].startswith('mesh data=1 fsdp=2, remat full, layers scan '
                                               '(auto: data parallelism with remat dots does '
                                               'not fit')
  assert 'no layout fits with the layers unrolled, so scanned: the fastest by the a100-40 ' \
      'roofline' in mesh[0]
  assert 'fsdp 2 full does not fit' in mesh[0] and 'fsdp 2 dots scanned -> micro-batch ' in mesh[0]
  assert not any(x.startswith(('remat ', 'layers ')) for x in r['choices'])  # the resolve's
  assert r['tokens_per_s'] > 15_000


@pytest.mark.parametrize('micro_batch, eval_batch_size', [(1, 0), (2, 0), (4, 0), (2, 24)])
def test_a_fitted_micro_batch_is_what_resolving_with_it_gives(micro_batch, eval_batch_size):
  """The trainer resolves once; the micro-batch fit re-derives the resolved config for each
  candidate instead of resolving again, and must agree with resolve field by field."""
  c = config_lib.preset('test')
  c.train.batch_size, c.train.eval_batch_size = 16, eval_batch_size
  resolved, run = config_lib.resolve(c, 4, backend='cpu')  # data=4: 4 sequences per device
  assert resolved.train.micro_batch_size == 4 and run.grad_accum_steps == 1
  fitted, fitted_run = memory.with_micro_batch(c, resolved, run, micro_batch)
  c.train.micro_batch_size = micro_batch
  expected, expected_run = config_lib.resolve(c, 4, backend='cpu')
  assert fitted == expected and fitted_run == expected_run
  assert fitted_run.grad_accum_steps == 4 // micro_batch


def _grpo_test_config(beta: float = 0.0, num_iterations: int = 1):
  c = grpo_config.with_group(config_lib.preset('test'))
  c.mesh.data = 2
  c.train.batch_size = 16  # 4 prompts × 4 completions
  c.grpo.num_samples, c.grpo.max_new_tokens, c.grpo.rollout_slots = 4, 8, 8
  c.grpo.beta, c.grpo.num_iterations = beta, num_iterations
  return c


@pytest.mark.parametrize('beta, num_iterations', [(0.0, 1), (0.04, 1), (0.0, 2), (0.04, 2)])
def test_cpu_grpo_plan_counts_the_engine_cache_beside_the_update(beta, num_iterations):
  r = grpo_plan.plan(_grpo_test_config(beta, num_iterations), target='cpu', num_devices=2,
                     prompt_tokens=10)
  g, update, prefill, decode = r['grpo'], r['update'], r['prefill'], r['decode']
  # 10 + 8 tokens, of which the model's inputs are all but the last: 17, rounded up to 24 (cuDNN
  # trains on no odd length), and the last target.
  assert g['width'] == 25 and update['tokens_per_step'] == 16 * 25
  # The engine's cache, logits (float32) and token counts (int32, the penalties'), split over the
  # 2 devices: 4 slots each of the context the rollout reaches (10 + 8 tokens, not data.seq_len).
  m = config_lib.resolve(_grpo_test_config(), 2, backend='cpu')[0].model
  cache = (2 * m.num_layers * 4 * 18 * m.num_kv_heads * m.head_dim * 4
           + 4 * m.vocab_size * (4 + 4))
  assert (g['context'], g['slots_per_device']) == (18, 4)
  assert g['engine_cache_gib'] * memory.GIB == cache
  reference = {'reference params': g['params_gib']} if beta else {}
  assert update['alongside_gib'] == {'engine cache': g['engine_cache_gib'], **reference}
  assert update['total_memory_gib'] == pytest.approx(
      update['peak_memory_gib'] + g['engine_cache_gib'] + (g['params_gib'] if beta else 0))
  # Prompts of 10 tokens pad to 16; each device takes the 4 completions of one prompt, run once
  # into one slot and copied into 3 more (the bucket: 4); the decode reads the 18 positions of
  # the context.
  assert (prefill['rows'], prefill['length'], prefill['copies']) == (1, 16, 4)
  assert (decode['rows'], decode['steps']) == (4, 16)
  assert decode['live'] == 18
  for call in (prefill, decode):
    assert call['argument_gib'] >= g['engine_cache_gib'] + g['engine_params_gib']
    assert set(call['alongside_gib']) == {'train state', *reference}
    assert call['fits'] and call['call_s'] is None  # no roofline for the CPU
  # 16 completions in waves of 8 slots, 8 new tokens in one call (of up to 16 steps).
  assert (r['rollout']['decode_calls'], r['rollout']['prefill_calls']) == (2, 2)
  assert r['rollout']['prompts_prefilled'] == 4  # once each, not once a completion
  assert update['fits'] and r['rollout']['rollout_s'] is None
  # The scoring passes: logp_ref with beta > 0, logp_old with num_iterations > 1, each a forward
  # of the 16 rows; the params it scores are its argument, and beside it the engine's cache and
  # the rest: the train state (beta > 0: it scores the reference) or the train state less the
  # params (one copy of each params counted).
  scorings = int(beta > 0) + int(num_iterations > 1)
  assert r['rollout']['updates_per_step'] == num_iterations
  if not scorings:
    assert r['score'] is None and r['rollout']['scoring_s'] == 0.0
  else:
    score, state = r['score'], prefill['alongside_gib']['train state']
    assert score['calls_per_step'] == scorings and score['fits']
    assert score['argument_gib'] >= g['params_gib']
    assert score['alongside_gib'] == pytest.approx(
        {'train state': state, 'engine cache': g['engine_cache_gib']} if beta else
        {'train state less params': state - g['params_gib'], 'engine cache': g['engine_cache_gib']})
    assert r['rollout']['scoring_s'] is None  # no roofline for the CPU


def test_the_engines_lowered_calls_are_the_ones_it_runs():
  """Engine.lower_prefill and lower_decode take abstract params and cache (the plan has no
  arrays) and lower the programs that the engine's calls on real arrays lower."""
  from jax_pretrain import engine as engine_lib  # noqa: PLC0415
  from jax_pretrain import state as state_lib  # noqa: PLC0415
  from jax_pretrain.engine import runner as runner_lib  # noqa: PLC0415
  from jax_pretrain.engine import scheduler as scheduler_lib  # noqa: PLC0415
  resolved, run = config_lib.resolve(_grpo_test_config(), 2, backend='cpu')
  s = state_lib.build(resolved, run, jax.devices()[:2])
  params = state_lib.init_state(s).params
  vocabulary = types.SimpleNamespace(vocab_size=resolved.model.vocab_size, pad_id=0, eos_id=1)
  make = lambda p: engine_lib.Engine(resolved.model, p, vocabulary, slots=8,
                                     context=32, mesh=s.mesh)
  eng, abstract = make(params), make(s.abstract_state.params)
  # What ModelRunner.prefill and decode pass (the params, cache and logits as the runner holds
  # them, the host arrays as warmup and step make them).
  r = eng.runner
  prefill, decode = runner_lib._prefill, runner_lib._decode  # noqa: SLF001
  state, (allowed, eos) = r.state(), r.constants()
  admitted = r.placed(
      scheduler_lib.Prefill(scheduler_lib.PrefillShape(rows=2, length=16, copies=0), ((), ())))
  real = prefill.lower(eng.params, state, admitted, allowed, model=eng.model, mesh=eng.mesh)
  assert abstract.lower_prefill(2, 16).as_text() == real.as_text()
  steps, top = (jax.device_put(x, r._replicated) for x in (np.int32(3), np.bool_(True)))  # noqa: SLF001
  call = scheduler_lib.Decode(scheduler_lib.DecodeShape(rows=4, live=24), steps=3, top_n=0,
                              local_slots=r.local_slots, busy=())
  real = decode.lower(eng.params, state, allowed, eos, steps, top, r.masks(call),
                      model=eng.model, mesh=eng.mesh, rows=4, chunk=eng.chunk, live=24)
  assert abstract.lower_decode(4, 24).as_text() == real.as_text()


def test_grpo_plan_cli_prints_the_update_and_the_rollout():
  out = run_cli('-m', 'jax_pretrain.plan', '--config=configs/grpo.py:test', '--target=cpu',
                '--num_devices=2', '--grpo', '--grpo_prompt_tokens=10',
                '--config.train.batch_size=16', '--config.grpo.num_samples=4',
                '--config.grpo.max_new_tokens=8')
  lines = {line.split()[0]: line for line in out.splitlines()}
  assert 'grpo' in lines and 'update' in lines and 'rows of 25 tokens' in lines['update']
  assert 'engine cache' in lines['memory'] and lines['memory'].endswith('fits')
  assert '16 slots × 18 tokens over 2 devices (8 each)' in lines['rollout']
  # 4 prompts × 4 completions, one wave: each device runs 2 prompts and copies them into 6 slots.
  assert lines['prefill'].startswith('prefill      2 prompts × 16 tokens a device and their keys '
                                     'and values into 8 more slots (the largest call; 1 a step, 4 '
                                     'prompts run once for 16 completions')
  assert lines['decode'].startswith('decode       8 slots a device × 16 steps over 18 positions')


@requires_plugin
def test_xlarge_grpo_on_one_h100_at_64_slots_decodes_in_place_near_the_bandwidth_bound():
  """Issue 24's case on one H100: 128 completions of 512 + 512 tokens, 64 slots."""
  c = grpo_config.with_group(config_lib.preset('xlarge'))
  c.train.batch_size, c.grpo.num_samples, c.grpo.max_new_tokens = 128, 16, 512
  c.grpo.rollout_slots = 64
  r = grpo_plan.plan(c, target='h100', num_devices=1, prompt_tokens=512)
  decode, rollout = r['decode'], r['rollout']
  assert decode['live'] == 1024 and decode['temp_gib'] < 1  # the cache is written in place
  assert decode['tokens_per_s'] > 9000  # roofline at the longest live window
  assert all(r[k]['fits'] for k in ('update', 'prefill', 'decode'))
  # The micro-batch was fitted with the engine's cache beside the update.
  assert any('held beside the step' in choice for choice in r['update']['choices'])
  assert rollout['bytes_per_token'] < 1.5 * rollout['ideal_bytes_per_token']


@requires_plugin
@pytest.mark.parametrize('target', ['h100', 'a100-80'])
def test_xlarge_grpo_on_8_gpus_splits_the_rollout_over_them_and_fits(target):
  """Issue 24's case: 128 completions of 512 new tokens after 512-token prompts, all at once over
  8 GPUs (data=8): each holds 1/8 of the cache and decodes its 16 rows."""
  c = grpo_config.with_group(config_lib.preset('xlarge'))  # attention auto: cuDNN
  c.train.batch_size, c.train.micro_batch_size = 128, 8
  c.grpo.num_samples, c.grpo.max_new_tokens = 16, 512
  r = grpo_plan.plan(c, target=target, num_devices=8, prompt_tokens=512)
  g, update, decode = r['grpo'], r['update'], r['decode']
  # Rows of 1,025 tokens: 1,024 inputs (512 + 512 - 1, rounded up to 8: cuDNN trains on no odd
  # length) and the last target.
  assert update['attention'] == 'cudnn' and update['tokens_per_step'] == 128 * 1025
  assert update['mesh']['data'] == 8
  # bfloat16 keys and values of 16 slots × 1,024 positions on each of the 8 devices.
  assert (g['rollout_slots'], g['slots_per_device'], g['context']) == (128, 16, 1024)
  kv = 2 * 32 * 16 * 1024 * 15 * 128 * 2
  # (and each slot's logits, float32, and token counts, int32: the penalties')
  assert g['engine_cache_gib'] == pytest.approx((kv + 16 * 32768 * (4 + 4)) / memory.GIB)
  assert decode['argument_gib'] >= g['engine_cache_gib'] + g['engine_params_gib']
  assert decode['temp_gib'] < 1
  assert all(r[k]['fits'] for k in ('update', 'prefill', 'decode'))
  assert r['rollout']['rollout_s'] < 3
  assert r['rollout']['bytes_per_token'] < 1.5 * r['rollout']['ideal_bytes_per_token']


@requires_plugin
def test_the_grpo_step_counts_its_scoring_passes_and_every_update():
  """xlarge on 8 H100s with beta > 0 and num_iterations 2: the step is the rollout, two scoring
  passes (logp_ref, logp_old) and two updates, each compiled; the scoring (of params it takes as
  its argument) fits beside the train state and the engine's cache."""
  c = grpo_config.with_group(config_lib.preset('xlarge'))
  c.train.batch_size, c.grpo.num_samples, c.grpo.max_new_tokens = 128, 16, 512
  c.grpo.beta, c.grpo.num_iterations = 0.04, 2
  r = grpo_plan.plan(c, target='h100', num_devices=8, prompt_tokens=512)
  score, ro = r['score'], r['rollout']
  assert score['calls_per_step'] == 2 and score['fits']
  assert set(score['alongside_gib']) == {'train state', 'engine cache'}  # it scores the reference
  assert 0 < score['call_s'] < ro['update_s']  # a forward, no backward
  assert ro['step_s'] == pytest.approx(ro['rollout_s'] + 2 * score['call_s'] + 2 * ro['update_s'])
  assert ro['generation_share'] == pytest.approx(ro['rollout_s'] / ro['step_s'])


@requires_plugin
def test_the_grpo_update_is_fitted_as_it_will_run_not_as_pretraining():
  """The micro-batch fit compiles the program's own update (GRPO's loss on its rows of prompt +
  new tokens, the engine's cache beside it), not the pretraining step at data.seq_len: with rows
  of 257 tokens where seq_len is 2,048, the pretraining step's fit would choose a micro-batch
  several times too small."""
  c = grpo_config.with_group(config_lib.preset('xlarge'))
  c.train.batch_size, c.grpo.num_samples, c.grpo.max_new_tokens = 128, 16, 128
  c.grpo.rollout_slots = 32
  grpo = grpo_plan.plan(c, target='h100', num_devices=1, prompt_tokens=128)['update']
  pretraining = plan.plan(c, target='h100', num_devices=1)
  assert grpo['tokens_per_step'] == 128 * 257 and grpo['fits']
  assert grpo['micro_batch_size'] >= 4 * pretraining['micro_batch_size']


@pytest.mark.parametrize('kv_cache_dtype', ['auto', 'int8'])
def test_cpu_serving_plan_counts_the_kv_cache_and_the_prefix_cache_it_holds(kv_cache_dtype):
  """plan --serve: each device's KV cache is its slots × context positions of every layer's keys
  and values (8-bit: with a float32 scale per head and position), and the prefix cache is those
  slots' tokens, nothing more; both compiled calls hold the weights and the cache as arguments."""
  from jax_pretrain.engine import plan as engine_plan  # noqa: PLC0415
  c = config_lib.preset('test')
  r = engine_plan.plan(c, target='cpu', num_devices=2, slots=8, context=48,
                       kv_cache_dtype=kv_cache_dtype)
  s = r['serve']
  m = config_lib.resolve(c, 2, backend='cpu')[0].model
  head_dim = m.d_model // m.num_heads
  element = 1 if kv_cache_dtype == 'int8' else jnp.dtype(m.compute_dtype).itemsize
  scales = 4 if kv_cache_dtype == 'int8' else 0  # float32, per kv head and position
  kv = 4 * 48 * m.num_layers * 2 * m.num_kv_heads * (head_dim * element + scales)
  assert (s['slots'], s['slots_per_device'], s['context'], s['devices']) == (8, 4, 48, 2)
  assert r['kv_cache_gib'] * memory.GIB == kv
  # Each slot's last logits (float32) and token counts (int32), beside the cache.
  assert r['slot_state_gib'] * memory.GIB >= 4 * m.vocab_size * (4 + 4)
  assert (s['prefix_cache_tokens'], s['prefix_cache_tokens_per_device']) == (8 * 48, 4 * 48)
  assert s['prefix_cache_conversations'] == 8
  # The engine's copy of the weights, whole on each device; loading adds the float32 params.
  assert r['weights_gib'] * memory.GIB >= r['params'] * jnp.dtype(m.compute_dtype).itemsize
  assert r['load_gib'] == pytest.approx(r['weights_gib'] + r['params'] * 4 / memory.GIB)
  # The largest prefill the warmup compiles (of each kind: with prefix caching, also the one after
  # cached prefixes): 4 slots' prompts of the whole context (48, itself a bucket), copied into
  # every slot; the decode of every slot.
  prefill, decode = next(p for p in r['prefills'] if not p.get('prefix')), r['decode']
  assert (prefill['rows'], prefill['length'], prefill['copies']) == (4, 48, 4)
  assert (decode['rows'], decode['live']) == (4, 48)
  for call in (*r['prefills'], decode):
    assert call['argument_gib'] >= r['weights_gib'] + r['kv_cache_gib']
    assert call['fits'] and call['call_s'] is None  # no roofline for the CPU
  assert r['fits'] and r['error'] is None
  assert r['need_gib'] == max(r['load_gib'], decode['total_memory_gib'],
                              *(p['total_memory_gib'] for p in r['prefills']))


def test_serving_plan_too_large_for_the_card_ends_with_an_error_line_naming_what_to_lower(
    tmp_path):
  """A run's model (its config.json, as serve loads it; the context its seq_len) with a KV cache
  of 64 slots × 512 tokens (16 MiB) on a 'card' of 8 MiB: the report, then one error line that
  names serve's sizes to lower, exit status 1."""
  c = config_lib.preset('test')
  c.data.seq_len = 512
  (tmp_path / 'config.json').write_text(config_lib.to_json(config_lib.typed(c)))
  out = subprocess.run(
      [sys.executable, '-m', 'jax_pretrain.plan', '--target=cpu', '--serve',
       f'--serve_workdir={tmp_path}', '--serve_slots=64', f'--memory_gib={8 / 1024}'],
      cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
  assert out.returncode == 1, out.stderr
  lines = {line.split()[0]: line for line in out.stdout.splitlines()}
  assert '98,624 parameters; 64 slots × 512 tokens' in lines['serving']  # configs/test.py's model
  assert lines['memory'].endswith('DOES NOT FIT')
  [error] = out.stderr.strip().splitlines()
  assert error.startswith('error: serving needs ')
  assert ('more than the 8.0 MiB usable: lower --serve_slots=64, --serve_context=512 or '
          '--serve_kv_cache_dtype=int8 (or fp8)') in error


@requires_plugin
def test_xlarge_served_on_one_h100_holds_its_cache_and_decodes_near_the_bandwidth_bound():
  """plan --serve with serve's defaults (16 slots of the run's 2,048 tokens, a bf16 cache) on one
  H100: 7.5 GiB of keys and values, the prefix cache's 32,768 tokens; every program fits, and a
  decoding step reads little more than the weights and the whole cache once."""
  from jax_pretrain.engine import plan as engine_plan  # noqa: PLC0415
  r = engine_plan.plan(config_lib.preset('xlarge'), target='h100', num_devices=1)
  s, decode = r['serve'], r['decode']
  assert (s['slots'], s['context'], s['kv_storage_dtype']) == (16, 2048, 'bfloat16')
  assert r['kv_cache_gib'] * memory.GIB == 16 * 2048 * 32 * 2 * 15 * 128 * 2
  assert s['prefix_cache_tokens'] == 16 * 2048
  assert r['fits'] and r['error'] is None and r['need_gib'] < 20
  step_bytes = decode['hbm_bytes_per_call'] / s['chunk']
  least = (r['weights_gib'] + r['kv_cache_gib']) * memory.GIB
  assert least <= step_bytes < 1.25 * least
  assert decode['temp_gib'] < 0.1  # the cache is written in place
