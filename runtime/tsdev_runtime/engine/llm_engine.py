"""The engine: requests in, one scheduled step at a time, token ids out (`StepOutputs`; the text, stop strings and
logprob objects are made by whoever consumes them: runtime/tsdev_runtime/engine/outputs.py). What the server is doing
and every operation that pauses serving (reload, sleep, wake, weight loads, graph captures) are its control's,
`LLMEngine.control` (runtime/tsdev_runtime/engine/control.py).

With async scheduling (the default) a step is launched before the previous one's results are read: the
host schedules and prepares step N+1 while the GPU computes step N, and its rows that decode take N's
sampled tokens on the GPU (a PENDING placeholder on the host until N is read). A sequence that stops at
N (EOS) has computed one token too many in N+1; that token is dropped. A stop string is found by the consumer,
which ends the request with `abort(request_id, "stop")`; tokens drawn for it until then are dropped there.
"""
import atexit
import collections
import functools
import gc
import time
from itertools import chain
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.control_protocol import EngineInfo
from tsdev_runtime.engine import compiles
from tsdev_runtime.engine.block_manager import BlockManager
from tsdev_runtime.engine.control import EngineControl
from tsdev_runtime.engine.errors import describe_error
from tsdev_runtime.engine.model_runner import Checkpoint, ModelRunner, step_range
from tsdev_runtime.engine.outputs import Finish, OutputProcessor, StepOutputs
from tsdev_runtime.engine.ranks import follow
from tsdev_runtime.engine.scheduler import ScheduledBatch, Scheduler
from tsdev_runtime.engine.sequence import PENDING, SamplingParams, Sequence, Status, check_prompt, check_sampling
from tsdev_runtime.sampling.sampler import Sampled
from tsdev_runtime.weights.checkpoint import checkpoint_files, read_entries


_frozen_by_an_engine = False  # `freeze_heap` ran in this process since the last `thaw_heap`


def thaw_heap(collect: bool) -> None:
    """Hand what an earlier engine froze back to Python's cyclic collector; `collect` (on a GPU) collects now, so an
    engine that became garbage (a test's, a benchmark's) is freed before a new one sizes its KV pool to the memory
    left. Otherwise (the CPU, whose pool does not depend on free memory) `freeze_heap`'s collection at the end of
    startup frees it: one walk of the heap instead of two (in a test process each walk takes ~0.4 s).
    No engine froze anything (a server's first engine): nothing to do, `freeze_heap` collects at the end of startup
    (what a restart's standby froze before it became the server -- the libraries and the project, imported -- stays
    frozen: that collection walks only what the start made)."""
    global _frozen_by_an_engine
    if _frozen_by_an_engine:
        _frozen_by_an_engine = False
        gc.unfreeze()
        if collect:
            gc.collect()


def freeze_heap() -> None:
    """Collect, then move every object left into the collector's permanent generation (`gc.freeze`, as vLLM's
    engine does after its startup). Python's full collections otherwise walk all that torch, Triton and the
    model made, on the thread that steps: on the H200 such a walk takes 118-135 ms (0.3 ms frozen), and an
    nsys trace of a batch-256 decode loop showed a 98 ms host stall with no CUDA call in it. Objects made later
    (requests, a reload's new module objects) are collected as before; what startup made and a reload replaces
    stays until the next engine's `thaw_heap`."""
    global _frozen_by_an_engine
    gc.collect()
    gc.freeze()
    _frozen_by_an_engine = True
    # thawed at exit, so the interpreter's last collection frees them (Triton's bindings report as leaked what is
    # still alive then); one registration per process
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges and counters (/metrics, benchmarks); read between steps."""
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    prefix_cache_hits: int  # full pages found in the prefix cache
    prefix_cache_queries: int  # full pages looked up
    prompt_tokens: int  # prompt tokens computed (again after a preemption)
    generated_tokens: int
    steps: int  # steps launched
    decode_steps: int  # of those, steps in which every sequence computed one token
    rows: int  # sequences in the steps launched
    decode_rows: int  # sequences in the decode steps
    preemptions: int  # running sequences whose pages were freed for others (recomputed later)
    gpu_busy_seconds: float  # the GPU computing the steps (CUDA timing events; 0 elsewhere)
    gpu_idle_seconds: float  # the GPU waiting for the host while requests ran: between steps, during a step's prep
    finished: dict[str, int]  # requests finished, by finish reason

    @classmethod
    def of(cls, engine: "LLMEngine") -> "EngineStats":
        bm, sched = engine.block_manager, engine.scheduler
        return cls(
            running=len(sched.running), waiting=len(sched.waiting) + sum(map(len, engine.waiting_for.values())),
            kv_pages_used=bm.num_used_pages, kv_pages_total=bm.num_pages, prefix_cache_hits=bm.hits,
            prefix_cache_queries=bm.queries, prompt_tokens=engine.num_prompt_tokens,
            generated_tokens=engine.num_generated_tokens, steps=engine.num_steps, decode_steps=engine.num_decode_steps,
            rows=engine.num_rows, decode_rows=engine.num_decode_rows, preemptions=sched.num_preemptions,
            finished=dict(engine.num_finished), gpu_busy_seconds=engine.gpu_busy_seconds,
            gpu_idle_seconds=engine.gpu_idle_seconds)


@dataclass
class _Launched:
    """A step whose forward and sampling are queued on the GPU but whose tokens are not read yet."""
    batch: ScheduledBatch
    sampling: list[Sequence]
    positions: list[int]  # where each sampling sequence's PENDING placeholder sits in its token_ids
    sampled: Sampled | None  # on the device
    host: list[torch.Tensor] | None = None  # pinned copies of sampled.tensors(), complete once `ready` passed (CUDA)
    ready: object = None  # torch.cuda.Event (timing) after the step's GPU work and copies
    started: object = None  # torch.cuda.Event (timing) before the step's GPU work and its host preparation
    forward: object = None  # torch.cuda.Event (timing) once its inputs were prepared, before its forward
    waited: float = 0.0  # seconds `read` waited for the GPU to reach `ready`

    @property
    def in_flight(self):
        """What the runner needs to feed these tokens to the next step."""
        return None if self.sampled is None else (self.sampled.tokens, {s: i for i, s in enumerate(self.sampling)})

    def read(self) -> tuple[list[int], list | None, list | None]:
        """The tokens, and the (logprob, top values, top ids) lists of the drawn tokens and of the prompt rows."""
        if self.sampled is None:
            return [], None, None
        if self.ready is None:
            return self.sampled.unpack(self.sampled.tensors())
        start = time.perf_counter()
        self.ready.synchronize()
        self.waited = time.perf_counter() - start
        return self.sampled.unpack(self.host)

    def copy_out(self, started, forward) -> None:
        """CUDA: copy the sampled tensors into pinned host memory as the GPU gets there (`read` waits for `ready`),
        keeping the step's timing events: `started` before its GPU work, `forward` before its forward."""
        tensors = self.sampled.tensors()
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, device in zip(self.host, tensors):
            host.copy_(device, non_blocking=True)
        self.ready, self.started, self.forward = torch.cuda.Event(enable_timing=True), started, forward
        self.ready.record()

    def gpu_seconds(self, last_ready) -> tuple[float, float]:
        """Once read (CUDA): the GPU's idle seconds before this step -- since `last_ready` (the step read before it,
        None: no step ran just before), and while the host prepared its inputs (`started` completes once the GPU
        finished the work queued before it, `forward` once the host launched the forward) -- and its busy seconds,
        from its forward's launch to its tokens' copy. The events are complete once the step is read: the GPU runs
        the steps in order."""
        forward = self.forward or self.started
        idle = self.started.elapsed_time(forward) / 1e3
        if last_ready is not None:
            idle += last_ready.elapsed_time(self.started) / 1e3
        return idle, forward.elapsed_time(self.ready) / 1e3


class LLMEngine:
    """Requests (`add_request`, `abort`, `generate`), steps (`step`) and what a server or a benchmark reads (`stats`,
    `describe`); every control operation is `control`'s. Its runner, scheduler and block manager are its business."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None):
        """`checkpoint`: `open_checkpoint(config)`'s, when the caller opened it already."""
        start = time.perf_counter()
        thaw_heap(collect=torch.device(config.device).type == "cuda")
        self.config = config
        checkpoint = checkpoint or self.open_checkpoint(config)
        opened = time.perf_counter() - start  # the first use of the default model writes it
        self.model_dir, self.model_config, self.max_model_len = (checkpoint.dir, checkpoint.config,
                                                                 checkpoint.max_model_len)
        self.tokenizer_dir = config.tokenizer_dir(self.model_dir)
        tokenizer_file(self.tokenizer_dir)  # (a missing tokenizer fails now; it is read when first used: `tokenizer`)
        self.runner = ModelRunner(config, checkpoint)  # this rank's: the steps' forward, what it reads alone
        # the state, the lock, the calls every rank makes (`control.ranked`) and every operation that pauses serving
        self.control = EngineControl(self, self.runner)
        # the model's size: this process's parameters, or with several ranks (each holding a part) the checkpoint's
        self.num_parameters = (sum(p.numel() for p in self.runner.model.parameters()) if self.control.ranks is None
                               else sum(e.numel for e in read_entries(checkpoint_files(self.model_dir))))
        with compiles.install().expected():  # startup compiles every specialisation serving reaches
            self.startup_timings = {"checkpoint": opened, "load": time.perf_counter() - start - opened,
                                    **self.control.ranked.start()}
        self.block_manager = BlockManager(self.runner.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_running, config.max_batched_tokens,
                                   admitting=lambda: not self.control.holding)
        self.in_flight: _Launched | None = None
        self.free_slots = list(range(config.max_running))  # the sampler's state rows (penalties, logit_bias)
        self.waiting_for: dict[Sequence, list[Sequence]] = {}  # a prompt's first request -> requests sharing it
        self.eos = set(self.model_config.eos_token_ids)
        self.num_generated_tokens = self.num_prompt_tokens = 0
        self.num_finished: collections.Counter[str] = collections.Counter()
        self.num_steps = self.num_decode_steps = self.num_rows = self.num_decode_rows = 0
        self.step_seconds = self.gpu_wait_seconds = self.last_gpu_wait = 0.0  # `step`'s clock
        self.gpu_busy_seconds = self.gpu_idle_seconds = 0.0  # the GPU's, between the steps' timing events
        self._last_ready = None  # the timing event that ended the last step read, while steps follow each other
        self._on_cuda = torch.device(config.device).type == "cuda"
        freeze_heap()

    @staticmethod
    def open_checkpoint(config: EngineConfig) -> Checkpoint:
        """The checkpoint `config` names, checked (its directory, model config, context length) before any weight
        loads; the default model's is written on first use. What an engine of `config` will serve."""
        return Checkpoint.open(config)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, after: str | None = None) -> None:
        """Queue a request; `arrival_time` (time.monotonic(), default now) is when it reached the server. `after`:
        a request with the same prompt (choices of one `n` request): this one is admitted once that one computed
        the prompt, so that it finds the prompt's pages in the prefix cache instead of computing them again."""
        check_prompt(prompt_token_ids, self.max_model_len, self.model_config.vocab_size)
        check_sampling(params, self.model_config.vocab_size)
        seq = Sequence(request_id, prompt_token_ids, params, arrival_time, self.max_model_len)
        lead = self.scheduler.find(after) if after is not None and self.config.enable_prefix_caching else None
        if lead is not None and lead.num_computed_tokens < lead.num_prompt_tokens:
            self.waiting_for.setdefault(lead, []).append(seq)
        else:
            self.scheduler.add(seq)

    def abort(self, request_id: str, reason: str = "abort") -> StepOutputs | None:
        """End a request and free its pages now (`reason`: "abort", or "stop" when its consumer found a stop
        string); returns its finish, or None for a request that is not here (it finished already)."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            if (seq := take_follower(self.waiting_for, request_id)) is None:
                return None
            seq.status, seq.finish_reason = Status.FINISHED, reason
            self.num_finished[reason] += 1
            return finished([seq])
        self._finish(seq, reason)
        if seq.token_ids[-1] == PENDING:  # its in-flight token is dropped
            seq.token_ids.pop()
        return finished([seq])

    def abort_all(self, running_only: bool = False) -> StepOutputs:
        """Abort the running requests (and the waiting ones unless `running_only`); their finishes."""
        sched = self.scheduler
        seqs = (list(sched.running) if running_only  # (a copy: aborting removes them)
                else [*sched.running, *sched.waiting, *chain(*self.waiting_for.values())])
        outputs = StepOutputs()
        for seq in seqs:
            outputs.extend(self.abort(seq.request_id))
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None or bool(self.waiting_for)

    def drained(self) -> bool:
        """No admitted request is left running and no step is in flight (waiting ones may be queued)."""
        return not self.scheduler.running and self.in_flight is None

    def can_step(self) -> bool:
        """Whether a step has anything to do: requests running, waiting ones it may admit, a step to read."""
        return bool(self.scheduler.running or (self.scheduler.admitting() and self.scheduler.waiting) or self.in_flight)

    def prefill_all(self) -> None:
        """Step until no request is waiting or prefilling: from there on every step decodes (benchmarks)."""
        sched = self.scheduler
        while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
            self.step()

    def recover(self) -> tuple[StepOutputs, dict[str, str]]:
        """After a step raised (one rank), end the request it failed on alone: the steps in flight are forgotten, every
        running request is computed again (pages freed, unread tokens dropped, sampler slot restarted from its
        history), each alone, one step at a time, until it draws its next token. One whose step fails alone is
        aborted with the error; the others draw the tokens they would have anyway (a seeded draw depends on the seed
        and the output count only). Returns those steps' outputs and {request_id: error} of the aborted."""
        self.in_flight, sched = None, self.scheduler
        suspects = list(sched.running)
        for seq in suspects:
            seq.drop_unread()
            sched.preempt(seq)
            release_slot(seq, self.free_slots)
        outputs, failed = StepOutputs(), {}
        for seq in suspects:
            drawn, alone = seq.num_known_output_tokens, StepOutputs()
            try:
                with sched.alone(seq):
                    while (not seq.is_finished and seq.num_known_output_tokens == drawn
                           and (batch := sched.schedule()).seqs):
                        alone.extend(self._read(self._launch(batch)))
            except Exception as exc:
                self.in_flight = None
                seq.drop_unread()
                failed[seq.request_id] = describe_error(exc)
                outputs.extend(self.abort(seq.request_id) or StepOutputs())
                continue
            outputs.extend(alone)
        return outputs, failed

    def stats(self) -> EngineStats:
        return EngineStats.of(self)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, read when first used (`generate`, a single-process server): with the API process
        (tsdev serve's default) the engine's process never reads it -- 0.2-0.3 s of every start and restart."""
        return load_tokenizer(self.tokenizer_dir)

    @property
    def model(self) -> torch.nn.Module:
        """This rank's model (its parameters and buffers: benchmarks, the weights drill)."""
        return self.runner.model

    def describe(self) -> EngineInfo:
        runner, config = self.runner, self.config
        decode, prefill = runner.decode_graphs, runner.prefill_graphs
        return EngineInfo(
            model_dir=str(self.model_dir), architecture=self.model_config.architecture, device=config.device,
            dtype=str(runner.dtype).removeprefix("torch."), parameters=self.num_parameters,
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size, rank=config.rank,
            world_size=config.world_size, max_running=config.max_running, kv_pages=self.block_manager.num_pages,
            page_size=self.block_manager.page_size, decode_graph_sizes=list(decode.sizes) if decode else [],
            prefill_graph_buckets=list(prefill.buckets) if prefill else [],
            prefill_graphs_failed=prefill.disabled if prefill else None, quantization=config.quantization,
            kv_cache_dtype=str(runner.kv_cache.dtype).removeprefix("torch."),
            decode_graphs_used=sorted(decode.used) if decode else [],
            prefill_graphs_used=sorted(prefill.used) if prefill else [], graphs_pending=runner.graphs_pending)

    # --- steps -------------------------------------------------------------------------------------

    def step(self) -> StepOutputs:
        """Schedule and launch a step, then read the previous one (async scheduling) or this one. Its seconds and
        those it waited for the GPU's results accumulate in `step_seconds` and `gpu_wait_seconds` (the host's share
        of a step: the difference; on the CPU the forward itself is host time)."""
        start, self.last_gpu_wait = time.perf_counter(), 0.0
        try:
            with step_range("schedule"):
                batch = self.scheduler.schedule()
            launched = self._launch(batch) if batch.seqs else None
            previous, self.in_flight = self.in_flight, launched
            outputs = self._read(previous) if previous else StepOutputs()
            if launched and not self.config.async_scheduling:
                outputs.extend(self._read(launched))
                self.in_flight = None
            if launched is None:  # nothing runs now: the GPU's wait until the next request is not the host's share
                self._last_ready = None
            return outputs
        finally:
            self.step_seconds += time.perf_counter() - start
            self.gpu_wait_seconds += self.last_gpu_wait

    def _launch(self, batch: ScheduledBatch) -> _Launched:
        # prompt tokens computed (a recompute after preemption counts them again: they are computed again)
        self.num_prompt_tokens += sum(min(n, s.num_prompt_tokens - s.num_computed_tokens)
                                      for s, n in zip(batch.seqs, batch.num_tokens)
                                      if s.num_computed_tokens < s.num_prompt_tokens)
        self.num_steps += 1
        self.num_rows += len(batch.seqs)
        if max(batch.num_tokens) == 1:
            self.num_decode_steps += 1
            self.num_decode_rows += len(batch.seqs)
        sampling = batch.sampling
        starting = [s for s in sampling if s.params.needs_state and s.sampler_slot is None]
        for seq in starting:  # its first draw: the runner starts the slot's history from its prompt
            seq.sampler_slot, seq.init_slot = self.free_slots.pop(), True
        started = torch.cuda.Event(enable_timing=True) if self._on_cuda else None
        if started is not None:
            started.record()
        sampled = self.control.ranked.launch(batch, self.in_flight.in_flight if self.in_flight else None)
        for seq in starting:
            seq.init_slot = False
        for i, first, count in batch.prompt_rows:
            batch.seqs[i].prompt_logprob_next = first + count
        launched = _Launched(batch, sampling, [len(seq) for seq in sampling], sampled)
        for seq in sampling:
            seq.token_ids.append(PENDING)
        self.scheduler.advance(batch)
        if sampled is not None and sampled.tokens.is_cuda:
            launched.copy_out(started, self.runner.forward_started)
        return launched

    def _read(self, launched: _Launched) -> StepOutputs:
        """Wait for a launched step's tokens and hand them out; sequences that finished (or were aborted) since it
        was launched drop theirs."""
        tokens, drawn, prompt = launched.read()
        self.last_gpu_wait += launched.waited
        if launched.started is not None:  # CUDA: the GPU's time, idle before the step and busy in it
            idle, busy = launched.gpu_seconds(self._last_ready)
            self.gpu_idle_seconds += idle
            self.gpu_busy_seconds += busy
            self._last_ready = launched.ready
        out = StepOutputs()
        hand_out_logprobs(launched, drawn, prompt, out)
        live = [(seq, pos, token) for seq, pos, token in zip(launched.sampling, launched.positions, tokens)
                if seq.status is not Status.FINISHED]
        for seq, pos, token in live:
            seq.token_ids[pos] = token
        page, caching, waiting_for = self.block_manager.page_size, self.config.enable_prefix_caching, self.waiting_for
        for seq in launched.batch.seqs:
            if seq.status is not Status.FINISHED:
                if caching and seq.num_computed_tokens // page > len(seq.page_hashes):  # a page became full
                    self.block_manager.commit_full_pages(seq)
                if waiting_for and seq in waiting_for and seq.num_computed_tokens >= seq.num_prompt_tokens:
                    for follower in reversed(waiting_for.pop(seq)):  # its prompt's pages are cached now
                        self.scheduler.add(follower, first=True)
        self.num_generated_tokens += len(live)
        ended = []
        for seq, pos, token in live:
            if seq.params.max_tokens == 0:  # the prompt's logprobs were all it asked for: the token is dropped
                del seq.token_ids[pos:]
                self._finish(seq, "length")
                ended.append(seq)
                continue
            if pos == seq.num_prompt_tokens:
                out.started[seq.request_id] = (seq.first_scheduled_time, seq.num_cached_tokens)
            out.request_ids.append(seq.request_id)
            out.token_ids.append(token)
            if reason := finish_reason(seq, token, pos + 1, self.eos):
                del seq.token_ids[pos + 1 :]  # a token the next step sampled for it is dropped
                self._finish(seq, reason)
                ended.append(seq)
        if ended:
            out.finished = finished(ended).finished
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End a scheduled sequence: its pages and sampler slot go back; requests waiting for its prompt go on."""
        self.scheduler.finish(seq, reason)
        self.num_finished[reason] += 1
        release_slot(seq, self.free_slots)
        for follower in reversed(self.waiting_for.pop(seq, [])):
            self.scheduler.add(follower, first=True)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[dict]:
        """Offline: run prompts (token ids) to completion; returns token ids, text and finish reason per prompt, in
        order. Between steps only the requests with stop strings are detokenized (an OutputProcessor finds the
        stop); the others' text is decoded once, at the end."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        base = f"offline-{time.monotonic_ns()}-"
        ids = [base + str(i) for i in range(len(prompts))]
        processor = OutputProcessor(self.tokenizer)
        for request_id, p, sp in zip(ids, prompts, params):
            self.add_request(request_id, p, sp)
            if sp.stop:
                processor.add(request_id, len(p), sp)
        results = {request_id: {"token_ids": [], "text": ""} for request_id in ids}
        while self.has_unfinished():
            step = self.step()
            for request_id, token in zip(step.request_ids, step.token_ids):
                results[request_id]["token_ids"].append(token)
            for request_id, finish in step.finished.items():
                results[request_id]["finish_reason"] = finish.reason
            if processor.requests:
                outputs, stopped = processor.process(step)
                for request_id in stopped:
                    self.abort(request_id, "stop")
                for out in outputs:
                    results[out.request_id]["text"] += out.new_text
                    results[out.request_id]["finish_reason"] = out.finish_reason
        for request_id, sp in zip(ids, params):
            if not sp.stop:
                results[request_id]["text"] = self.tokenizer.decode(results[request_id]["token_ids"],
                                                                    skip_special_tokens=sp.skip_special_tokens)
        return list(results.values())


def finished(seqs: list[Sequence]) -> StepOutputs:
    return StepOutputs(finished={seq.request_id: Finish(seq.finish_reason, seq.num_cached_tokens,
                                                        seq.first_scheduled_time) for seq in seqs})


def finish_reason(seq: Sequence, token: int, length: int, eos: set[int]) -> str | None:
    """Whether the sequence ends with `token`, its `length`-th token (stop strings: the consumer's)."""
    if (token in eos and not seq.params.ignore_eos) or (seq.params.stop_token_ids
                                                        and token in seq.params.stop_token_ids):
        return "stop"
    if length >= seq.length_limit:
        return "length"
    return None


def hand_out_logprobs(launched: _Launched, drawn: list | None, prompt: list | None, out: StepOutputs) -> None:
    """The logprob lists of the drawn tokens (of the sequences still running), and each prompt row's with the prompt
    token it scores (in batch.prompt_rows order)."""
    if prompt is not None:
        r, batch = 0, launched.batch
        for i, first, count in batch.prompt_rows:
            seq = batch.seqs[i]
            out.prompt_logprobs[seq.request_id] = (seq.token_ids[first + 1 : first + 1 + count],
                                                   tuple(column[r : r + count] for column in prompt))
            r += count
    if drawn is not None:
        chosen, values, ids = drawn
        rows = [i for i, s in enumerate(launched.sampling) if s.params.logprobs is not None]
        out.logprobs = {launched.sampling[i].request_id: (chosen[r], values[r], ids[r]) for r, i in enumerate(rows)
                        if not launched.sampling[i].is_finished}


def take_follower(waiting_for: dict[Sequence, list[Sequence]], request_id: str) -> Sequence | None:
    """The request `request_id` if it waits for another's prompt, no longer waiting; else None."""
    for followers in waiting_for.values():
        if seq := next((f for f in followers if f.request_id == request_id), None):
            followers.remove(seq)
            return seq
    return None


def release_slot(seq: Sequence, free_slots: list[int]) -> None:
    """A sequence's sampler state row goes back (it finished, or starts again from its history)."""
    if seq.sampler_slot is not None:
        free_slots.append(seq.sampler_slot)
        seq.sampler_slot = None


def prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """The logits after `prompt` (token ids; its last position, float32, on the CPU) from one eager prefill outside
    the engine's scheduler, its pages taken and given back here: full-vocabulary logits of an idle engine
    (benchmarks)."""
    seq = Sequence("prompt-logits", prompt, SamplingParams(max_tokens=1, temperature=0))
    engine.block_manager.allocate(seq, len(prompt))
    try:
        return engine.runner.compute_logits(ScheduledBatch([seq], [len(prompt)]), use_graphs=False)[0].float().cpu()
    finally:
        engine.block_manager.free_pages(seq)


def tokenizer_file(tokenizer_dir: Path) -> Path:
    """tokenizer_dir's tokenizer.json; FileNotFoundError, saying what to do, when it has none."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{tokenizer_dir} has no tokenizer.json (a fast tokenizer is required): give the "
                                "directory of one with --tokenizer")
    return path


def load_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_file(tokenizer_dir)))


def serve_rank(config: EngineConfig, make_reloader=None) -> None:
    """What a rank other than 0 runs, once `distributed.init` joined it: its model runner (its shard of the
    weights, its heads' KV pool), following rank 0 until the engine stops. `make_reloader` builds this rank's
    reloader once the model code is imported (a reloader tracks the modules loaded when it is made)."""
    runner = ModelRunner(config, Checkpoint.open(config))
    freeze_heap()  # as rank 0's engine: its steps are no longer held up by full collections
    follow(runner, make_reloader() if make_reloader else None)
