"""scripts/benchmark_peer.py, the PyTorch peer, at the test preset's shape on the CPU: it trains and
decodes the same model, its loss at step 0 on our weights is ours, and without torch it says so."""
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.conftest import run_cli
from tests.conftest import subprocess_env


def test_the_peer_trains_and_decodes_our_model_and_its_first_loss_is_ours():
  pytest.importorskip('torch')
  pytest.importorskip('transformers')
  out = run_cli('scripts/benchmark_peer.py', '--config=configs/test.py', '--nocompile',
                '--steps=2', '--warmup=1', '--micro_batch=8', '--sequences=2',
                '--prompt_tokens=8', '--new_tokens=4', '--check_loss', '--markdown')
  ours, theirs = map(float, re.search(r'ours ([\d.]+), transformers ([\d.]+)', out).groups())
  assert theirs == pytest.approx(ours, rel=1e-5)
  rows = [line for line in out.splitlines() if line.startswith('| ')]
  assert len(rows) == 2 and all(row.count('|') == 8 for row in rows), out  # benchmark.py's columns
  train, decode = rows
  assert re.match(r'\| transformers eager: sdpa, mb 8 × 2, bf16 autocast \| [\d,]+ \|', train)
  assert re.match(r'\| transformers generate \(static cache\) \| 2 × \(8 \+ 4\) \| 2 \| [\d,]+ \|',
                  decode)


def test_without_torch_the_peer_says_so_in_one_line_and_exits_0():
  hide_torch = ("import runpy, sys; sys.modules['torch'] = None; "
                "sys.argv = ['benchmark_peer.py', '--config=configs/test.py']; "
                "runpy.run_path('scripts/benchmark_peer.py', run_name='__main__')")
  out = subprocess.run([sys.executable, '-c', hide_torch], cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().count('\n') == 0 and 'needs torch and transformers' in out.stdout
