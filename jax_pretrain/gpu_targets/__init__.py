"""The machines `python -m jax_pretrain.plan --target=...` compiles for without having them.

For a GPU, XLA needs the device's description (a stream_executor.GpuTargetConfigProto in text
form, the .txtpb files next to this one). They are XLA's own files
(xla/backends/gpu/target_config/specs/ in github.com/openxla/xla), as jax's CUDA plugin embeds them
(`from_plugin` extracts one from the installed plugin; tests check the H100 file still matches).
Their device memory and HBM bandwidth feed the plan.

The roofline's speeds are not in those files. Where each number comes from:
  h100      bf16 matmul 794 TFLOP/s and cuDNN attention 430 forward / 333 forward+backward TFLOP/s:
            given in the project brief (measured on one H100 SXM, plain JAX at the
            xlarge shape; this project's own H100 measurements: BENCHMARKS.md); peak
            989 TFLOP/s dense bf16 (NVIDIA H100 SXM datasheet, for MFU). NVLink 4: 900 GB/s per
            GPU both ways together, 450 GB/s each way; network: one 400 Gb/s NIC per GPU (DGX H100,
            ConnectX-7), 50 GB/s.
  a100-80,  peak 312 TFLOP/s dense bf16 (NVIDIA A100 datasheet); matmul and attention speeds are
  a100-40   the H100's measured fractions of its peak (80% and 43% / 34%) applied to 312, not
            measured. NVLink 3: 600 GB/s both ways, 300 GB/s each way; network: one 200 Gb/s NIC
            per GPU (DGX A100, ConnectX-6), 25 GB/s.
  v100      (Tesla V100 SXM2 16 GB, compute capability 7.0: no bfloat16, float16 with loss scaling)
            peak 125 TFLOP/s dense fp16 tensor core (NVIDIA V100 datasheet); NVLink 2: 300 GB/s
            both ways, 150 GB/s each way; network 100 Gb/s, 12.5 GB/s (DGX-1 class).
  rtx-a6000 (48 GB, compute capability 8.6: the GA102 chip of the RTX 3090; plan a 24 GB 3090/4090
            with --memory_gib=24) peak 154.8 TFLOP/s dense bf16 with float32 accumulation (NVIDIA
            RTX A6000 datasheet; a GeForce 3090 accumulates in float32 at half that); PCIe 4.0
            x16 between cards, 32 GB/s each way; network 100 Gb/s. Speeds for both: the H100's
            measured fractions of its peak applied to theirs, not measured.
            XLA describes no T4 or A10 (the CUDA plugin's descriptions: A100s, H100s, H200, B200/
            B300/GB200/GB300, RTX A6000, RTX PRO 6000, V100, P100): those cannot be planned here.
  h100 FP8  matmuls at twice the measured bf16 rate: the datasheet's dense FP8 peak is twice its
            bf16 peak (1979 vs 989 TFLOP/s); not measured. A100s have no FP8 GEMMs.
  float32   matmuls of float32 operands run as TF32 GEMMs: on the H100 at 275 TFLOP/s, measured
            (issue 30's profile of xlarge: 8 `sm90_xmma_gemm_f32f32_tf32f32` GEMMs of the output
            head's backward, 16.5 TFLOP, 60 ms a step); other cards: that fraction of their peak
            (their datasheets' dense TF32 is half their bf16, as the H100's), not measured. The
            V100 has no TF32: its float32 peak, 15.7 TFLOP/s (datasheet).
Collectives are assumed to reach COLLECTIVE_EFFICIENCY of the link (NCCL ring bus bandwidth, as in
docs/scaling.md).
"""
import dataclasses
import glob
import os
import re

COLLECTIVE_EFFICIENCY = 0.8
_DIR = os.path.dirname(os.path.abspath(__file__))

_H100_PEAK, _A100_PEAK = 989e12, 312e12
_V100_PEAK, _A6000_PEAK = 125e12, 154.8e12
_H100_MATMUL, _H100_ATTENTION = 794e12, (430e12, 333e12)
_H100_F32_MATMUL = 16.5e12 / 0.060  # TF32, issue 30's profile (the module docstring)


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # the --target value
  file: str | None  # GpuTargetConfigProto text in this directory; None: this machine's CPU
  peak_flops: float | None = None  # dense bf16 FLOP/s per device (datasheet), for MFU
  matmul_flops: float | None = None  # bf16 matmul FLOP/s reached
  cudnn_attention_flops: tuple[float, float] | None = None  # (forward, forward+backward) FLOP/s
  link_bandwidth: float = 0.0  # bytes/s per device each way inside a node (NVLink)
  network_bandwidth: float = 0.0  # bytes/s per device each way across nodes
  devices_per_node: int = 8
  memory_override: float | None = None  # bytes: a card of this family with less memory
  fp8_matmul_flops: float | None = None  # FP8 matmul FLOP/s (None: the card has no FP8 GEMMs)
  f32_matmul_flops: float | None = None  # float32-operand (TF32) matmul FLOP/s

  def config_text(self) -> str:
    if self.file is None:
      raise ValueError(f'target {self.name}: no GpuTargetConfigProto file (the CPU).')
    with open(os.path.join(_DIR, self.file), encoding='utf-8') as f:
      return f.read()

  def _field(self, name: str) -> float:
    m = re.search(rf'^\s*{name}:\s*"?([^"\n]+)"?\s*$', self.config_text(), re.M)
    return float(m.group(1)) if m else 0.0

  @property
  def device_memory(self) -> float:
    """Bytes of device memory (the CPU: this machine's RAM)."""
    if self.memory_override:
      return self.memory_override
    if self.file is None:
      return float(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))
    return self._field('device_memory_size')

  @property
  def hbm_bandwidth(self) -> float | None:
    return self._field('memory_bandwidth') if self.file else None

  @property
  def device_kind(self) -> str:
    if self.file is None:
      return 'cpu'
    m = re.search(r'device_description_str:\s*"([^"]*)"', self.config_text())
    if m is None:
      raise ValueError(f'{self.file}: no device_description_str.')
    return m.group(1)


def _scaled(name: str, file: str, peak: float, link: float, network: float,
            f32_matmul: float | None = None) -> Target:
  """A card whose matmul and attention speeds are the H100's measured fractions of its peak
  (float32 matmuls too, unless f32_matmul says otherwise)."""
  scale = peak / _H100_PEAK
  return Target(name, file, peak, _H100_MATMUL * scale,
                (_H100_ATTENTION[0] * scale, _H100_ATTENTION[1] * scale), link, network,
                f32_matmul_flops=f32_matmul or _H100_F32_MATMUL * scale)


def _a100(name: str, file: str) -> Target:
  return _scaled(name, file, _A100_PEAK, 300e9, 25e9)


TARGETS = {
    'h100': Target('h100', 'h100_sxm.txtpb', _H100_PEAK, _H100_MATMUL, _H100_ATTENTION, 450e9,
                   50e9, fp8_matmul_flops=2 * _H100_MATMUL, f32_matmul_flops=_H100_F32_MATMUL),
    'a100-80': _a100('a100-80', 'a100_sxm_80.txtpb'),
    'a100-40': _a100('a100-40', 'a100_sxm_40.txtpb'),
    # Older cards (model.dtype 'auto' gives float16 on the V100, bfloat16 on the A6000).
    'v100': _scaled('v100', 'v100_sxm2_16.txtpb', _V100_PEAK, 150e9, 12.5e9, 15.7e12),
    'rtx-a6000': _scaled('rtx-a6000', 'rtx_a6000.txtpb', _A6000_PEAK, 32e9, 12.5e9),
    'cpu': Target('cpu', None),
}


@dataclasses.dataclass
class Roofline:
  compute_s: float  # kernels: max(FLOPs / speed, HBM bytes / bandwidth), summed
  communication_s: float  # collectives: wire bytes / link (or network) bandwidth
  by_kind: dict[str, float] = dataclasses.field(default_factory=dict)  # compute_s by kernel kind

  @property
  def step_s(self) -> float:
    """No overlap of communication with compute: an upper bound on the roofline's step."""
    return self.compute_s + self.communication_s


def roofline(stats, target: Target) -> Roofline | None:
  """A compiled program's time at the target's speeds (the module docstring), from its
  hlo.Stats; None for a target without them (the CPU)."""
  if target.matmul_flops is None or target.cudnn_attention_flops is None:
    return None
  forward, both = target.cudnn_attention_flops
  # The backward kernel alone, from forward and forward+backward (2.5× and 3.5× forward's FLOPs).
  backward = 2.5 / (3.5 / both - 1.0 / forward)
  speed = {'matmul': target.matmul_flops, 'attention': forward, 'attention_backward': backward,
           'matmul_fp8': target.fp8_matmul_flops or target.matmul_flops,
           'matmul_f32': target.f32_matmul_flops or target.matmul_flops}
  hbm = target.hbm_bandwidth  # (read from the file: once, not per kernel)
  by_kind: dict[str, float] = {}
  for k in stats.kernels:
    seconds = k.times * max(k.flops / speed.get(k.kind, target.matmul_flops), k.hbm_bytes / hbm)
    by_kind[k.kind] = by_kind.get(k.kind, 0.0) + seconds
  link = COLLECTIVE_EFFICIENCY * target.link_bandwidth
  network = COLLECTIVE_EFFICIENCY * target.network_bandwidth
  communication = sum((c.wire_bytes - c.cross_node_wire_bytes) / link
                      + c.cross_node_wire_bytes / network
                      for c in stats.collectives.values())
  return Roofline(sum(by_kind.values()), communication, by_kind)


def for_device_kind(kind: str) -> Target | None:
  """The target of a real GPU of this kind (jax's device_kind, e.g. 'NVIDIA H100 80GB HBM3'), or
  None: the speeds the trainer's fit (memory.fit_micro_batch) ranks its compiled candidates by."""
  return next((t for t in TARGETS.values() if t.file and t.device_kind == kind), None)


def plugin_library() -> str | None:
  """Path of the installed jax CUDA plugin's shared library, or None."""
  try:
    import jax_plugins  # noqa: PLC0415
  except ImportError:
    return None
  for path in jax_plugins.__path__:
    found = sorted(glob.glob(os.path.join(path, 'xla_cuda*', 'xla_cuda_plugin.so')))
    if found:
      return found[-1]
  return None


def from_plugin(device_description: str, library: str | None = None) -> str:
  """The GpuTargetConfigProto text that the CUDA plugin embeds for this device (e.g. 'NVIDIA H100
  80GB HBM3'): the text after the `proto-message: stream_executor.GpuTargetConfigProto` line up to
  its device_description_str. For refreshing the files here when jax is upgraded."""
  library = library or plugin_library()
  if library is None:
    raise FileNotFoundError("jax's CUDA plugin is not installed (pip install -r "
                            'requirements-gpu.txt)')
  with open(library, 'rb') as f:
    data = f.read()
  marker = b'# proto-message: stream_executor.GpuTargetConfigProto\n'
  start = data.find(marker)
  while start >= 0:
    begin = start + len(marker)
    end = data.index(b'\n', data.index(b'device_description_str:', begin)) + 1
    text = data[begin:end].decode()
    if f'device_description_str: "{device_description}"' in text:
      return text
    start = data.find(marker, end)
  raise KeyError(f'{device_description!r} is not among the target descriptions in {library}')
