"""`tsdev bench`: an async load generator for OpenAI-compatible servers, with serving metrics.

Metrics follow `vllm bench serve`: TTFT (request sent -> first token), TPOT ((latency - TTFT) /
(output tokens - 1)), ITL (gaps between streamed chunks), end-to-end latency; throughput over the
whole run's wall time. Output token counts come from the server's final `usage`.

The client is aiohttp (as vLLM's benchmark's): on a 2-core machine the load generator shares the cores with
the server it measures, so its own CPU per request counts, and is reported (`client_cpu_ms_per_request`).
httpx, which the other clients use, spent 19 ms of CPU per streamed request with 400 at once (its connection
pool's work grows with the connections open), aiohttp 2.0 and locust 1.9 (2026-12-01; docs/benchmarks.md has the
client CPU per request against locust's).
"""
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import aiohttp

from tsdev_runtime.control_protocol import ErrorBody
from tsdev.client import auth_headers

CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789.,;"
WORDS = ("the quick brown fox jumps over a lazy dog while kernels run fast on every GPU in the rack").split()


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}  # --endpoint: a name or vLLM's path
DATASETS = {"random": "random", "jsonl": "jsonl", "custom": "jsonl"}  # --dataset-name (custom: vLLM's JSONL name)


@dataclass
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # completions | chat (or /v1/completions | /v1/chat/completions, as vLLM)
    model: str | None = None  # default: the server's first model
    num_prompts: int = 100
    input_len: int = 256  # the random dataset's (vLLM: --random-input-len)
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)], as vllm bench serve
    prompts_file: str | None = None  # JSONL: {"prompt": str | [ids], "max_tokens"?} or {"messages": [...]}
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf sends all at once
    max_concurrency: int | None = None
    ignore_eos: bool = True
    seed: int = 0
    warmup: int = 0
    timeout_s: float = 600.0
    dataset_name: str | None = None  # random | jsonl; default: jsonl when prompts_file is given

    def __post_init__(self) -> None:
        """vLLM's spellings become tsdev's: --endpoint /v1/chat/completions is chat, --dataset-name custom jsonl."""
        self.endpoint = {path: name for name, path in ENDPOINTS.items()}.get(self.endpoint.rstrip("/"), self.endpoint)
        if self.dataset_name is None:
            self.dataset_name = "jsonl" if self.prompts_file else "random"
        self.dataset_name = DATASETS.get(self.dataset_name, self.dataset_name)

    def check(self) -> None:
        """Raise ValueError with what to change for a bad combination of arguments."""
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint is completions or chat (vLLM's /v1/completions or /v1/chat/completions), "
                             f"not {self.endpoint!r}")
        if self.dataset_name not in DATASETS:
            raise ValueError(f"--dataset-name is random or jsonl (vLLM's custom), not {self.dataset_name!r}")
        if self.dataset_name == "jsonl" and not self.prompts_file:
            raise ValueError("--dataset-name jsonl reads its requests from --dataset-path FILE.jsonl: give one")
        if self.dataset_name == "random" and self.prompts_file:
            raise ValueError("--dataset-path is read by --dataset-name jsonl; the random dataset makes its prompts")
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be at least 1")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be at least 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("--random-range-ratio must be in [0, 1)")
        if self.request_rate <= 0:
            raise ValueError("--request-rate must be positive (or inf)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if self.prompts_file and not Path(self.prompts_file).is_file():
            raise ValueError(f"--dataset-path {self.prompts_file}: no such file")

    @classmethod
    def saved(cls, config: dict) -> "BenchConfig":
        """The config of a saved result (--save-result), also one saved before a field existed."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in known})


# What makes two runs comparable: the workload and how it is sent (not the server, the model name or warm-up).
# field -> its flag; the random dataset's lengths count only for it, the JSONL file only for jsonl.
WORKLOAD = {"endpoint": "--endpoint", "dataset_name": "--dataset-name", "prompts_file": "--dataset-path",
            "input_len": "--random-input-len", "output_len": "--random-output-len",
            "range_ratio": "--random-range-ratio", "num_prompts": "--num-prompts", "request_rate": "--request-rate",
            "max_concurrency": "--max-concurrency", "ignore_eos": "--ignore-eos", "seed": "--seed"}
RANDOM_ONLY, JSONL_ONLY = ("input_len", "output_len", "range_ratio"), ("prompts_file",)


def workload_differences(config: BenchConfig, baseline: BenchConfig) -> list[str]:
    """'--random-input-len: 64 in this run, 256 in the baseline', one per workload setting that differs."""
    skip = JSONL_ONLY if config.dataset_name == "random" else RANDOM_ONLY
    return [f"{flag}: {getattr(config, key)} in this run, {getattr(baseline, key)} in the baseline"
            for key, flag in WORKLOAD.items() if key not in skip and getattr(config, key) != getattr(baseline, key)]


@dataclass
class RequestRecord:
    ok: bool
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk, from start
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


def build_requests(config: BenchConfig, vocab: int, count: int, rng: random.Random) -> list[dict]:
    """Request bodies (without model/stream fields) for the chosen workload."""
    if config.dataset_name == "jsonl":
        lines = [json.loads(line) for line in Path(config.prompts_file).read_text().splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"--dataset-path {config.prompts_file} has no requests")
        return [dict(lines[i % len(lines)]) for i in range(count)]

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - config.range_ratio)), int(n * (1 + config.range_ratio))))

    bodies = []
    for _ in range(count):
        n_in, n_out = length(config.input_len), length(config.output_len)
        if config.endpoint == "chat":  # the text is fitted to n_in tokens by the server's tokenizer (fit_chat)
            body = {"messages": [{"role": "user", "content": ""}], "prompt_tokens": n_in}
        else:
            body = {"prompt": [rng.randrange(vocab) for _ in range(n_in)]}
        bodies.append({**body, "max_tokens": n_out})
    return bodies


async def fit_chat(session: aiohttp.ClientSession, url: str, model: str, bodies: list[dict],
                   rng: random.Random) -> None:
    """Each chat body's user message, of random words, sized so that its whole prompt -- the chat template's own
    tokens counted in -- has `prompt_tokens` tokens, as the server's /tokenize (vLLM's too) counts them."""
    per_word = 1.5  # tokens per word, learnt as messages are fitted

    async def count(words: list[str]) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": " ".join(words)}]}
        async with session.post(url.rstrip("/") + "/tokenize", json=body) as response:
            if response.status != 200:
                raise ValueError(f"--endpoint chat sizes its prompts with the server's /tokenize, which answered "
                                 f"{response.status}: {(await response.text(errors='replace'))[:200]}")
            return (await response.json())["count"]

    for body in bodies:
        want, words = body.pop("prompt_tokens"), []
        have = base = await count(words)
        for _ in range(40):  # a handful of tries each
            gap = want - have
            if gap == 0:
                break
            if 0 < gap <= 2:  # a character at a time, one that does not overshoot
                for char in rng.sample(CHARACTERS, len(CHARACTERS)):
                    words.append(char)
                    if (tried := await count(words)) <= want:
                        have = tried
                        break
                    words.pop()
                else:
                    break  # none fits: the nearest below
                continue
            if gap > 0:
                words += [rng.choice(WORDS) for _ in range(max(1, int(gap / per_word)))]
            else:
                del words[-max(1, int(-gap / per_word)):]
            have = await count(words)
            if words and have > base:
                per_word = max(0.5, (have - base) / len(words))
        body["messages"][0]["content"] = " ".join(words)


async def send(session: aiohttp.ClientSession, config: BenchConfig, model: str, body: dict) -> RequestRecord:
    path = ENDPOINTS[config.endpoint]
    payload = {"model": model, **body, "stream": True, "stream_options": {"include_usage": True},
               "ignore_eos": config.ignore_eos, "temperature": body.get("temperature", 0.0)}
    record = RequestRecord(ok=False, start=time.perf_counter())
    try:
        async with session.post(config.url.rstrip("/") + path, json=payload) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text(errors='replace'))[:300]}"
                return record
            stream = EventStream()
            async for chunk in response.content.iter_any():
                for event in stream.feed(chunk):
                    if not take_event(record, event):
                        return record
                if stream.done:
                    break
        record.latency = time.perf_counter() - record.start
        if record.ttft is None:
            record.ttft = record.latency
        record.ok = record.output_tokens > 0
        if not record.ok:
            record.error = "the stream ended without usage or output tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def take_event(record: RequestRecord, event: dict) -> bool:
    """Record one streamed event (a content chunk's arrival, the final usage); False for an error event."""
    if "error" in event:
        record.error = f"server error: {event['error'].get('message')}"
        return False
    now = time.perf_counter() - record.start
    for choice in event.get("choices") or ():
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text is not None and (text or choice.get("finish_reason") is None):
            if record.ttft is None:
                record.ttft = now
            record.chunk_times.append(now)
    if usage := event.get("usage"):
        record.prompt_tokens, record.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    return True


class EventStream:
    """An event stream's `data:` payloads, decoded, from the chunks as they arrive (lines of any length); `done`
    once `[DONE]` came. Plain calls per chunk, not an async generator per event: the client's CPU is measured."""
    decode = json.JSONDecoder().raw_decode

    def __init__(self):
        self.pending, self.done = b"", False

    def feed(self, chunk: bytes) -> list[dict]:
        *lines, self.pending = (self.pending + chunk).split(b"\n") if self.pending else chunk.split(b"\n")
        events = []
        for line in lines:
            if line[:5] == b"data:":
                data = line[5:].strip()
                if data == b"[DONE]":
                    self.done = True
                    break
                if data:
                    events.append(self.decode(data.decode())[0])
        return events


def summarize(records: list[RequestRecord], duration: float) -> dict:
    """The run's metrics (milliseconds for latencies, per second for throughputs)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft * 1e3 for r in ok]
    e2e = [r.latency * 1e3 for r in ok]
    tpot = [(r.latency - r.ttft) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    metrics = {
        "successful_requests": len(ok), "failed_requests": len(records) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "input_tokens": in_tokens, "output_tokens": out_tokens,
        "input_throughput": in_tokens / duration, "output_throughput": out_tokens / duration,
        "total_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2el_ms", e2e)):
        metrics.update(distribution(name, values))
    return metrics


def distribution(name: str, values: list[float]) -> dict:
    if not values:
        return {f"{stat}_{name}": None for stat in ("mean", "median", "p90", "p99")}
    ordered = sorted(values)
    return {f"mean_{name}": statistics.fmean(values), f"median_{name}": statistics.median(values),
            f"p90_{name}": percentile(ordered, 90), f"p99_{name}": percentile(ordered, 99)}


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def server_model(session: aiohttp.ClientSession, url: str) -> tuple[str, int]:
    """(first model id, a safe token-id range for random prompts)."""
    async with session.get(url.rstrip("/") + "/v1/models") as response:
        text = await response.text(errors="replace")
        if response.status in (401, 403):
            try:
                message = ErrorBody.model_validate_json(text).error.message
            except ValueError:
                message = text[:300]
            raise PermissionError(f"{url} refused the benchmark ({response.status}: {message})")
        response.raise_for_status()
    first = json.loads(text)["data"][0]
    return first["id"], min(first.get("vocab_size") or 1000, 10_000)


async def run_bench(config: BenchConfig, progress=None, api_key: str | None = None) -> dict:
    """Run the benchmark; `progress(done, total)` is called as requests finish. Returns metrics, config and records.
    `api_key`: the server's (sent as `Authorization: Bearer`), kept out of the config so that no result saves it."""
    config.check()
    rng = random.Random(config.seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=auth_headers(api_key),
                                     timeout=aiohttp.ClientTimeout(total=config.timeout_s)) as client:
        try:
            default_model, vocab = await server_model(client, config.url)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ConnectionError(f"cannot reach an OpenAI-compatible server at {config.url} ({exc}): "
                                  "start one (tsdev serve) or pass --url") from None
        model = config.model or default_model
        bodies = build_requests(config, vocab, config.warmup + config.num_prompts, rng)
        if config.endpoint == "chat" and config.dataset_name != "jsonl":
            await fit_chat(client, config.url, model, bodies, rng)
        for body in bodies[: config.warmup]:
            await send(client, config, model, body)
        semaphore = asyncio.Semaphore(config.max_concurrency or len(bodies))
        done = 0

        async def one(body: dict, delay: float) -> RequestRecord:
            nonlocal done
            await asyncio.sleep(delay)
            async with semaphore:
                record = await send(client, config, model, body)
            done += 1
            if progress:
                progress(done, config.num_prompts)
            return record

        delays, t = [], 0.0
        for _ in range(config.num_prompts):
            delays.append(t)
            if math.isfinite(config.request_rate):
                t += rng.expovariate(config.request_rate)
        start, cpu_start = time.perf_counter(), time.process_time()
        records = await asyncio.gather(*(one(b, d) for b, d in zip(bodies[config.warmup :], delays)))
        duration, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    errors = [r.error for r in records if not r.ok]
    metrics = summarize(records, duration)
    # what the load generator itself cost (on a small machine it competes with the server for the cores)
    metrics.update(client_cpu_s=cpu, client_cpu_ms_per_request=1e3 * cpu / len(records))
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model, "config": asdict(config),
            "metrics": metrics, "errors": errors[:10], "records": [asdict(r) for r in records]}


def quick(url: str, api_key: str | None = None) -> dict:
    """A few seconds of load for the TUI's `b` key: 16 requests, 64 in / 32 out, 8 at a time."""
    config = BenchConfig(url=url, num_prompts=16, input_len=64, output_len=32, max_concurrency=8)
    return asyncio.run(run_bench(config, api_key=api_key))


def quick_line(metrics: dict) -> str:
    """'output 812.3 tok/s, TTFT 41.2 ms, TPOT 9.87 ms, failed 0' (the watch log's line)."""
    parts = [f"{label} {metrics[key]:.{digits}f}{unit}" for key, label, digits, unit in (
        ("output_throughput", "output", 1, " tok/s"), ("mean_ttft_ms", "TTFT", 1, " ms"),
        ("mean_tpot_ms", "TPOT", 2, " ms"), ("failed_requests", "failed", 0, ""))
        if isinstance(metrics.get(key), (int, float))]
    return ", ".join(parts) or json.dumps(metrics)[:200]
