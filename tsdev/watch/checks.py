"""What the daemon measures after every reload: a golden greedy completion and a decode-speed probe.

Both go through the public completions route, so they work against any seed-style server. The golden
prompt is token ids (no tokenizer in the way) and runs alone, greedy, with `ignore_eos`, so the same code
gives the same tokens (compared by id where the server returns them, vLLM's `return_token_ids`, else by
each streamed chunk's text: one chunk per engine step). The probe sends a fixed batch of streams and
takes, per stream, the time from its first token to its last over the steps between (the decode step
time), and the median over the streams.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import httpx

from tsdev.client import aiter_sse_data

if TYPE_CHECKING:
    from tsdev.watch.args import WatchConfig
    from tsdev.watch.link import ServerLink

GOLDEN_TOKENS = 24
PROMPT_LEN = 16


def prompt_ids(seed: int, vocab: int) -> list[int]:
    """A fixed, non-repeating prompt of token ids below `vocab` (ids under 256 exist in any byte-level BPE)."""
    span = max(2, min(vocab, 256))
    return [(11 + 37 * seed + 13 * i) % span for i in range(PROMPT_LEN)]


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[list, list[tuple[float, int]]]:
    """The generated tokens (ids where the server returns them, else each chunk's text) and, for each chunk, when
    it arrived and how many tokens had arrived with it."""
    tokens, arrivals = [], []
    body = {**body, "stream": True, "return_token_ids": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise httpx.HTTPStatusError(f"{response.status_code}: {response.text[:200]}", request=response.request,
                                        response=response)
        async for event in aiter_sse_data(response):
            if "error" in event:
                raise RuntimeError(event["error"].get("message", "the server failed the request"))
            if event.get("choices"):
                choice = event["choices"][0]
                tokens += choice["token_ids"] if "token_ids" in choice else [choice.get("text") or ""]
                arrivals.append((time.perf_counter(), len(tokens)))
    return tokens, arrivals


def seconds_per_token(arrivals: list[tuple[float, int]]) -> float | None:
    """The slope of arrival time over tokens received, the first chunk (the prefill's) left out: a least-squares
    fit over every chunk, so one late chunk (the daemon's or the server's event loop busy for 20 ms) moves it by
    a fraction of a percent, where the span from the first chunk to the last moved by 10-20 %."""
    decode = arrivals[1:]
    if len(decode) < 2 or decode[0][1] == decode[-1][1]:
        return None
    return statistics.linear_regression([count for _, count in decode], [t for t, _ in decode]).slope


async def greedy(client: httpx.AsyncClient, url: str, vocab: int, tokens: int = GOLDEN_TOKENS) -> list:
    body = {"prompt": prompt_ids(0, vocab), "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    return (await _stream(client, url, body))[0]


PROBE_AGREE = 0.03  # rounds within 3 % of each other: the figure is steady
PROBE_ROUNDS = (2, 5)  # the probe's rounds: at least, at most


async def until_steady(take_round: Callable[[], Awaitable[float]],
                       rounds: tuple[int, int] = PROBE_ROUNDS) -> list[float]:
    """Rounds (ms/step) one after another until two agree within PROBE_AGREE, or the most allowed.

    The figure is the faster of the fastest two rounds that agree (`steady_ms`): what slows a round only adds time,
    and a round alone far below the others is the client's, not the server's (its event loop held, the tokens read
    in one burst: 0.01 ms/step on a loaded 2-core machine). On the H200 the default model's decode at batch 8 is
    host-bound (the host ~95 % of the step, its time per step moving by 30 % from round to round at a fixed SM
    clock, benchmarks/probe_spread.py): one round moved by 11 % with nothing changed, the fastest of three by ±2 % on
    one host and by up to 17 % on a busier one."""
    figures = []
    while len(figures) < rounds[0] or (steady_ms(figures) is None and len(figures) < rounds[1]):
        figures.append(await take_round())
    return figures


def steady_ms(figures: list[float]) -> float | None:
    """The faster of the fastest two rounds within PROBE_AGREE of each other; None when no two agree."""
    ordered = sorted(figures)
    return next((a for a, b in zip(ordered, ordered[1:]) if b <= a * (1 + PROBE_AGREE)), None)


async def decode_ms(client: httpx.AsyncClient, url: str, vocab: int, batch: int, steps: int,
                    rounds: tuple[int, int] = PROBE_ROUNDS) -> list[float]:
    """Decode step time (ms) with `batch` streams of `steps` tokens running together, the median over the streams,
    of each round `until_steady` took."""
    async def one(i: int) -> float | None:
        body = {"prompt": prompt_ids(i + 1, vocab), "max_tokens": steps, "temperature": 0, "ignore_eos": True}
        return seconds_per_token((await _stream(client, url, body))[1])

    async def take_round() -> float:
        spans = [s for s in await asyncio.gather(*(one(i) for i in range(batch))) if s is not None]
        if not spans:
            raise RuntimeError("the probe got no tokens back")
        return statistics.median(spans) * 1e3
    return await until_steady(take_round, rounds)


@dataclass
class Verdict:
    """The golden completion compared with the one taken at startup (or with `g`)."""
    total: int
    position: int | None  # first differing token, None when identical

    @property
    def same(self) -> bool:
        return self.position is None

    def text(self) -> str:
        if self.same:
            return f"golden: same {self.total} tokens"
        return f"golden: output changed at token {self.position} of {self.total}"


def compare(expected: list, got: list) -> Verdict:
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return Verdict(len(expected), i)
    if len(expected) != len(got):
        return Verdict(len(expected), min(len(expected), len(got)))
    return Verdict(len(expected), None)


@dataclass
class Probe:
    rounds: list[float]  # ms/step of each round
    batch: int
    previous: float | None = None  # the last steady probe before this one
    first: bool = False  # the daemon's first probe: nothing to compare with, by design

    @property
    def ms(self) -> float:
        """The steady figure, else the rounds' median."""
        figure = steady_ms(self.rounds)
        return statistics.median(self.rounds) if figure is None else figure

    @property
    def steady(self) -> bool:
        return steady_ms(self.rounds) is not None

    @property
    def delta(self) -> float | None:
        return None if self.previous is None or not self.steady else self.ms - self.previous

    def text(self) -> str:
        line = f"decode {self.ms:.2f} ms/step at batch {self.batch}"
        if not self.steady:
            return line + (f" (unsteady, not compared: no two of {len(self.rounds)} rounds within "
                           f"{100 * PROBE_AGREE:.0f} %, {min(self.rounds):.2f}-{max(self.rounds):.2f} ms)")
        if self.delta is not None:
            line += f" ({self.delta:+.2f} ms, {100 * self.delta / self.previous:+.1f}%)"
        elif not self.first:
            line += " (not compared: no earlier figure was steady)"
        return line


class Checked(Protocol):
    """What the checks fill in: a reload's or a restart's record (tsdev/watch/records.py, which holds a Verdict and a
    Probe, so this module does not import it)."""
    n: int
    verdict: Verdict | None
    probe: Probe | None
    note: str


class Checker:
    """Runs the checks and keeps what they compare with: the golden completion and the last probe."""

    def __init__(self, link: ServerLink, config: WatchConfig, message: Callable[..., None]):
        self.link, self.config, self.message = link, config, message
        self.vocab = 256  # prompts stay below it (the server's vocabulary, once known)
        self.golden: list | None = None
        self.last_probe: float | None = None
        self.probes = 0  # taken so far
        self.profile_next = False  # `p`: record the next reload's probe
        self.device: str | None = None  # the server's (describe), for the probe's default length

    @property
    def probe_steps(self) -> int:
        if self.config.probe_steps is not None:
            return self.config.probe_steps
        return 128 if (self.device or "").startswith("cuda") else 32

    async def take_golden(self) -> None:
        """The completion later ones are compared with (raises httpx errors)."""
        self.golden = await greedy(self.link.client, self.link.url, self.vocab)
        if len(set(self.golden)) == 1:
            self.message("the golden completion is one token repeated (random weights?): the output check will "
                         "miss most edits; it is meaningful on a trained checkpoint", "warning")

    async def run(self, record: Checked, golden: bool, can_profile: bool) -> None:
        """Golden completion, then the decode probe, into `record`; the probe runs inside a profiler range
        when `p` armed it or --profile-each-reload asks (`can_profile`: a reload's probe, not a restart's)."""
        client, url, config = self.link.client, self.link.url, self.config
        try:
            if golden and self.golden:
                record.verdict = compare(self.golden, await greedy(client, url, self.vocab))
            if can_profile and (self.profile_next or config.profile_each_reload):
                self.profile_next = False
                if problem := await self.link.start_profile(f"watch-reload-{record.n}", self.probe_steps):
                    self.message(problem, "warning")
                else:
                    record.note = "profiled: the decode probe is recorded"
            rounds = await decode_ms(client, url, self.vocab, config.probe_batch, self.probe_steps)
            record.probe = Probe(rounds, config.probe_batch, self.last_probe, first=self.probes == 0)
            self.probes += 1
            if record.probe.steady:  # the next figure is compared with the last steady one
                self.last_probe = record.probe.ms
        except (httpx.HTTPError, RuntimeError) as exc:
            record.note = f"checks failed: {exc}"
