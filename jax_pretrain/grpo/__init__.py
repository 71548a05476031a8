"""GRPO (group relative policy optimization) with verifiable rewards, beside the trainer: a
train.Program of its own and its own config group, which the trainer's core neither imports nor
validates.

  python -m jax_pretrain.grpo --workdir=OUT --init=RUN --task=TRAIN.jsonl ...   (__main__.py)

  config     the grpo config group (registered with config.py; configs/grpo.py adds it)
  objective  the math and the update's shapes: advantages, the clipped ratio with its KL term,
             the train step's loss, the rows' widths (what its plan compiles)
  rollout    completions sampled by the engine, as a training batch
  data       the task's items and reward; the prompts of each step
  plan       the programs of a GRPO step compiled for a GPU target, without one (registered with
             plan.py: python -m jax_pretrain.plan --grpo)
  program    GRPO (the Program), its Step (rollouts -> rewards -> advantages -> updates), its
             logger and the held-out accuracy hooks
"""
