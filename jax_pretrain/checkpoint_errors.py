"""What orbax's and tensorstore's errors say about a checkpoint, and what they print besides.

`kind(error)` sorts a failed read of a checkpoint (checkpoint.Checkpointer acts on it), `cause` and
`described` give its gist for one error line. orbax and tensorstore name no error types of their
own: tensorstore raises ValueError for every failure, its message starting with the status code
(none for INVALID_ARGUMENT) and ending with [os_error_code='N'] when a system call failed; orbax
wraps a failed array read in a bare Exception. Measured with orbax-checkpoint 0.12.8 and
tensorstore 0.1.86 on real checkpoints with faults injected (tests/test_checkpoint_faults.py: a
change of theirs shows there).

The filters at the end drop what they print after a failure that one line already says; they
change the process's output, so only an entry point installs them (cli.output_policy).
"""
import errno
import json
import logging
import os
import re

# What a failed read says about the checkpoint, from least to most serious: when processes differ,
# the most serious one is what they all do.
OK, MISSING, DAMAGED, TRANSIENT, OTHER = 'ok', 'missing', 'damaged', 'transient', 'other'
KINDS = (OK, MISSING, DAMAGED, TRANSIENT, OTHER)

_OS_ERROR = re.compile(r"\[os_error_code='?(\d+)")
_MISSING = re.compile(r'^NOT_FOUND: ')
_DAMAGED = re.compile(r'^(OUT_OF_RANGE|DATA_LOSS): |Truncated|decompress|Error decoding|'
                      r'Invalid JSON')
_TRANSIENT = re.compile(r'^(UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED): ')


class DamagedCheckpoint(Exception):
  """A checkpoint's arrays differ from the digests written with them."""


def unwrapped(error: BaseException) -> BaseException:
  """The error under orbax's wrapper of a failed array read (a bare Exception, 'Encountered error
  while reading array index: ...', raised from tensorstore's)."""
  while type(error) is Exception:
    inner = error.__cause__ or error.__context__
    if inner is None:
      break
    error = inner
  return error


def _errno_kind(code: int | None) -> str:
  if code == errno.ENOENT:
    return MISSING
  if code in (errno.EACCES, errno.EPERM):
    return OTHER  # no retry mends a permission
  return TRANSIENT  # EIO, EAGAIN, ETIMEDOUT, ESTALE, ELOOP, ...


def kind(error: BaseException) -> str:
  """What a failed read of a checkpoint says about its files:

  missing (damaged, unless a second read after listing the directories again succeeds): a
    FileNotFoundError (orbax: a JSON item's file, an array's directory; ours: a missing state
    directory); orbax's KeyError of an item whose directory is missing; tensorstore's NOT_FOUND
    (a missing manifest or b-tree file) or os_error_code 2.
  damaged: DamagedCheckpoint (a digest differs); json.JSONDecodeError (a truncated JSON file);
    tensorstore's OUT_OF_RANGE or DATA_LOSS (a file cut short) or bytes that do not decode
    ('Truncated Zstd-compressed stream' is also what a deleted data file gives, 'Error decoding',
    'ZSTD_decompressStream() failed', 'Invalid JSON').
  transient: another OSError, or tensorstore's os_error_code, other than a permission (EIO,
    EAGAIN, ETIMEDOUT, ESTALE, ...); tensorstore's UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED.
  other: everything else (a permission, a device out of memory, any other orbax error).
  """
  error = unwrapped(error)
  if isinstance(error, FileNotFoundError) or (isinstance(error, KeyError)
                                              and 'was not found in the checkpoint' in str(error)):
    return MISSING
  if isinstance(error, (DamagedCheckpoint, json.JSONDecodeError)):
    return DAMAGED
  if isinstance(error, OSError):
    return _errno_kind(error.errno)
  if isinstance(error, ValueError):
    text = str(error)
    found = _OS_ERROR.search(text)
    if found:
      return _errno_kind(int(found.group(1)))
    if _MISSING.match(text):
      return MISSING
    if _DAMAGED.search(text):
      return DAMAGED
    if _TRANSIENT.match(text):
      return TRANSIENT
  return OTHER


def cause(error: BaseException) -> str:
  """The gist of an orbax/tensorstore error: the OS error when there is one (their messages
  repeat long paths), else the start of the message (without tensorstore's spec)."""
  error = unwrapped(error)
  text = str(error).strip()
  found = _OS_ERROR.search(text)
  if found:
    return f'{os.strerror(int(found.group(1)))} (errno {found.group(1)})'
  text = text.split(' [tensorstore_spec=')[0]
  return text.splitlines()[0][:300].rstrip('.') if text else type(error).__name__


def described(error: BaseException) -> str:
  """cause, after the error's type unless it is an OS error (whose text says what it is)."""
  error = unwrapped(error)
  if isinstance(error, OSError) or _OS_ERROR.search(str(error)):
    return cause(error)
  return f'{type(error).__name__}: {cause(error)}'


# What orbax and tensorstore print after a failure (installed by cli.output_policy).


class OrbaxNoise(logging.Filter):
  """On absl's logger: the traceback orbax logs for a failed background save (the error line
  raised for it says what failed, and chains the exception), and the warning that a reader's
  directory is read only (a reader asks for it)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if f'{os.sep}orbax{os.sep}' not in record.pathname:
      return True
    return not ((record.levelno >= logging.ERROR and record.exc_info)
                or str(record.msg).startswith('Given directory is read only'))


class AbandonedTasks(logging.Filter):
  """On asyncio's logger: when a read fails, orbax abandons the checkpoint's other reads, and
  asyncio reports each as 'Task exception was never retrieved' with tensorstore's error (its
  spec, a page)."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not ('exception was never retrieved' in str(record.msg)
                and 'tensorstore' in str(error))


class AbandonedReads:
  """sys.unraisablehook: the abandoned reads are also reported as exceptions Python could not
  raise ('Exception ignored in: <coroutine ...>' with a page of tensorstore's spec, asyncio's
  'Event loop is closed'), some at exit, after the line that said what happened. Those two kinds
  are dropped; any other goes to the hook before. (The defaults hold what __call__ needs at exit,
  when module globals and builtins may be gone.)"""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, u, getattr=getattr, isinstance=isinstance, str=str, sep=os.sep):
    where = getattr(getattr(u.object, 'cr_code', None), 'co_filename', '') or ''
    if f'{sep}orbax{sep}' in where or (isinstance(u.exc_value, RuntimeError)
                                       and str(u.exc_value) == 'Event loop is closed'):
      return
    self.previous(u)


class ClosedLoop:
  """sys.excepthook: a callback of tensorstore's thread into the event loop of an abandoned read,
  closed meanwhile, is printed as a bare 'Event loop is closed' traceback. Dropped; any other goes
  to the hook before."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, error_type, value, tb, isinstance=isinstance, str=str):
    if isinstance(value, RuntimeError) and str(value) == 'Event loop is closed':
      return
    self.previous(error_type, value, tb)
