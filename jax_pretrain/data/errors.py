"""The one exception type of the input side: bad input, named by file (and line where there is one)."""


class DataError(ValueError):
  """Input that would make training read nothing or garbage; the message says where and why."""
