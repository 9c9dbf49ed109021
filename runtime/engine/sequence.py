"""A request as the engine sees it: its tokens, its pages, and how far it has been computed."""
import enum
import time
from dataclasses import dataclass, field

# The token a step still in flight samples: a placeholder at the end of token_ids until the engine reads
# the step's result. A step that computes that position takes the real id on the GPU.
PENDING = -1


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) means no top-k
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (both: off) or positive, got {self.top_k}")
        self.top_k = max(self.top_k, 0)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = Status.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.pages: list[int] = []
        self.page_hashes: list[int] = []  # prefix-cache hash chain of the full pages computed so far
        self.finish_reason: str | None = None
        # time.monotonic() stamps for the latency metrics (vLLM's RequestMetrics)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None  # first admitted by the scheduler
        self.last_token_time: float | None = None  # when its latest token was read

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
                          self.params, self.num_output_tokens)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens including a PENDING one (the count the next step's seed and the limits use)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_output_tokens(self) -> int:
        return self.num_output_tokens - (len(self.token_ids) > self.num_prompt_tokens and self.token_ids[-1] == PENDING)

    def at_length_limit(self, length: int, max_model_len: int) -> bool:
        """Whether a sequence of `length` tokens has generated all it may (max_tokens or the context)."""
        return length - self.num_prompt_tokens >= self.params.max_tokens or length >= max_model_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


class StepView:
    """A sequence as another tensor-parallel rank's runner sees it for one step: the tokens to compute, the pages,
    the sampling parameters and the output count (the noise seed's input)."""

    def __init__(self, uncomputed: list[int], num_computed_tokens: int, pages: list[int], params: SamplingParams,
                 num_output_tokens: int):
        self.uncomputed, self.num_computed_tokens, self.pages = uncomputed, num_computed_tokens, pages
        self.params, self.num_output_tokens = params, num_output_tokens

    def step_tokens(self, n: int) -> list[int]:
        return self.uncomputed[:n]
