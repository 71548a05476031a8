"""Throughput of the OpenAI-compatible server: requests/s and generated tokens/s for a number of
concurrent clients.

  python scripts/benchmark_serve.py --workdir=runs/default                  # 1 and 16 clients
  python scripts/benchmark_serve.py --url=http://127.0.0.1:8000/v1 --clients=1,4,16,32

Without --url it starts `python -m jax_pretrain.serve --workdir=... --warmup` on a free port (and
stops it at the end). Each client is a thread sending completions one after the other (sampled at
temperature 0.8, a seed per request, --max_tokens each, prompts from the manual's first lines)
with the standard library's HTTP client: the openai client costs ~10 ms of CPU a request, which on
a 2-core machine would be taken from the server. A request that ends at EOS counts the tokens it
generated. Every client count runs once untimed first.

--system_prompt=K puts the same K characters (the manual's, fixed) before every prompt, as a chat
application's system prompt: with the server's prefix cache (on by default; off with
`--serve_args=--noprefix_cache`) each request after the first reuses their keys and values. Give the
server a --context that holds them (`--serve_args=--context=...`); the table then has the mean
`usage.prompt_tokens_details.cached_tokens` a request.

--py_spy=BIN (py-spy's command; `pip install py-spy`) measures the engine thread: `py-spy dump`
names it (Python threads share the interpreter's name in /proc), then /proc/PID/task gives the CPU
time each of the server's threads took during the timed run, per generated token — the engine
thread's own (scheduling, dispatching the compiled calls, reading their results, output
processing: the host's work on a step), the other Python threads' (the HTTP server's), XLA's
pools' (the model's work on the CPU) — and the engine thread's share of the run's wall time (the
host's share of a step; the rest it waits for the device). Nothing samples the process during that
run (py-spy attached takes ~40% of the throughput on 2 cores). A second run of the same requests
is then sampled (`py-spy record --threads --idle`) for where the engine thread's time goes: in
jax (dispatch, reading results) against its own Python, with its largest functions by own time.
"""
import argparse
import collections
import concurrent.futures
import json
import os
from pydoc_data import topics
import signal
import socket
import subprocess
import sys
import time
import urllib.request

START_TIMEOUT_S = 1800  # --warmup's background compiles: minutes on a busy CPU


def prompts(n: int) -> list[str]:
  """n prompts of 10 to 40 characters: the starts of the manual's topics."""
  texts = [topics.topics[k] for k in sorted(topics.topics)]
  return [texts[i % len(texts)][:10 + (7 * i) % 31] for i in range(n)]


def start(workdir: str, serve_args: str = '') -> tuple[subprocess.Popen, str]:
  """`python -m jax_pretrain.serve --warmup` on a free port, once its /health answers and its
  background compiles are done (none then competes with the requests): (process, base URL of
  /v1)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  server = subprocess.Popen([sys.executable, '-m', 'jax_pretrain.serve', '--warmup',
                             f'--workdir={workdir}', f'--port={port}', *serve_args.split()],
                            stdout=subprocess.DEVNULL)
  url = f'http://127.0.0.1:{port}/v1'
  deadline = time.monotonic() + START_TIMEOUT_S
  while time.monotonic() < deadline:
    try:
      with urllib.request.urlopen(url.replace('/v1', '/health'), timeout=5) as r:
        if not json.load(r).get('compiling_shapes'):
          return server, url
      time.sleep(0.5)
    except OSError:
      if server.poll() is not None:
        sys.exit('error: the server did not start')
      time.sleep(0.5)
  server.kill()
  sys.exit(f'error: the server did not answer /health within {START_TIMEOUT_S} s')


def model_name(url: str, api_key: str = '') -> str:
  auth = {'Authorization': f'Bearer {api_key}'} if api_key else {}
  with urllib.request.urlopen(urllib.request.Request(f'{url}/models', headers=auth)) as r:
    return json.load(r)['data'][0]['id']


def system_prompt(k: int) -> str:
  """k characters of the manual, the same every call (ASCII: a token a character for a byte
  tokenizer)."""
  text = ' '.join(topics.topics[key] for key in sorted(topics.topics)).encode('ascii', 'ignore')
  return text.decode()[:k]


def run(url: str, name: str, clients: int, n: int, max_tokens: int, api_key: str = '',
        system: str = '') -> tuple[float, int, float, float]:
  """(seconds, completion tokens, mean latency, mean cached prompt tokens) of n requests from
  `clients` threads, each prompt after `system`."""
  work = [system + w for w in prompts(n)]

  def client_loop(k: int) -> list[tuple[int, float, int]]:
    done = []
    for i in range(k, n, clients):
      t0 = time.perf_counter()
      body = json.dumps({'model': name, 'prompt': work[i], 'max_tokens': max_tokens,
                         'temperature': 0.8, 'seed': i}).encode()
      headers = {'Content-Type': 'application/json'}
      if api_key:
        headers['Authorization'] = f'Bearer {api_key}'
      request = urllib.request.Request(f'{url}/completions', data=body, headers=headers)
      with urllib.request.urlopen(request, timeout=600) as r:
        usage = json.load(r)['usage']
      cached = (usage.get('prompt_tokens_details') or {}).get('cached_tokens') or 0
      done.append((usage['completion_tokens'], time.perf_counter() - t0, cached))
    return done

  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = [x for part in pool.map(client_loop, range(clients)) for x in part]
  seconds = time.perf_counter() - t0
  return (seconds, sum(r[0] for r in results), sum(r[1] for r in results) / len(results),
          sum(r[2] for r in results) / len(results))


def thread_cpu(pid: int) -> dict[str, tuple[str, float]]:
  """Each of a process's threads: its id -> (its OS name, CPU seconds so far) (/proc/PID/task:
  the Python threads share the interpreter's name, XLA's pools have theirs)."""
  ticks = os.sysconf('SC_CLK_TCK')
  cpu = {}
  for tid in os.listdir(f'/proc/{pid}/task'):
    try:
      with open(f'/proc/{pid}/task/{tid}/stat') as f:
        stat = f.read()
    except OSError:
      continue  # (ended meanwhile)
    name = stat[stat.index('(') + 1:stat.rindex(')')].rstrip('0123456789_-/')
    utime, stime = stat[stat.rindex(')') + 2:].split()[11:13]
    cpu[tid] = name, (int(utime) + int(stime)) / ticks
  return cpu


def engine_thread(py_spy: str, pid: int) -> str | None:
  """The OS id of the server's engine thread (`py-spy dump` lists each thread's id and name)."""
  out = subprocess.run([py_spy, 'dump', '--pid', str(pid)], capture_output=True, text=True,
                       timeout=120).stdout
  return next((line.split()[1] for line in out.splitlines()
               if line.startswith('Thread ') and line.rstrip().endswith('"engine"')), None)


def cpu_report(cpu0: dict, cpu1: dict, engine: str | None, tokens: int, seconds: float) -> str:
  """The CPU time a run took by thread (the engine's own apart), in microseconds per generated
  token, and the engine thread's share of the run's wall time."""
  used: collections.Counter = collections.Counter()
  for tid, (name, secs) in cpu1.items():
    used['engine thread' if tid == engine else name] += secs - cpu0.get(tid, (name, 0.0))[1]
  share = (f'engine thread on the CPU {100 * used["engine thread"] / seconds:.1f}% of the run'
           if engine is not None else "engine thread not found by `py-spy dump`: no share")
  return ('  CPU µs a generated token by thread: ' + ', '.join(
      f'{k} {1e6 * v / max(tokens, 1):.1f}' for k, v in used.most_common() if v >= 0.05)
      + f'\n  {share}')


def engine_profile(raw: str, top: int = 8) -> str:
  """The engine thread's samples in py-spy's raw output split into jax and the host's own (the
  samples waiting for work left out), with the host's `top` functions by own samples."""
  jax_n = host_n = 0
  own: collections.Counter = collections.Counter()
  for line in raw.splitlines():
    stack, _, count = line.rpartition(' ')
    frames = stack.split(';')
    if not frames[0].endswith(': engine') or any('Scheduler.wait ' in f for f in frames):
      continue
    if any('jax/_src/' in f or 'jaxlib/' in f for f in frames):
      jax_n += int(count)
    else:
      host_n += int(count)
      own[frames[-1].split(' (')[0] + ' ' + frames[-1].rsplit('/', 1)[-1].rstrip(')')] += int(count)
  total = max(jax_n + host_n, 1)
  lines = [f'  engine thread: {total} samples busy, host {100 * host_n / total:.1f}%, '
           f'jax {100 * jax_n / total:.1f}%']
  lines += [f'    {100 * n / total:5.1f}%  {name}' for name, n in own.most_common(top)]
  return '\n'.join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', default='runs/default', help='Run to serve (without --url).')
  p.add_argument('--url', default='', help='A running server, e.g. http://127.0.0.1:8000/v1.')
  p.add_argument('--clients', default='1,16', help='Concurrent clients, comma-separated.')
  p.add_argument('--requests', type=int, default=48, help='Requests per client count.')
  p.add_argument('--max_tokens', type=int, default=64, help='Tokens generated per request.')
  p.add_argument('--serve_args', default='', help='Extra flags for jax_pretrain.serve.')
  p.add_argument('--api_key', default=os.environ.get('JAX_PRETRAIN_API_KEY', ''),
                 help="The server's API key, if it asks for one (default: $JAX_PRETRAIN_API_KEY).")
  p.add_argument('--system_prompt', type=int, default=0,
                 help='Characters of one system prompt put before every prompt.')
  p.add_argument('--py_spy', default='',
                 help="py-spy's command: the engine thread's CPU in each run, then a profile.")
  a = p.parse_args()
  server, url = (None, a.url) if a.url else start(a.workdir, a.serve_args)
  try:
    name = model_name(url, a.api_key)
    system = system_prompt(a.system_prompt)
    print(f'{"clients":>7}  {"requests":>8}  {"seconds":>8}  {"requests/s":>10}  {"tokens/s":>9}  '
          f'{"latency s":>9}  {"cached":>6}')
    for clients in (int(c) for c in a.clients.split(',')):
      run(url, name, clients, max(clients, 16), a.max_tokens, a.api_key, system)  # (compiles)
      measure = bool(a.py_spy) and server is not None
      if measure:
        engine = engine_thread(a.py_spy, server.pid)
        cpu0 = thread_cpu(server.pid)
      seconds, tokens, latency, cached = run(url, name, clients, a.requests, a.max_tokens,
                                             a.api_key, system)
      print(f'{clients:>7}  {a.requests:>8}  {seconds:>8.2f}  {a.requests / seconds:>10.2f}  '
            f'{tokens / seconds:>9.1f}  {latency:>9.2f}  {cached:>6.0f}', flush=True)
      if measure:
        print(cpu_report(cpu0, thread_cpu(server.pid), engine, tokens, seconds))
        out = f'/tmp/benchmark_serve_{server.pid}_{clients}.txt'
        spy = subprocess.Popen([a.py_spy, 'record', '--pid', str(server.pid), '--threads',
                                '--idle', '--rate', '200', '--format', 'raw', '-o', out],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)  # (attached)
        run(url, name, clients, a.requests, a.max_tokens, a.api_key, system)
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=120)
        with open(out) as f:
          print(engine_profile(f.read()), flush=True)
  finally:
    if server is not None:
      server.terminate()
      server.wait(timeout=60)


if __name__ == '__main__':
  main()
