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
"""
import argparse
import concurrent.futures
import json
import os
from pydoc_data import topics
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


def run(url: str, name: str, clients: int, n: int, max_tokens: int,
        api_key: str = '') -> tuple[float, int, float]:
  """(seconds, completion tokens, mean latency) of n requests from `clients` threads."""
  work = prompts(n)

  def client_loop(k: int) -> list[tuple[int, float]]:
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
      done.append((usage['completion_tokens'], time.perf_counter() - t0))
    return done

  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = [x for part in pool.map(client_loop, range(clients)) for x in part]
  seconds = time.perf_counter() - t0
  return seconds, sum(t for t, _ in results), sum(s for _, s in results) / len(results)


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
  a = p.parse_args()
  server, url = (None, a.url) if a.url else start(a.workdir, a.serve_args)
  try:
    name = model_name(url, a.api_key)
    print(f'{"clients":>7}  {"requests":>8}  {"seconds":>8}  {"requests/s":>10}  {"tokens/s":>9}  '
          f'{"latency s":>9}')
    for clients in (int(c) for c in a.clients.split(',')):
      run(url, name, clients, max(clients, 16), a.max_tokens, a.api_key)  # compiles what it needs
      seconds, tokens, latency = run(url, name, clients, a.requests, a.max_tokens, a.api_key)
      print(f'{clients:>7}  {a.requests:>8}  {seconds:>8.2f}  {a.requests / seconds:>10.2f}  '
            f'{tokens / seconds:>9.1f}  {latency:>9.2f}', flush=True)
  finally:
    if server is not None:
      server.terminate()
      server.wait(timeout=60)


if __name__ == '__main__':
  main()
