"""A locustfile for benchmarks/bench_client_cpu.py: streamed completions, as `tsdev bench` sends them, and the CPU
locust spends on them (printed when REQUESTS requests are done; locust is not a tsdev dependency: install it in
a venv of its own)."""
import json
import os
import random
import time

from locust import FastHttpUser, constant, events, task

REQUESTS = int(os.environ.get("REQUESTS", 2000))
INPUT_LEN, OUTPUT_LEN = int(os.environ.get("INPUT_LEN", 16)), int(os.environ.get("OUTPUT_LEN", 32))
state = {"done": 0, "cpu": 0.0, "events": 0}


@events.test_start.add_listener
def _start(environment, **kwargs):
    state["cpu"] = time.process_time()


class Streamer(FastHttpUser):
    wait_time = constant(0)

    @task
    def complete(self):
        body = {"prompt": [random.randrange(1000) for _ in range(INPUT_LEN)], "max_tokens": OUTPUT_LEN,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}
        for line in self.client.iter_lines("/v1/completions", method="POST", json=body):
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])
                state["events"] += 1
        state["done"] += 1
        if state["done"] == REQUESTS:
            cpu = time.process_time() - state["cpu"]
            print(f"locust: {REQUESTS} requests, {state['events']} events, client CPU {cpu:.2f} s = "
                  f"{1e3 * cpu / REQUESTS:.2f} ms per request", flush=True)
            os._exit(0)  # runner.quit() leaves the headless process running
