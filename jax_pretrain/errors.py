"""The one base class of user errors: every entry point prints them as one line and exits 1.

A UserError is a mistake the user can fix (a config value, a path, bad input, a checkpoint that
does not fit): its message names the file, line, field or step, and says what to do. Anything else
is a bug and keeps its traceback. See cli.user_errors.
"""


class UserError(Exception):
  """A mistake the user can fix; the message says where and what to do."""


def chain(error: BaseException):
  """error, then what it was raised from or during (__cause__, else __context__), and so on: each
  exception once."""
  seen: set[int] = set()
  e: BaseException | None = error
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__
