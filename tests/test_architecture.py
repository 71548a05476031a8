"""The package's structure: no import cycles (imports inside functions included), no edits of
Python's module search path, agreement between processes only in multihost.py, and presets that
start from the defaults."""
import ast
import importlib
import os
import pkgutil

import jax_pretrain
from tests.conftest import ROOT
from tests.conftest import run_cli


def import_graph() -> dict[str, set[str]]:
  """module -> the package modules it imports anywhere in its source."""
  modules = {m.name: m for m in pkgutil.walk_packages(jax_pretrain.__path__, 'jax_pretrain.')}
  modules['jax_pretrain'] = None
  graph = {}
  for name in modules:
    spec = importlib.util.find_spec(name)
    with open(spec.origin, encoding='utf-8') as f:
      tree = ast.parse(f.read())
    targets = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
          'jax_pretrain'):
        for alias in node.names:
          full = f'{node.module}.{alias.name}'
          targets.add(full if full in modules else node.module)
      elif isinstance(node, ast.Import):
        targets.update(a.name for a in node.names if a.name.startswith('jax_pretrain'))
    graph[name] = targets - {name}
  return graph


def find_cycle(graph):
  """A list of modules forming a cycle, or None."""
  state, stack = {}, []

  def visit(v):
    state[v] = 'open'
    stack.append(v)
    for w in sorted(graph.get(v, ())):
      if state.get(w) == 'open':
        return stack[stack.index(w):] + [w]
      if w not in state:
        found = visit(w)
        if found:
          return found
    state[v] = 'done'
    stack.pop()
    return None

  for v in sorted(graph):
    if v not in state:
      found = visit(v)
      if found:
        return found
  return None


def test_no_import_cycles():
  graph = import_graph()
  assert len(graph) > 20 and 'jax_pretrain.workdir' in graph['jax_pretrain.sample']
  assert find_cycle(graph) is None, ' -> '.join(find_cycle(graph))
  assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']  # it can fail


def test_nothing_edits_the_module_search_path():
  search_path = 'sys.' + 'path'  # (spelt apart, so that this file holds no such edit either)
  offenders = []
  for top in ('jax_pretrain', 'scripts', 'tests', 'configs'):
    for directory, _, files in os.walk(os.path.join(ROOT, top)):
      for name in files:
        if name.endswith('.py'):
          with open(os.path.join(directory, name), encoding='utf-8') as f:
            if search_path in f.read():
              offenders.append(os.path.join(directory, name))
  assert not offenders


def test_agreement_between_processes_only_through_multihost():
  """Collectives between processes and 'am I process 0' live in jax_pretrain/multihost.py alone."""
  patterns = ('multihost_' + 'utils', 'process_index() == 0', 'process_index() != 0')
  offenders = []
  for top in ('jax_pretrain', 'scripts'):
    for directory, _, files in os.walk(os.path.join(ROOT, top)):
      for name in files:
        path = os.path.join(directory, name)
        if name.endswith('.py') and path != os.path.join(ROOT, 'jax_pretrain', 'multihost.py'):
          with open(path, encoding='utf-8') as f:
            text = f.read()
          offenders += [f'{path}: {p}' for p in patterns if p in text]
  assert not offenders


def test_presets_load_by_path_and_start_from_the_defaults():
  from jax_pretrain import config as config_lib  # noqa: PLC0415
  for name in os.listdir(os.path.join(ROOT, 'configs')):
    c = config_lib.load_file(os.path.join(ROOT, 'configs', name))
    # GRPO's and DPO's own groups, beside the trainer's
    program = {name[:-3]} if name in ('grpo.py', 'dpo.py') else set()
    assert set(c) == set(config_lib.defaults()) | program, name


def test_pretraining_resolves_without_any_programs_group_or_their_modules():
  """The trainer's config has no grpo or dpo group, and resolving it imports neither GRPO's or
  DPO's modules nor the task and Hugging Face modules they read (a fresh interpreter)."""
  code = ('import sys; from jax_pretrain import config as c; '
          'r, _ = c.resolve(c.preset("default"), 1, backend="cpu"); '
          'print(hasattr(r, "grpo"), hasattr(r, "dpo"), sorted(m for m in sys.modules if '
          'm.startswith("jax_pretrain.") and m.split(".")[1] in ("grpo", "dpo", "tasks") or '
          'm == "jax_pretrain.data.hub"))')
  out = run_cli('-c', code)
  assert out.split() == ['False', 'False', '[]'], out


def reachable(graph, start: str) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    for w in graph.get(todo.pop(), ()):
      if w not in seen:
        seen.add(w)
        todo.append(w)
  return seen


def test_the_trainer_imports_nothing_that_runs_after_training():
  graph = import_graph()
  after = {f'jax_pretrain.{m}' for m in ('lm_eval', 'sample', 'engine', 'serve')}
  after |= {m for m in graph if m.startswith('jax_pretrain.engine.')}  # (a package)
  assert not reachable(graph, 'jax_pretrain.train') & after
  assert not reachable(graph, 'jax_pretrain.loop') & after
  # pretrain.py composes them into the run (so the check above can fail).
  composed = reachable(graph, 'jax_pretrain.pretrain')
  assert {'jax_pretrain.lm_eval', 'jax_pretrain.sample'} <= composed


def test_plan_knows_no_program_and_grpo_registers_its_own():
  """plan.py imports nothing of the grpo package (imports inside functions included): GRPO's plan
  lives in jax_pretrain/grpo/plan.py, which registers it with plan.py as grpo/config.py registers
  its config group, and plan.program_plan loads it by name (a fresh interpreter)."""
  graph = import_graph()
  assert 'jax_pretrain.plan' in graph['jax_pretrain.grpo.plan']
  assert not {m for m in graph['jax_pretrain.plan'] if m.startswith('jax_pretrain.grpo')}
  code = ('import sys; from jax_pretrain import plan; '
          'loaded = [m for m in sys.modules if m.startswith("jax_pretrain.grpo")]; '
          'p = plan.program_plan("grpo"); print(loaded, p.name, p.plan.__module__)')
  assert run_cli('-c', code).split() == ['[]', 'grpo', 'jax_pretrain.grpo.plan']


def test_the_training_path_resolves_the_config_once():
  """config.resolve is called in train.train and nowhere else that a training run goes through
  (memory.fit_micro_batch re-derives the micro-batch; state.build takes the resolved config)."""
  calls = {}
  for name in ('train', 'pretrain', 'loop', 'hooks', 'step_logger', 'memory', 'state', 'checkpoint',
               'metrics', 'signals'):
    with open(os.path.join(ROOT, 'jax_pretrain', f'{name}.py'), encoding='utf-8') as f:
      tree = ast.parse(f.read())
    calls[name] = sum(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                      and n.func.attr == 'resolve' for n in ast.walk(tree))
  assert calls == {**{name: 0 for name in calls}, 'train': 1}


MAX_FUNCTION_LINES, MAX_CLASS_LINES = 100, 250


def too_long(source: str) -> list[tuple[str, int]]:
  """(name, lines) of each function over MAX_FUNCTION_LINES and class over MAX_CLASS_LINES in
  source, nested ones included; lines from `def`/`class` to the end of its body."""
  found = []
  for node in ast.walk(ast.parse(source)):
    limit = (MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             else MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else None)
    if limit is not None and node.end_lineno - node.lineno + 1 > limit:
      found.append((node.name, node.end_lineno - node.lineno + 1))
  return found


def test_no_function_over_100_lines_nor_class_over_250():
  body = ''.join(f'    x{i} = {i}\n' for i in range(MAX_FUNCTION_LINES - 1))  # (+ def: 100)
  assert too_long(f'class C:\n  def f():\n{body}') == []
  assert too_long(f'class C:\n  def f():\n{body}    y = 0\n') == [('f', 101)]  # (it can fail)
  offenders = []
  for directory, _, files in os.walk(os.path.join(ROOT, 'jax_pretrain')):
    for name in files:
      if name.endswith('.py'):
        with open(os.path.join(directory, name), encoding='utf-8') as f:
          offenders += [f'{name}: {what} ({lines} lines)' for what, lines in too_long(f.read())]
  assert not offenders
