"""The input side's one exception: bad input, named by file (and line where there is one)."""
from jax_pretrain.errors import UserError


class DataError(UserError):
  """Input that would make training read nothing or garbage; the message says where and why."""
