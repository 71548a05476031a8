"""DPO (direct preference optimization) and its family (IPO, SLiC's hinge, robust DPO, RPO's NLL
term) on preference pairs, beside the trainer, as TRL's DPOTrainer defines them: a
train.Program of its own and its own config group, which the trainer's core neither imports nor
validates.

  python -m jax_pretrain.dpo --workdir=OUT --init=RUN --config.data.train=PAIRS.jsonl   (__main__)

  config     the dpo config group (registered with config.py; configs/dpo.py adds it)
  objective  the losses and TRL's metrics, the completions' log-probabilities, the update's batch
  data       the pairs, read and tokenized as TRL prepares them; each step's
  program    DPO (the Program), its Step (the reference's log-probabilities -> the update), its
             logger and the held-out eval hook
"""
