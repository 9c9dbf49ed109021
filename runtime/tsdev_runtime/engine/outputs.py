"""What a step hands out, and what turns it into each request's output.

The loop that schedules and launches steps hands out token ids (`StepOutputs`, one per step): a row per sequence
read, the requests the engine ended (EOS, stop token ids, length, abort) and the raw logprob lists of the rows that
asked for them. Everything kept per request -- the text (detokenizing), stop strings, logprob objects, usage counts,
latency stamps -- is `OutputProcessor`'s, run by whoever consumes the steps (the server beside the engine's loop,
`LLMEngine.generate`). A stop string it finds ends the request in the engine (`LLMEngine.abort(request_id,
"stop")`); a token the engine drew for it meanwhile is dropped here.
"""
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from tsdev_runtime.engine.detokenizer import Detokenizer
from tsdev_runtime.engine.sequence import SamplingParams, TokenLogprob

# (logprob, top values, top ids) lists, one entry per row: what the sampler reads back for the rows that ask
LogprobLists = tuple[list, list, list]


@dataclass(frozen=True)
class Finish:
    """How the engine ended a request, and what its usage and queue-time figures need of it."""
    reason: str
    num_cached_tokens: int
    first_scheduled_time: float | None  # when the scheduler first admitted it (None: never)


@dataclass
class StepOutputs:
    """One step's results as token ids: `request_ids[i]` drew `token_ids[i]`; `finished` the requests it ended
    (with or without a token in this step); `logprobs` the drawn token's (logprob, top values, top ids) of the
    rows that asked; `prompt_logprobs` per request (targets, logprob lists) of the prompt positions it computed;
    `started` (first admitted, cached prompt tokens) of the requests that drew their first token."""
    time: float = field(default_factory=time.monotonic)  # when the tokens were read
    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finished: dict[str, Finish] = field(default_factory=dict)
    logprobs: dict[str, tuple[float, list, list]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[list[int], LogprobLists]] = field(default_factory=dict)
    started: dict[str, tuple[float | None, int]] = field(default_factory=dict)

    def extend(self, later: "StepOutputs") -> "StepOutputs":
        """These outputs followed by `later`'s (several steps' results handed out at once)."""
        self.time = later.time
        self.request_ids += later.request_ids
        self.token_ids += later.token_ids
        self.finished.update(later.finished)
        self.logprobs.update(later.logprobs)
        self.started.update(later.started)
        for request_id, (targets, lists) in later.prompt_logprobs.items():
            if request_id in self.prompt_logprobs:
                old_targets, old = self.prompt_logprobs[request_id]
                targets, lists = old_targets + targets, tuple(a + b for a, b in zip(old, lists))
            self.prompt_logprobs[request_id] = (targets, lists)
        return self


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache (known from the first token on)
    # time.monotonic() stamps for the server's latency metrics (as vLLM's RequestMetrics):
    arrival_time: float = 0.0  # when the request arrived (AsyncEngine.generate) or was added
    first_scheduled_time: float | None = None  # first admitted by the scheduler (known from the first token on)
    token_time: float | None = None  # when new_token_ids were read (None: no new token)
    previous_token_time: float | None = None  # when the request's previous token was read (None: none yet)
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., with the request's first output


def logprob_entries(lists: LogprobLists, tokens: list[int], top_ns: list[int]) -> list[TokenLogprob]:
    """TokenLogprobs from (logprob, top values, top ids) lists; each keeps its own top-N (the lists hold the
    largest any row asked for)."""
    chosen, values, ids = lists
    width = len(values[0]) if values else 0
    return [TokenLogprob(token, lp, i, v) if n == width else TokenLogprob(token, lp, i[:n], v[:n])
            for token, lp, v, i, n in zip(tokens, chosen, values, ids, top_ns)]


class _Request:
    """One request's state on the consuming side."""
    __slots__ = ("params", "num_prompt_tokens", "arrival_time", "detokenizer", "num_output_tokens",
                 "last_token_time", "prompt_logprobs", "sent_first", "first_scheduled_time", "num_cached_tokens")

    def __init__(self, tokenizer: Tokenizer, num_prompt_tokens: int, params: SamplingParams, arrival_time: float):
        self.params, self.num_prompt_tokens, self.arrival_time = params, num_prompt_tokens, arrival_time
        self.detokenizer = Detokenizer(tokenizer, params.stop, params.include_stop_str_in_output,
                                       params.skip_special_tokens)
        self.num_output_tokens = 0
        self.last_token_time: float | None = None
        self.prompt_logprobs: list[TokenLogprob] = []
        self.sent_first = False  # an output with a token (or the final one) went out: prompt logprobs go with it
        self.first_scheduled_time: float | None = None
        self.num_cached_tokens = 0


class OutputProcessor:
    """Turns the engine's `StepOutputs` into each request's `RequestOutput` (text, stop strings, logprobs, usage,
    latency stamps). Requests are added before the engine may read a token of theirs, and leave once finished."""

    def __init__(self, tokenizer: Tokenizer | Callable[[], Tokenizer]):
        """`tokenizer`, or what reads it when the first request is added (the engine's process behind the API
        process adds none: it never reads the tokenizer)."""
        self._tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer if isinstance(self._tokenizer, Tokenizer) else self._tokenizer()

    def add(self, request_id: str, num_prompt_tokens: int, params: SamplingParams,
            arrival_time: float | None = None) -> None:
        self.requests[request_id] = _Request(self.tokenizer, num_prompt_tokens, params,
                                             time.monotonic() if arrival_time is None else arrival_time)

    def drop(self, request_id: str) -> None:
        """Forget a request (it was refused, or its consumer left); later outputs of it are ignored."""
        self.requests.pop(request_id, None)

    def process(self, step: StepOutputs) -> tuple[list[RequestOutput], list[str]]:
        """The outputs of the requests in `step`, and the requests a stop string ended here, which the engine has
        not ended yet: end them there (`LLMEngine.abort(request_id, "stop")`)."""
        for request_id, (targets, lists) in step.prompt_logprobs.items():
            if (req := self.requests.get(request_id)) is not None:
                req.prompt_logprobs += logprob_entries(lists, targets, [req.params.prompt_logprobs] * len(targets))
        for request_id, (first_scheduled, cached) in step.started.items():
            if (req := self.requests.get(request_id)) is not None:
                req.first_scheduled_time, req.num_cached_tokens = first_scheduled, cached
        outputs, stopped = [], []
        finishes = dict(step.finished)
        for request_id, token in zip(step.request_ids, step.token_ids):
            req = self.requests.get(request_id)
            if req is None:  # ended here already (a stop string); the engine drew on until it learnt
                finishes.pop(request_id, None)
                continue
            req.num_output_tokens += 1
            hit = req.detokenizer.add(token, check_stop=req.num_output_tokens >= req.params.min_tokens)
            finish = finishes.pop(request_id, None)
            if hit and finish is None:
                stopped.append(request_id)
            lp = step.logprobs.get(request_id)
            entries = None if lp is None else logprob_entries(([lp[0]], [lp[1]], [lp[2]]), [token],
                                                              [req.params.logprobs])
            outputs.append(self._output(request_id, req, [token], step.time, finish,
                                        "stop" if hit else finish and finish.reason, entries))
        for request_id, finish in finishes.items():  # ended without a token in this step (abort, max_tokens 0)
            if (req := self.requests.get(request_id)) is not None:
                outputs.append(self._output(request_id, req, [], step.time, finish, finish.reason, None))
        return outputs, stopped

    def end_all(self, reason: str) -> list[RequestOutput]:
        """Every request's final output with `reason`, no token (a server stopping), what is known of each kept."""
        now = time.monotonic()
        return [self._output(request_id, req, [], now, None, reason, None)
                for request_id, req in list(self.requests.items())]

    def _output(self, request_id: str, req: _Request, tokens: list[int], now: float, finish: Finish | None,
                reason: str | None, logprobs: list[TokenLogprob] | None) -> RequestOutput:
        finished = reason is not None
        if finished:
            del self.requests[request_id]
        if finish is not None:
            req.first_scheduled_time, req.num_cached_tokens = finish.first_scheduled_time, finish.num_cached_tokens
        previous = req.last_token_time
        if tokens:
            req.last_token_time = now
        prompt_logprobs = None
        if not req.sent_first and (tokens or finished):
            req.sent_first = True
            prompt_logprobs = req.prompt_logprobs if req.params.prompt_logprobs is not None else None
        return RequestOutput(request_id, tokens, req.detokenizer.delta(finished), finished, reason,
                             req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens,
                             req.arrival_time, req.first_scheduled_time,
                             now if tokens else None, previous, logprobs, prompt_logprobs)
