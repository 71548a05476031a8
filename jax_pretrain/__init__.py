"""jax_pretrain: pretrain decoder-only language models with JAX/Flax, one GPU to many nodes."""

import os as _os

# The checkout's presets (configs/*.py), found by path: `--config=configs/xlarge.py`.
PRESETS_DIR = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))),
                            'configs')
