"""jax_pretrain: pretrain decoder-only language models with JAX/Flax on one GPU, one node or many."""
