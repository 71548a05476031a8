"""Locust's client for scripts/loadtest_serve.py (which says how to run it): each user sends
completions (scripts/benchmark_serve.py's prompts and settings) at LOADTEST_USER_RATE requests/s at
most, and every answer is counted by its status; 429 (the server's backpressure) is an expected
answer, not a failure. At the end the counts and latencies go to the JSON file LOADTEST_OUT.

Environment: LOADTEST_USER_RATE, LOADTEST_MAX_TOKENS, LOADTEST_OUT, LOADTEST_API_KEY ('' for none).
"""
import collections
import json
import os
import random

import benchmark_serve  # (scripts/, this file's folder, is on locust's path)
import locust

PROMPTS = benchmark_serve.prompts(256)
MAX_TOKENS = int(os.environ.get('LOADTEST_MAX_TOKENS', '64'))
latencies: dict[str, list[float]] = collections.defaultdict(list)  # by status ('error': none)


class Client(locust.FastHttpUser):
  wait_time = locust.constant_throughput(float(os.environ['LOADTEST_USER_RATE']))
  network_timeout = 300.0  # a request unanswered this long counts as an error (lost)
  connection_timeout = 60.0

  @locust.task
  def complete(self):
    body = {'model': self.environment.parsed_options.model, 'prompt': random.choice(PROMPTS),
            'max_tokens': MAX_TOKENS, 'temperature': 0.8, 'seed': random.randrange(1 << 30)}
    key = os.environ.get('LOADTEST_API_KEY', '')
    headers = {'Authorization': f'Bearer {key}'} if key else {}
    with self.client.post('/v1/completions', json=body, headers=headers,
                          catch_response=True) as r:
      if r.status_code in (200, 429):
        r.success()
      else:
        r.failure(f'status {r.status_code}: {(r.text or getattr(r, "error", ""))!s:.200}')


@locust.events.init_command_line_parser.add_listener
def _options(parser):
  parser.add_argument('--model', default='default', help="The server's model name.")


@locust.events.request.add_listener
def _count(response_time, response, **_):
  status = getattr(response, 'status_code', 0)  # 0: no answer (a connection error, a timeout)
  latencies[str(status) if status else 'error'].append(response_time / 1000)


@locust.events.quitting.add_listener
def _write(environment, **_):
  with open(os.environ['LOADTEST_OUT'], 'w') as f:
    json.dump(latencies, f)
