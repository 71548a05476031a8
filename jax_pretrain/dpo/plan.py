"""A DPO step compiled for a GPU target, without one: `python -m jax_pretrain.plan --dpo
--config=configs/dpo.py:xlarge` (this module registers its plan with plan.py, as dpo/config.py
registers the dpo group with config.py).

The update is what train.train compiles for dpo.program.DPO: train.batch_size pairs, each two
sequences as long as data.seq_len + 1 allows (the longest pair the run can hold), its loss
objective.update_loss_fn; its micro-batch fitted (train.micro_batch_size=0) with room left for the
reference params, held beside it in the policy's shardings (none with dpo.precompute_ref_logps).
The report is plan.py's, the reference among what stays on each device beside the step.
"""
import time

from jax_pretrain import memory
from jax_pretrain import plan as plan_lib
from jax_pretrain.dpo import config as dpo_config
from jax_pretrain.dpo import objective


def plan(config, target: str = 'h100', num_devices: int = 1, hlo_path: str | None = None,
         memory_gib: float | None = None) -> dict:
  """{'dpo': the step's shapes and the reference's bytes a device, 'update': plan.report's dict
  of the update with the reference beside it}. Raises plan.PlanError and config.ConfigError."""
  config, c, run, t, devices = plan_lib.resolve_program(
      config, 'dpo', dpo_config.DpoTrainConfig, target, num_devices, memory_gib)
  resolved = dpo_config.of(c)
  B, length = resolved.train.batch_size, resolved.data.seq_len + 1
  batch = lambda s: objective.update_batch(s, B, length, resolved.dpo.rpo_alpha > 0)
  held = objective.reference_bytes(resolved)
  c, run, fitted = memory.fit_micro_batch(config, resolved, run, devices, t, alongside=held,
                                          batch=batch, loss=objective.update_loss_fn)
  t0 = time.perf_counter()
  s, compiled = memory.compile_step(c, run, devices, batch=batch, loss=objective.update_loss_fn)
  compile_s = time.perf_counter() - t0
  if hlo_path:
    with open(hlo_path, 'w', encoding='utf-8') as f:
      f.write(compiled.as_text())
  reference = memory.device_bytes(s.abstract_state.params) if held else 0.0
  report = plan_lib.report(s, compiled, t, compile_s, fitted, tokens_per_step=B * 2 * length,
                           seq_len=length,
                           alongside={'reference params': reference} if reference else {})
  d = resolved.dpo
  return {'dpo': {'pairs_per_step': B, 'sequence_tokens': length, 'loss_type': d.loss_type,
                  'reference': 'precomputed' if d.precompute_ref_logps else 'held',
                  'reference_gib': reference / memory.GIB},
          'update': report}


def format_report(r: dict) -> str:
  d = r['dpo']
  return '\n'.join([
      f'DPO step: {d["pairs_per_step"]} pairs × 2 sequences of {d["sequence_tokens"]} tokens, '
      f'loss {d["loss_type"]}, reference {d["reference"]}'
      + (f' ({plan_lib.gb_text(d["reference_gib"] * memory.GIB)} a device beside the update)'
         if d['reference'] == 'held' else ' (scored once before training: nothing held)'),
      plan_lib.format_report(r['update'])])


PLAN = plan_lib.register(plan_lib.ProgramPlan('dpo', plan, format_report))
