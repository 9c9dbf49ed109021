"""A request as the engine sees it: its tokens, its pages, and how far it has been computed."""
import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from tsdev_runtime.sampling.limits import MAX_LOGIT_BIAS, MAX_LOGPROBS

# The token a step still in flight samples: a placeholder at the end of token_ids until the engine reads
# the step's result. A step that computes that position takes the real id on the GPU.
PENDING = -1


class InvalidRequest(ValueError):
    """A request the engine cannot serve as sent; `field` names the request field to change (the server's 400)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class TokenLogprob(NamedTuple):
    """A token's log-probability under the model's raw distribution (log-softmax of the logits, before
    penalties, biases or temperature: vLLM's default) and the most likely tokens there, best first (ids and
    logprobs: the request's top-N; None for an echoed prompt's first token)."""
    token_id: int
    logprob: float | None
    top_ids: list[int] | None
    top_logprobs: list[float] | None


@dataclass
class SamplingParams:
    """What a request asks of sampling; vLLM's names and meanings. Penalties and `logit_bias` change the logits
    the draw sees, in vLLM's order: bias, then repetition (prompt and output tokens), then frequency and presence
    (output tokens only); `min_tokens` keeps EOS and `stop_token_ids` out until that many tokens came."""
    max_tokens: int = 16  # 0 only with prompt_logprobs: the prompt's logprobs and no generated token
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) means no top-k
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # per generated token: its logprob and the top-N (0: the token's only)
    prompt_logprobs: int | None = None  # the same for every prompt token but the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if self.max_tokens < 1 and not (self.max_tokens == 0 and self.prompt_logprobs is not None):
            raise ValueError(f"max_tokens must be at least 1 (0 only with prompt logprobs), got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (both: off) or positive, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            if (value := getattr(self, name)) is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_LOGPROBS}, got {value}")
        if not 0 < self.repetition_penalty <= 2 or not -2 <= self.presence_penalty <= 2 \
                or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("penalties: presence_penalty and frequency_penalty must be in [-2, 2], "
                             f"repetition_penalty in (0, 2]; got {self.presence_penalty}, {self.frequency_penalty}, "
                             f"{self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries: at most {MAX_LOGIT_BIAS}")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise ValueError(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self.top_k = max(self.top_k, 0)
        # the sampler's per-sequence state (token counts, the bias) is needed: see tsdev_runtime.sampling.sampler
        self.needs_state = bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                                or self.logit_bias)
        # anything beyond temperature / top-k / top-p: a step whose rows have none of it takes the plain path
        self.extras = self.needs_state or self.logprobs is not None or self.min_tokens > 0

    @property
    def generates(self) -> int:
        """Tokens the engine samples at most: one for max_tokens 0 (the prompt's logprobs need its prefill,
        which samples; that token is dropped)."""
        return max(self.max_tokens, 1)


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Raise InvalidRequest saying what to change if this prompt cannot be served."""
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty: send at least one token", "prompt")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequest(f"this model's maximum context length is {max_model_len} tokens (--max-model-len), but "
                             f"the prompt has {len(prompt_token_ids)}: shorten it (one token of the context must be "
                             "left to generate)", "prompt")
    _check_token_ids("prompt", prompt_token_ids, vocab_size)


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequest naming the field and its valid range for a value the sampler would index the logits
    with: a request that cannot run is refused before it shares a step with others."""
    _check_token_ids("logit_bias", params.logit_bias, vocab_size)
    _check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        if (value := getattr(params, name)) is not None and value > vocab_size:
            raise InvalidRequest(f"{name} {value} asks for more tokens than the vocabulary has ({vocab_size})", name)


def _check_token_ids(field: str, ids, vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{field}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})", field)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, max_model_len: int | None = None):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # the length at which it stops: max_tokens generated, or the context (max_model_len) full
        self.length_limit = min(self.num_prompt_tokens + params.generates, max_model_len or float("inf"))
        self.status = Status.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.pages: list[int] = []
        self.page_hashes: list[int] = []  # prefix-cache hash chain of the full pages computed so far
        self.finish_reason: str | None = None
        # time.monotonic() stamps for the latency metrics (vLLM's RequestMetrics)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None  # first admitted by the scheduler
        # the sampler's state row for penalties and logit_bias (engine-assigned); init_slot: its first step
        self.sampler_slot: int | None = None
        self.init_slot = False
        self.prompt_logprob_next = 0  # prompt positions whose logprobs some launched step computes

    def __len__(self) -> int:
        return len(self.token_ids)

    def step_tokens(self, n: int) -> list[int]:
        """The `n` tokens a step computes: from the first whose KV is not in the cache yet."""
        return self.token_ids[self.num_computed_tokens : self.num_computed_tokens + n]

    def __reduce__(self):
        """Pickled (a step's batch sent to the other tensor-parallel ranks) as what a step reads of it: its tokens
        not computed yet rather than the whole history (a 256-sequence decode batch of 2000-token sequences:
        1.6 MB and 7.6 ms to pickle whole)."""
        return StepView, (self.token_ids[self.num_computed_tokens :], self.num_computed_tokens, self.pages,
                          self.params, self.num_output_tokens, self.num_prompt_tokens, self.sampler_slot,
                          self.history if self.init_slot else None,
                          self.prompt_logprob_next)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def history(self) -> list[int]:
        """The prompt and the output tokens read so far (no PENDING one): what a sampler slot starts from."""
        return self.token_ids[: self.num_prompt_tokens + self.num_known_output_tokens]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens including a PENDING one (the count the next step's seed and the limits use)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_output_tokens(self) -> int:
        return self.num_output_tokens - (len(self.token_ids) > self.num_prompt_tokens and self.token_ids[-1] == PENDING)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def drop_unread(self) -> None:
        """Forget the PENDING tokens of steps whose results will not be read (a failed step's)."""
        while len(self.token_ids) > self.num_prompt_tokens and self.token_ids[-1] == PENDING:
            self.token_ids.pop()

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


class StepView:
    """A sequence as another tensor-parallel rank's runner sees it for one step: the tokens to compute, the pages,
    the sampling parameters, the output count (the noise seed's input), its sampler slot (with the history on the
    slot's first step) and how far its prompt logprobs were asked for."""

    def __init__(self, uncomputed: list[int], num_computed_tokens: int, pages: list[int], params: SamplingParams,
                 num_output_tokens: int, num_prompt_tokens: int, sampler_slot: int | None,
                 history: list[int] | None, prompt_logprob_next: int):
        self.uncomputed, self.num_computed_tokens, self.pages = uncomputed, num_computed_tokens, pages
        self.params, self.num_output_tokens, self.num_prompt_tokens = params, num_output_tokens, num_prompt_tokens
        self.sampler_slot, self.init_slot, self.history = sampler_slot, history is not None, history or []
        self.prompt_logprob_next = prompt_logprob_next

    def step_tokens(self, n: int) -> list[int]:
        return self.uncomputed[:n]
