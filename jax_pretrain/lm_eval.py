"""Downstream benchmarks through EleutherAI's lm-evaluation-harness, with our model in JAX.

  python -m jax_pretrain.lm_eval --workdir=runs/x --tasks=hellaswag,arc_easy [--step=N]
      [--include_path=DIR] [--limit=N] [--num_fewshot=K] [--batch_size=16] [--output=results.json]

The harness builds the requests (prompts, few-shot examples, answer choices) and computes the
metrics; this module answers its three kinds of request (JaxLM):
- loglikelihood(context, continuation): the log-probability of the continuation's tokens and
  whether each is the greedy choice, as lm_eval's Hugging Face backend computes them: the same
  tokenization of the pair (TemplateLM), the same left truncation to max_length + 1 tokens. Rows
  are sorted by length and scored batch_size at a time, padded to a power-of-two length, so that
  a whole task compiles a handful of shapes.
- loglikelihood_rolling(text): the text's log-likelihood in windows of max_length tokens, each
  token predicted once with as much context as fits (lm_eval's rolling windows), scored as above.
- generate_until(context, until, max_gen_toks, ...): KV-cached generation through engine.Engine
  (continuous batching, a sequence ends at EOS, its token budget or its first stop string).

An empty context is conditioned on EOS, which starts every document in training (a BOS the model
never saw would be a worse start). max_length is the run's training seq_len: the positions the
model has learned. The model computes in the run's model.dtype (float32 for the embedded default).

Tasks come from lm_eval's registry (downloaded from the Hugging Face Hub on first use) or from YAML
files in --include_path (lm_eval's task format: a local JSONL works offline).
"""
import functools
import json
import time
import traceback

import jax
import lm_eval
from lm_eval import utils as lm_eval_utils
from lm_eval.api import model as lm_eval_model
from lm_eval.models import utils as lm_eval_model_utils
import numpy as np

from jax_pretrain import cli
from jax_pretrain import config as config_lib
from jax_pretrain import engine as engine_lib
from jax_pretrain import errors
from jax_pretrain import sample as sample_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.errors import UserError

DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's default when a task does not say


class TaskError(UserError):
  """A task this model cannot run, or one that does not exist: one line for the user."""


def _counted(method):
  """Counts an LM method's requests and the seconds spent in it (the harness's speed)."""
  @functools.wraps(method)
  def wrapper(self, requests, *args, **kwargs):
    t0 = time.perf_counter()
    try:
      return method(self, requests, *args, **kwargs)
    finally:
      self.counts[method.__name__] += len(requests)
      self.seconds += time.perf_counter() - t0
  return wrapper


class JaxLM(lm_eval_model.TemplateLM):
  """Our model as an lm_eval language model (see the module docstring)."""

  def __init__(self, model_config, params, tokenizer, *, max_length: int, batch_size: int = 16,
               seed: int = 0):
    super().__init__()
    # Not `self.tokenizer`: lm_eval reads that as a Hugging Face tokenizer (chat templates).
    self.tokenizer_ = tokenizer
    self._max_length, self.batch_size, self.seed = max_length, batch_size, seed
    self.engine = engine_lib.Engine(model_config, params, tokenizer, slots=batch_size,
                                    context=max_length)
    self.counts = {'loglikelihood': 0, 'loglikelihood_rolling': 0, 'generate_until': 0}
    self.seconds = 0.0  # in the three request methods
    self.score_shapes: set[tuple[int, int]] = set()

  @property
  def eot_token_id(self) -> int:
    return self.tokenizer_.eos_id

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return min(DEFAULT_MAX_GEN_TOKS, self._max_length // 2)

  @property
  def tokenizer_name(self) -> str:
    return self.tokenizer_.identity

  def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
    del add_special_tokens, kwargs  # text alone: lm_eval adds its own prefix token
    return [int(t) for t in tokenizer_lib.text_ids(self.tokenizer_, string)]

  def tok_decode(self, tokens) -> str:
    return self.tokenizer_.decode(tokens)

  @_counted
  def loglikelihood(self, requests, disable_tqdm: bool = False):
    return super().loglikelihood(requests, disable_tqdm=True)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    """(log-likelihood, is greedy) of each (key, context ids, continuation ids)."""
    del disable_tqdm, kwargs
    rows = [(context + continuation)[-(self._max_length + 1):] for _, context, continuation
            in requests]
    results = self._score(rows, [len(continuation) for _, _, continuation in requests])
    for (key, _, _), result in zip(requests, results):
      if key is not None:
        self.cache_hook.add_partial('loglikelihood', key, result)
    return results

  @_counted
  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owner = [], []
    for r, (text,) in enumerate(req.args for req in requests):
      for context, targets in map(lm_eval_utils.make_disjoint_window,
                                  lm_eval_utils.get_rolling_token_windows(
                                      token_list=self.tok_encode(text),
                                      prefix_token=self.prefix_token_id,
                                      max_seq_len=self._max_length, context_len=1)):
        windows.append((None, context, targets))
        owner.append(r)
    totals = [0.0] * len(requests)
    for r, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
      totals[r] += logprob
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial('loglikelihood_rolling', req.args, total)
    return totals

  def _score(self, rows: list[list[int]], n_targets: list[int]) -> list[tuple[float, bool]]:
    """Sum of the log-probabilities of the last n tokens of each row given the tokens before them,
    and whether each of those tokens was the most likely one. Longest rows first, batch_size rows
    per call, padded to a power-of-two length (and to batch_size rows)."""
    results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)  # (each row's, filled below)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    pad = self.tokenizer_.pad_id
    for start in range(0, len(order), self.batch_size):
      batch = order[start:start + self.batch_size]
      T = engine_lib.bucket(len(rows[batch[0]]) - 1, self._max_length, engine_lib.MIN_BUCKET)
      tokens_BxT1 = np.full((self.batch_size, T + 1), pad, np.int32)
      for b, i in enumerate(batch):
        tokens_BxT1[b, :len(rows[i])] = rows[i]
      self.score_shapes.add((self.batch_size, T))
      logprob_BxT, greedy_BxT, _ = jax.device_get(self.engine.score(tokens_BxT1))
      for b, i in enumerate(batch):
        end = len(rows[i]) - 1  # targets are tokens 1 .. len - 1, at indices 0 .. len - 2
        span = slice(end - n_targets[i], end)
        results[i] = (float(np.sum(logprob_BxT[b, span], dtype=np.float64)),
                      bool(np.all(greedy_BxT[b, span])))
    return results

  @_counted
  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Continuations of each context up to its first stop string, EOS or max_gen_toks; greedy
    unless the task asks for sampling (do_sample / temperature; then top_k, top_p, our seed)."""
    sequences = []
    for r, (context, gen_kwargs) in enumerate(req.args for req in requests):
      kwargs = lm_eval_model_utils.normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
      max_new = kwargs['max_gen_toks']
      if max_new >= self._max_length:
        raise TaskError(f'a task asks for {max_new} new tokens: the model has a context of '
                         f'{self._max_length} tokens (the run\'s seq_len).')
      prompt = [int(t) for t in sample_lib.encode_prompt(self.tokenizer_, context)]
      sequences.append(engine_lib.Sequence(
          prompt[-(self._max_length - max_new):], max_new,
          temperature=float(kwargs.get('temperature') or 0.0) if kwargs['do_sample'] else 0.0,
          top_k=int(kwargs.get('top_k') or 0), top_p=float(kwargs.get('top_p') or 1.0),
          seed=self.seed, stream=r, stop=tuple(kwargs['until'])))
    # Similar lengths together: they prefill in the same padded shape.
    self.engine.generate(sorted(sequences, key=lambda s: -len(s.prompt)))
    for req, seq in zip(requests, sequences):
      self.cache_hook.add_partial('generate_until', req.args, seq.text)
    return [seq.text for seq in sequences]


def run_tasks(lm: JaxLM, tasks: list[str], *, include_path: str = '', limit: float | None = None,
             num_fewshot: int | None = None, log_samples: bool = False,
             task_manager=None) -> dict:
  """lm_eval's results dict (results, configs, versions, n-samples, and samples if log_samples)."""
  task_manager = task_manager or task_index(include_path, tasks)
  check_known(tasks, task_manager)
  return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, limit=limit,
                                 num_fewshot=num_fewshot, log_samples=log_samples,
                                 random_seed=lm.seed, numpy_random_seed=lm.seed,
                                 fewshot_random_seed=lm.seed)


def check_known(tasks: list[str], task_manager) -> None:
  """Fails (TaskError) on a task name that the task index does not have."""
  missing = [t for t in tasks if t not in task_manager.all_tasks]
  if missing:
    raise TaskError(f'unknown lm_eval task(s) {", ".join(missing)}: see `lm_eval ls tasks`, or '
                     'give --include_path a folder of task YAMLs.')


def scalars(results: dict) -> dict[str, float]:
  """lm_eval/TASK/METRIC for each metric (stderr left out); a metric under a filter other than
  'none' is named METRIC/FILTER."""
  out = {}
  for task, metrics in results['results'].items():
    for key, value in metrics.items():  # 'METRIC,FILTER' keys; the others describe the task
      metric, comma, filter_name = key.partition(',')
      if not comma or '_stderr' in metric or not isinstance(value, (int, float)):
        continue
      name = metric if filter_name in ('', 'none') else f'{metric}/{filter_name}'
      out[f'lm_eval/{task}/{name}'] = float(value)
  return out


_TASK_INDEXES: dict[tuple[str, bool], object] = {}


def task_index(include_path: str, tasks: list[str]):
  """lm_eval's TaskManager for these tasks, built once per include path: the include path's own
  index when it holds every one of them (lm_eval's built-in index takes 15-20 s to build), else
  the include path's and the built-in tasks together. (An include-path group that lists built-in
  tasks is named in neither alone: ask for its tasks by name, or give no include path.)"""
  from lm_eval.tasks import TaskManager  # noqa: PLC0415

  def index(built_in: bool):
    key = (include_path, built_in)
    if key not in _TASK_INDEXES:
      _TASK_INDEXES[key] = TaskManager(include_path=include_path or None,
                                       include_defaults=built_in)
    return _TASK_INDEXES[key]

  if include_path and all(t in index(False).all_tasks for t in tasks):
    return index(False)
  return index(True)


def _training_tasks(t: config_lib.TrainConfig) -> tuple[list[str], object]:
  """The train.lm_eval_tasks names and their task index."""
  tasks = [x.strip() for x in t.lm_eval_tasks.split(',') if x.strip()]
  return tasks, task_index(t.lm_eval_include_path, tasks)


def check_tasks(t: config_lib.TrainConfig) -> None:
  """Fails (ConfigError) on a train.lm_eval_tasks name that lm_eval does not know (t: the
  resolved train group, or its view)."""
  try:
    check_known(*_training_tasks(t))
  except TaskError as e:
    raise config_lib.ConfigError(f'train.lm_eval_tasks: {e}') from None


def _modules(error: BaseException) -> list[str]:
  """The modules of the frames an exception went through, outermost first."""
  return [frame.f_globals.get('__name__', '')
          for frame, _ in traceback.walk_tb(error.__traceback__)]


def _ours(module: str) -> bool:
  return module.startswith('jax_pretrain.')


def harness_failed(error: BaseException) -> bool:
  """Whether an exception of evaluate_during_training is the harness's or its tasks' (a dataset's
  download, a task's config, a metric), which training can outlive, rather than ours (our model,
  the engine, the device: a bug or an out-of-memory that the next step would hit too).

  The harness's: a TaskError (a task this model cannot run), or an exception raised inside
  lm_eval's code or what it calls (datasets, huggingface_hub: offline or unreachable, a download
  raises ConnectionError, then FileNotFoundError, there; lm_eval 0.4.13, datasets 5.2.0) without
  passing through our code again (JaxLM's methods, which the harness calls), nor chained to an
  exception that did.
  """
  chain = list(errors.chain(error))
  if any(isinstance(e, TaskError) for e in chain):
    return True
  modules = _modules(chain[0])  # the whole way down from our call
  into_harness = next((i for i, m in enumerate(modules)
                       if m == 'lm_eval' or m.startswith('lm_eval.')), None)
  if into_harness is None or any(map(_ours, modules[into_harness:])):
    return False
  # A chained exception's frames run from where it was caught: none of them may be ours.
  return not any(_ours(m) for e in chain[1:] for m in _modules(e))


def evaluate_during_training(config: config_lib.Config, params,
                             tokenizer) -> dict[str, float]:
  """The train.lm_eval_* tasks on the current params, as lm_eval/TASK/METRIC scalars."""
  t = config.train
  tasks, task_manager = _training_tasks(t)
  lm = JaxLM(config.model, params, tokenizer, max_length=config.data.seq_len,
             seed=t.seed)
  return scalars(run_tasks(lm, tasks, limit=t.lm_eval_limit or None, task_manager=task_manager))


def main():
  from absl import flags  # noqa: PLC0415
  f = flags.FLAGS
  t0 = time.perf_counter()
  task_manager = task_index(f.include_path, f.tasks)
  check_known(f.tasks, task_manager)  # before the model loads: a typo fails at once
  run = workdir_lib.load(f.workdir, f.step, devices=jax.devices()[:1])
  lm = JaxLM(run.config.model, run.engine_params, run.tokenizer,
             max_length=run.config.data.seq_len, batch_size=f.batch_size, seed=f.seed)
  limit = None if f.limit is None else (int(f.limit) if f.limit >= 1 else f.limit)
  results = run_tasks(lm, f.tasks, limit=limit, num_fewshot=f.num_fewshot,
                     log_samples=f.log_samples, task_manager=task_manager)
  seconds = time.perf_counter() - t0
  print(lm_eval_utils.make_table(results))
  if results.get('groups'):
    print(lm_eval_utils.make_table(results, 'groups'))
  n = sum(lm.counts.values())
  print(f'{n:,} requests ({", ".join(f"{k} {v:,}" for k, v in lm.counts.items() if v)}): '
        f'{lm.seconds:.1f}s in the model, {n / max(lm.seconds, 1e-9):.1f} requests/s; '
        f'{seconds:.1f}s in all', flush=True)
  if f.output:
    with open(f.output, 'w', encoding='utf-8') as out:
      json.dump(results, out, indent=2, default=lm_eval_utils.handle_non_serializable)


if __name__ == '__main__':
  from absl import flags
  cli.define_run_flags()
  flags.DEFINE_list('tasks', None, 'lm_eval tasks, comma-separated (e.g. hellaswag,arc_easy).',
                    required=True)
  flags.DEFINE_string('include_path', '', 'A folder of extra task YAMLs (as lm_eval\'s).')
  flags.DEFINE_float('limit', None, 'Examples per task at most (below 1: a fraction).')
  flags.DEFINE_integer('num_fewshot', None, 'Few-shot examples (default: each task\'s own).')
  flags.DEFINE_integer('batch_size', 16, 'Rows per scoring call and generation slots.')
  flags.DEFINE_integer('seed', 0, 'Seed of few-shot sampling and of sampled generation.')
  flags.DEFINE_string('output', '', 'Write the harness\'s results JSON to this file.')
  flags.DEFINE_bool('log_samples', False, 'Include every request and response in --output.')
  cli.run(main)
