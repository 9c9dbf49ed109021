"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences first (decodes before unfinished prefills, oldest first), then waiting
ones while budget, slots and pages last. Prefill chunks and decodes share one step. When pages run
out, the newest running sequence is preempted: its pages are freed and it is recomputed later
(its full pages usually come straight back from the prefix cache).
"""
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from tsdev_runtime.engine.block_manager import BlockManager
from tsdev_runtime.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens computed for each sequence in this step
    # Whether each sequence reaches its last token in this step, so its next token is sampled (fixed when
    # the batch is made: the step advances num_computed_tokens afterwards).
    sample_rows: list[bool] = field(init=False)
    sampling: list[Sequence] = field(init=False)  # the sequences that sample this step, in batch order
    # (batch index, first position, count): prompt positions whose logits this step also returns, for the
    # prompt logprobs a request asked for (each position's logits give the next prompt token's logprob)
    prompt_rows: list[tuple[int, int, int]] = field(init=False)

    def __post_init__(self):
        self.sample_rows = [s.num_computed_tokens + n == len(s) for s, n in zip(self.seqs, self.num_tokens)]
        self.sampling = [s for s, samples in zip(self.seqs, self.sample_rows) if samples]
        self.prompt_rows = [(i, first, last - first) for i, (s, n) in enumerate(zip(self.seqs, self.num_tokens))
                            if s.params.prompt_logprobs is not None
                            and (first := max(s.num_computed_tokens, s.prompt_logprob_next))
                            < (last := min(s.num_computed_tokens + n, s.num_prompt_tokens - 1))]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_running: int, max_batched_tokens: int,
                 admitting: Callable[[], bool] = lambda: True):
        self.block_manager = block_manager
        self.max_running, self.max_batched_tokens = max_running, max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # False while the engine holds (its control's phase: runtime/tsdev_runtime/engine/control.py): waiting ones
        # stay queued
        self.admitting = admitting

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue `seq`; `first`: ahead of every waiting sequence (requests that waited for another's prompt)."""
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget, page = self.max_batched_tokens, self.block_manager.page_size
        scheduled: dict[Sequence, int] = {}
        running = self.running
        decoding = [s for s in running if len(s.token_ids) - s.num_computed_tokens <= 1]
        if len(decoding) < len(running):  # decodes first, then unfinished prefills
            decoding += [s for s in running if len(s.token_ids) - s.num_computed_tokens > 1]
        for seq in decoding:
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            length = len(seq.token_ids)
            if length >= seq.length_limit:
                continue  # its last token is being sampled by the step in flight
            n = min(length - seq.num_computed_tokens, budget)
            if n == 1 and seq.num_computed_tokens % page:  # a decode inside its last page: no page to allocate
                scheduled[seq] = 1
                budget -= 1
                continue
            while not self.block_manager.allocate(seq, n):
                victim = self.running[-1]
                budget += scheduled.pop(victim, 0)
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled[seq] = n
                budget -= n
        while self.admitting() and self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if not seq.pages and seq.params.prompt_logprobs is None:  # those compute every prompt position
                self.block_manager.match_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if not self.block_manager.allocate(seq, n):
                self.block_manager.free_pages(seq)
                break
            self.waiting.popleft()
            self.block_manager.count_lookup(seq)
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:  # (a preempted sequence is admitted again later)
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            scheduled[seq] = n
            budget -= n
        return ScheduledBatch(list(scheduled), list(scheduled.values()))

    def advance(self, batch: ScheduledBatch) -> None:
        """Record that the batch's tokens are (being) computed into the KV cache. The engine registers full
        pages in the prefix cache once the batch's sampled tokens are known."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.block_manager.free_pages(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in (*self.running, *self.waiting) if s.request_id == request_id), None)

    @contextmanager
    def alone(self, seq: Sequence) -> Iterator[None]:
        """Schedule the waiting `seq` alone meanwhile (finding the request a failed step fails on): the others are set
        aside and come back after, the running ones still running, the waiting ones first in the queue."""
        running, waiting = self.running, self.waiting
        waiting.remove(seq)
        self.running, self.waiting = [], deque([seq])
        try:
            yield
        finally:
            running += self.running
            waiting.extendleft(reversed(self.waiting))
            self.running, self.waiting = running, waiting

    def preempt(self, seq: Sequence) -> None:
        """Free its pages and queue it first: it is computed again (its full pages usually from the prefix cache)."""
        self.block_manager.free_pages(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
