"""Prometheus metrics of one engine, in their own registry."""
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from runtime.engine.llm_engine import LLMEngine


class EngineMetrics:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        self.running = Gauge("tsdev_requests_running", "Requests being computed", registry=r)
        self.waiting = Gauge("tsdev_requests_waiting", "Requests waiting for a slot or pages", registry=r)
        self.kv_pages_used = Gauge("tsdev_kv_pages_used", "KV cache pages in use", registry=r)
        self.kv_pages_total = Gauge("tsdev_kv_pages_total", "KV cache pages in the pool", registry=r)
        self.prompt_tokens = Counter("tsdev_prompt_tokens", "Prompt tokens computed", registry=r)
        self.generation_tokens = Counter("tsdev_generation_tokens", "Tokens generated", registry=r)
        self.tokens_per_second = Gauge("tsdev_generation_tokens_per_second",
                                       "Generated tokens per second over the last few seconds", registry=r)
        self.step_seconds = Histogram("tsdev_step_seconds", "Engine step time", registry=r,
                                      buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
        # Read at scrape time, so they are right even while the engine is idle.
        self.running.set_function(lambda: engine.stats().running)
        self.waiting.set_function(lambda: engine.stats().waiting)
        self.kv_pages_used.set_function(lambda: engine.stats().kv_pages_used)
        self.kv_pages_total.set(engine.stats().kv_pages_total)
        hit_rate = Gauge("tsdev_prefix_cache_hit_rate", "Full pages found in the prefix cache / pages looked up",
                         registry=r)
        hit_rate.set_function(lambda: (s := engine.stats()).prefix_cache_hits / max(s.prefix_cache_queries, 1))
        self._window_start, self._window_tokens = time.monotonic(), 0
        self._seen_prompt = self._seen_generated = 0

    def on_step(self, seconds: float, outputs) -> None:
        stats = self.engine.stats()
        self.step_seconds.observe(seconds)
        self.prompt_tokens.inc(stats.prompt_tokens - self._seen_prompt)
        generated = stats.generated_tokens - self._seen_generated
        self.generation_tokens.inc(generated)
        self._seen_prompt, self._seen_generated = stats.prompt_tokens, stats.generated_tokens
        self._window_tokens += generated
        elapsed = time.monotonic() - self._window_start
        if elapsed >= 2.0:
            self.tokens_per_second.set(self._window_tokens / elapsed)
            self._window_start, self._window_tokens = time.monotonic(), 0
