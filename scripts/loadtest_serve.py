"""A load test of the OpenAI-compatible server at several times its capacity, with locust: every
request must be answered 200 or 429 (none lost, none hung), /health must answer quickly
throughout, and the server's memory must stay bounded.

  python -m venv /work/loadtest-venv && /work/loadtest-venv/bin/pip install locust  # once
  python scripts/loadtest_serve.py --workdir=runs/default --locust=/work/loadtest-venv/bin/locust

Steps: starts `python -m jax_pretrain.serve --warmup` on a free port (--serve_args adds flags);
measures its capacity C (requests/s) as scripts/benchmark_serve.py does with --clients concurrent
clients; then runs locust headless (at --nice) for --seconds (after RAMP_S seconds starting its
users) with --users users (by default 4 × the rate, plus one for each request the server can hold),
each pacing completions (benchmark_serve's prompts, --max_tokens each) so that together they offer
--factor × C requests/s (locust's constant_throughput: a user whose answer takes longer than its
interval offers less, so the rate offered is measured, not assumed). Meanwhile a thread asks /health
every --health_every seconds (a new connection each time, 10 s timeout) and samples the server's
resident memory (/proc/PID/status). After locust (its users finish the request in flight:
--stop-timeout) the server is stopped with SIGTERM and the seconds until it exits are measured.
Prints a summary and exits 1 when a check fails. A soak (issue 43: `--seconds=600`) also checks that
the server's resident memory, from the first minute of full load on, grows by --rss_growth percent
at most.

--saturate=SECONDS: instead of locust, --clients asyncio clients (httpx, loopback) send requests
one after the other for that long, no pause between (a 429 waits its Retry-After): random prompt
lengths (1 to what the context leaves after max_tokens), a third of them the prompt of the moment
(the same for every client within SHARED_S: several clients send it at once, as n > 1 and repeated
system prompts do), n 1 or 2, max_tokens 8 to --max_tokens, half of them streamed; /health is asked
every --health_every seconds as above. Checks: every request answered 200 or 429, /health's p99
and max within --health_p99 and --health_max seconds. E.g. issue 43's:

  python scripts/loadtest_serve.py --workdir=RUN --saturate=45 --clients=48 --health_every=0.05 \
      --serve_args='--slots=16 --context=256'
"""
import argparse
import asyncio
import collections
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import benchmark_serve
import httpx

HEALTH_LIMIT_S = 0.5
SHARED_S = 0.5  # --saturate: the prompt of the moment changes this often
RAMP_S = 5  # locust starts its users over this many seconds, before the --seconds of full load


def rss_mib(pid: int) -> float:
  with open(f'/proc/{pid}/status') as f:
    kib = next(int(line.split()[1]) for line in f if line.startswith('VmRSS:'))
  return kib / 1024


class Watch(threading.Thread):
  """Asks /health every `every` seconds and samples the server's RSS, until stop is set."""

  def __init__(self, health_url: str, pid: int, every: float):
    super().__init__(daemon=True)
    self.health_url, self.pid, self.every = health_url, pid, every
    self.stop = threading.Event()
    self.latencies: list[float] = []
    self.not_ok: list[str] = []  # what /health said when it was not 200 in time
    self.rss: list[float] = []
    self.times: list[float] = []  # when each RSS sample was taken (perf_counter)

  def run(self):
    while not self.stop.is_set():
      t0 = time.perf_counter()
      try:
        with urllib.request.urlopen(self.health_url, timeout=10) as r:
          r.read()
      except OSError as e:
        self.not_ok.append(f'{type(e).__name__}: {e}')
      self.latencies.append(time.perf_counter() - t0)
      self.rss.append(rss_mib(self.pid))
      self.times.append(time.perf_counter())
      self.stop.wait(self.every)


def percentile(xs: list[float], q: float) -> float:
  return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float('nan')


async def saturate(url: str, name: str, a: argparse.Namespace, context: int
                   ) -> dict[str, list[float]]:
  """--saturate's clients (the module docstring): the latencies of their requests by status
  ('error': no answer)."""
  text = ' '.join(benchmark_serve.prompts(2000)).encode('ascii', 'ignore').decode()  # (a byte a
  # character: a prompt of k characters is k tokens of the byte tokenizer)
  latencies: dict[str, list[float]] = collections.defaultdict(list)
  loop = asyncio.get_running_loop()
  end = loop.time() + a.saturate

  async def client(http: httpx.AsyncClient, k: int):
    r = random.Random(k)
    while loop.time() < end:
      max_tokens = r.randint(8, a.max_tokens)
      room = context - max_tokens - 2  # (the byte tokenizer: a token a character, and BOS)
      if r.random() < 1 / 3:
        moment = int(time.time() / SHARED_S)
        start = random.Random(moment).randrange(len(text) - room)
        prompt = text[start:start + random.Random(moment).randint(1, room)]
      else:
        start = r.randrange(len(text) - room)
        prompt = text[start:start + r.randint(1, room)]
      stream = r.random() < 0.5
      body = {'model': name, 'prompt': prompt, 'max_tokens': max_tokens, 'n': r.randint(1, 2),
              'temperature': 0.8, 'seed': r.randrange(1 << 30), 'stream': stream}
      t0 = time.perf_counter()
      try:
        async with http.stream('POST', f'{url}/completions', json=body) as response:
          async for _ in response.aiter_bytes():
            pass
        status = str(response.status_code)
      except httpx.HTTPError as e:
        status = f'error ({type(e).__name__})'
      latencies[status].append(time.perf_counter() - t0)
      if status == '429':
        await asyncio.sleep(float(response.headers.get('Retry-After', 1)))

  async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=a.clients)) as http:
    await asyncio.gather(*(client(http, k) for k in range(a.clients)))
  return latencies


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', default='runs/default', help='Run to serve.')
  p.add_argument('--locust', default='/work/loadtest-venv/bin/locust', help="locust's command.")
  p.add_argument('--serve_args', default='', help='Extra flags for jax_pretrain.serve.')
  p.add_argument('--factor', type=float, default=10, help='Load offered, in capacities.')
  p.add_argument('--capacity', type=float, default=0,
                 help='Requests/s the server sustains (0: measure it first).')
  p.add_argument('--clients', type=int, default=16, help='Concurrent clients measuring capacity.')
  p.add_argument('--seconds', type=int, default=60, help='Duration of the load.')
  p.add_argument('--users', type=int, default=0,
                 help='Locust users (0: 4 × the requests/s offered, plus one for each request the '
                 'server can hold (its slots and queue), so that the users waiting for answers '
                 'leave the whole rate to the others).')
  p.add_argument('--max_tokens', type=int, default=64, help='Tokens generated per request.')
  p.add_argument('--nice', type=int, default=10,
                 help="locust's niceness (0: the server's): where the generator shares the "
                 "server's cores, it yields them to the server, as a generator on a machine of its "
                 'own would.')
  p.add_argument('--rss_growth', type=float, default=5,
                 help='Resident memory growth allowed after the first minute of load, in percent '
                 '(checked where the load lasts longer than a minute: a soak).')
  p.add_argument('--health_every', type=float, default=0.2, help='Seconds between /health asks.')
  p.add_argument('--saturate', type=float, default=0,
                 help='Seconds of --clients asyncio clients instead of locust (the module '
                 'docstring); 0: locust.')
  p.add_argument('--health_p99', type=float, default=0.1, help='--saturate: /health p99 limit.')
  p.add_argument('--health_max', type=float, default=0.3, help='--saturate: /health max limit.')
  a = p.parse_args()
  if a.saturate:
    return main_saturate(a)

  server, url = benchmark_serve.start(a.workdir, a.serve_args)
  health_url = url.replace('/v1', '/health')
  try:
    name = benchmark_serve.model_name(url)
    capacity = a.capacity
    if not capacity:
      benchmark_serve.run(url, name, a.clients, a.clients, a.max_tokens)  # compiles what it needs
      seconds, _, _, _ = benchmark_serve.run(url, name, a.clients, 8 * a.clients, a.max_tokens)
      capacity = 8 * a.clients / seconds
    rate = a.factor * capacity
    limits = json.load(urllib.request.urlopen(health_url, timeout=10))
    held = limits['slots'] + limits['max_queued_sequences']  # requests of 1 sequence at most
    users = a.users or math.ceil(4 * rate) + held
    rss_before = rss_mib(server.pid)
    print(f'capacity {capacity:.1f} requests/s; offering {a.factor:g} × = {rate:.0f} requests/s '
          f'from {users} locust users for {a.seconds} s; server RSS {rss_before:.0f} MiB',
          flush=True)
    watch = Watch(health_url, server.pid, a.health_every)
    watch.start()
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, 'latencies.json')
      t0 = time.perf_counter()
      subprocess.run(
          [*(['nice', '-n', str(a.nice)] if a.nice else []), a.locust,
           '-f', os.path.join(os.path.dirname(__file__), 'locustfile_serve.py'),
           '--headless', '--host', url.removesuffix('/v1'), '--users', str(users),
           '--spawn-rate', str(users / RAMP_S), '--run-time', f'{a.seconds + RAMP_S}s',
           '--stop-timeout', '300',
           '--only-summary', '--loglevel', 'WARNING', '--model', name],
          env={**os.environ, 'LOADTEST_USER_RATE': str(rate / max(users - held, 1)),
               'LOADTEST_OUT': out,
               'LOADTEST_MAX_TOKENS': str(a.max_tokens)},
          check=False, timeout=a.seconds + 600)
      elapsed = time.perf_counter() - t0
      with open(out) as f:
        latencies = json.load(f)
    during = list(watch.rss)
    # (memory after the first minute of full load, the soak's baseline)
    later = [m for t, m in zip(watch.times, watch.rss) if t >= t0 + RAMP_S + 60]
    minute = later[0] if later else None
    time.sleep(5)  # the queue drains, then memory after
    watch.stop.set()
    watch.join()
    rss_after = rss_mib(server.pid)
    peak = max([*later, rss_after])  # (the soak's: its largest after the first minute)
    health = json.load(urllib.request.urlopen(health_url, timeout=10))
  finally:
    t0 = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    try:
      server.wait(timeout=120)
    except subprocess.TimeoutExpired:
      server.kill()
    exit_s = time.perf_counter() - t0

  sent = sum(len(v) for v in latencies.values())
  print(f'\n{sent} requests in {elapsed:.0f} s ({sent / elapsed:.0f}/s offered, '
        f'{sent / elapsed / capacity:.1f} × capacity):')
  for status, xs in sorted(latencies.items()):
    print(f'  {status}: {len(xs)} ({len(xs) / elapsed:.1f}/s), latency median '
          f'{statistics.median(xs):.3f} s, p99 {percentile(xs, 0.99):.3f} s, max {max(xs):.3f} s')
  print(f'/health: {len(watch.latencies)} asks, median {statistics.median(watch.latencies):.3f} '
        f's, p99 {percentile(watch.latencies, 0.99):.3f} s, max {max(watch.latencies):.3f} s; '
        f'{len(watch.not_ok)} not answered 200 {watch.not_ok[:3]}')
  print(f'server RSS: before {rss_before:.0f} MiB, during max {max(during):.0f} MiB, after '
        f'{rss_after:.0f} MiB' + (f'; after the first minute {minute:.0f} MiB, at most '
                                   f'{peak:.0f} MiB later: {100 * (peak / minute - 1):+.1f}%'
                                   if minute else '')
        + f'; queue after: busy {health["busy"]}, waiting {health["waiting"]}; '
        f'compiled programs: {limits["compiled_shapes"]} before, {health["compiled_shapes"]} '
        f'after ({health["compiling_shapes"]} still queued)')
  print(f'SIGTERM to exit: {exit_s:.1f} s (exit status {server.returncode})')
  failed = [what for what, bad in [
      ('a request was not answered 200 or 429', set(latencies) - {'200', '429'}),
      (f'/health took over {HEALTH_LIMIT_S} s or failed',
       max(watch.latencies) > HEALTH_LIMIT_S or watch.not_ok),
      ('the queue did not drain', health['busy'] or health['waiting']),
      (f'resident memory grew over {a.rss_growth:g}% after the first minute',
       minute and 100 * (peak / minute - 1) > a.rss_growth)] if bad]
  for what in failed:
    print(f'FAILED: {what}')
  sys.exit(1 if failed else 0)


def main_saturate(a: argparse.Namespace):
  """--saturate: the server, the clients for that long, /health asked meanwhile; the summary."""
  server, url = benchmark_serve.start(a.workdir, a.serve_args)
  health_url = url.replace('/v1', '/health')
  try:
    name = benchmark_serve.model_name(url)
    limits = json.load(urllib.request.urlopen(health_url, timeout=10))
    print(f'{a.clients} clients for {a.saturate:g} s; /health every {a.health_every:g} s; '
          f'{limits["compiled_shapes"]} programs compiled; load average {os.getloadavg()}',
          flush=True)
    watch = Watch(health_url, server.pid, a.health_every)
    watch.start()
    t0 = time.perf_counter()
    latencies = asyncio.run(saturate(url, name, a, limits['context']))
    elapsed = time.perf_counter() - t0
    watch.stop.set()
    watch.join()
    health = json.load(urllib.request.urlopen(health_url, timeout=10))
  finally:
    server.send_signal(signal.SIGTERM)
    try:
      server.wait(timeout=120)
    except subprocess.TimeoutExpired:
      server.kill()
  sent = sum(len(v) for v in latencies.values())
  print(f'{sent} requests in {elapsed:.0f} s; load average after {os.getloadavg()}')
  for status, xs in sorted(latencies.items()):
    print(f'  {status}: {len(xs)}, latency median {statistics.median(xs):.3f} s, p99 '
          f'{percentile(xs, 0.99):.3f} s, max {max(xs):.3f} s')
  h = watch.latencies
  print(f'/health: {len(h)} asks, median {statistics.median(h):.4f} s, p99 '
        f'{percentile(h, 0.99):.4f} s, max {max(h):.4f} s; {len(watch.not_ok)} not answered 200 '
        f'{watch.not_ok[:3]}')
  print(f'compiled programs: {limits["compiled_shapes"]} before, {health["compiled_shapes"]} '
        f'after; server RSS max {max(watch.rss):.0f} MiB')
  failed = [what for what, bad in [
      ('a request was not answered 200 or 429', set(latencies) - {'200', '429'}),
      (f'/health p99 over {a.health_p99} s', percentile(h, 0.99) > a.health_p99),
      (f'/health max over {a.health_max} s or not 200', max(h) > a.health_max or watch.not_ok),
  ] if bad]
  for what in failed:
    print(f'FAILED: {what}')
  sys.exit(1 if failed else 0)


if __name__ == '__main__':
  main()
