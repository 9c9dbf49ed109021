"""Prometheus metrics: the engine's (`EngineMetrics`, kept where the engine steps) and the requests' latencies
(`RequestMetrics`, kept where the requests' outputs are made: beside the engine, or in the API process), each in
its own registry.

The request latencies have vLLM's meaning and names (tsdev_ for vllm:): time to first token and end-to-end
latency from the request's arrival, inter-token latency between two tokens of one request, queue time from
arrival to the first time the scheduler admitted it. They are taken from the stamps each RequestOutput
carries (`RequestMetrics.observe`).
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from tsdev_runtime.engine.compiles import jit_compiles
from tsdev_runtime.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from tsdev_runtime.engine.llm_engine import LLMEngine

# vLLM's buckets, with finer ones below 10 ms for inter-token latency (a decode step here can take 5 ms).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, *REQUEST_BUCKETS)


class CountedHistogram:
    """A Prometheus histogram that takes n equal observations at once: the decodes of one step share their
    inter-token latency, so a step costs one bucket search per distinct value, not one per token. Observed
    and collected on the event loop's thread."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry,
                 model_name: str):
        self.name, self.documentation, self.bounds, self.model_name = name, documentation, list(buckets), model_name
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, float("inf")], self.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([self.model_name], buckets, self.sum)
        return [family]


class CountsAtScrape:
    """A counter family by one label, read from the engine's own counts at scrape time (nothing to keep in step):
    vLLM's request_success_total by finish reason (aborts never pass through a step's outputs), Triton compiles
    by kernel (startup's, reloads', and any while serving, each of those also a warning:
    runtime/tsdev_runtime/engine/compiles.py)."""

    def __init__(self, name: str, documentation: str, label: str, read: Callable[[], dict[str, int]],
                 model_name: str, registry: CollectorRegistry):
        self.name, self.documentation, self.label, self.read, self.model_name = (name, documentation, label, read,
                                                                                 model_name)
        registry.register(self)

    def describe(self):
        return [CounterMetricFamily(self.name, self.documentation, labels=["model_name", self.label])]

    def collect(self):
        family = self.describe()[0]
        for value, count in sorted(self.read().items()):
            family.add_metric([self.model_name, value], count)
        return [family]


class EngineMetrics:
    """Every metric carries vLLM's `model_name` label (the served model's name)."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        label = dict(labelnames=["model_name"], registry=r)

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, **label).labels(model_name)

        self.running = gauge("tsdev_requests_running", "Requests being computed")
        self.waiting = gauge("tsdev_requests_waiting", "Requests waiting for a slot or pages")
        self.kv_pages_used = gauge("tsdev_kv_pages_used", "KV cache pages in use")
        self.kv_pages_total = gauge("tsdev_kv_pages_total", "KV cache pages in the pool")
        self.prompt_tokens = Counter("tsdev_prompt_tokens", "Prompt tokens computed", **label).labels(model_name)
        self.generation_tokens = Counter("tsdev_generation_tokens", "Tokens generated", **label).labels(model_name)
        self.preemptions = Counter("tsdev_num_preemptions", "Requests preempted (their pages freed, recomputed "
                                   "later) because the KV pool ran out", **label).labels(model_name)
        CountsAtScrape("tsdev_request_success", "Requests finished, by finish reason", "finished_reason",
                       lambda: engine.stats().finished, model_name, r)
        CountsAtScrape("tsdev_jit_compiles", "Triton kernel compiles in this process, by kernel", "kernel",
                       jit_compiles, model_name, r)
        self.tokens_per_second = gauge("tsdev_generation_tokens_per_second",
                                       "Generated tokens per second over the last few seconds")
        step_buckets = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
        self.step_seconds = Histogram("tsdev_step_seconds", "Engine step time", **label,
                                      buckets=step_buckets).labels(model_name)
        self.step_host_seconds = Histogram(
            "tsdev_step_host_seconds", "Engine step time on the host: the step less its wait for the GPU's results "
            "(on the CPU the forward itself is host time)", **label, buckets=step_buckets).labels(model_name)
        # Read at scrape time, so they are right even while the engine is idle.
        self.running.set_function(lambda: engine.stats().running)
        self.waiting.set_function(lambda: engine.stats().waiting)
        self.kv_pages_used.set_function(lambda: engine.stats().kv_pages_used)
        self.kv_pages_total.set(engine.stats().kv_pages_total)
        gauge("tsdev_gpu_busy_seconds", "Seconds the GPU computed the steps (CUDA timing events; 0 on the CPU)"
              ).set_function(lambda: engine.stats().gpu_busy_seconds)
        gauge("tsdev_gpu_idle_seconds", "Seconds the GPU waited for the host while requests ran: between two steps "
              "and while a step's inputs were prepared (CUDA timing events; 0 on the CPU)"
              ).set_function(lambda: engine.stats().gpu_idle_seconds)
        hit_rate = gauge("tsdev_prefix_cache_hit_rate", "Full pages found in the prefix cache / pages looked up")
        hit_rate.set_function(lambda: (s := engine.stats()).prefix_cache_hits / max(s.prefix_cache_queries, 1))
        self._window_start, self._window_tokens = time.monotonic(), 0
        self._seen_prompt = self._seen_generated = self._seen_preemptions = 0

    def on_step(self, seconds: float) -> None:
        stats = self.engine.stats()
        self.step_seconds.observe(seconds)
        self.step_host_seconds.observe(max(seconds - self.engine.last_gpu_wait, 0.0))
        self.prompt_tokens.inc(stats.prompt_tokens - self._seen_prompt)
        generated = stats.generated_tokens - self._seen_generated
        self.generation_tokens.inc(generated)
        self.preemptions.inc(stats.preemptions - self._seen_preemptions)
        self._seen_prompt, self._seen_generated = stats.prompt_tokens, stats.generated_tokens
        self._seen_preemptions = stats.preemptions
        self._window_tokens += generated
        elapsed = time.monotonic() - self._window_start
        if elapsed >= 2.0:
            self.tokens_per_second.set(self._window_tokens / elapsed)
            self._window_start, self._window_tokens = time.monotonic(), 0



class RequestMetrics:
    """The requests' latencies, from the stamps of their outputs."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.ttft = CountedHistogram("tsdev_time_to_first_token_seconds",
                                     "Time from a request's arrival to its first token", TTFT_BUCKETS, r, model_name)
        self.itl = CountedHistogram("tsdev_inter_token_latency_seconds",
                                    "Time between two consecutive tokens of a request", ITL_BUCKETS, r, model_name)
        self.e2e = CountedHistogram("tsdev_e2e_request_latency_seconds",
                                    "Time from a request's arrival to its last token (requests that finished "
                                    "by stop or length)", REQUEST_BUCKETS, r, model_name)
        self.queue_time = CountedHistogram("tsdev_request_queue_time_seconds",
                                           "Time from a request's arrival until the scheduler first admitted it",
                                           QUEUE_BUCKETS, r, model_name)

    def observe(self, outputs: list[RequestOutput]) -> None:
        """TTFT, ITL, end-to-end latency and queue time of a step's outputs (per output: a few float
        operations; the inter-token latencies go in grouped by value)."""
        gaps: dict[float, int] = {}
        for out in outputs:
            if out.token_time is not None:
                if out.previous_token_time is None:
                    self.ttft.observe(out.token_time - out.arrival_time)
                else:
                    gap = out.token_time - out.previous_token_time
                    gaps[gap] = gaps.get(gap, 0) + 1
            if out.finished:
                self.e2e.observe((out.token_time or time.monotonic()) - out.arrival_time)
                if out.first_scheduled_time is not None:
                    self.queue_time.observe(out.first_scheduled_time - out.arrival_time)
        for gap, n in gaps.items():
            self.itl.observe(gap, n)
