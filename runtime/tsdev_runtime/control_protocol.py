"""The control protocol: every body, reply, worker report, step name and event that the server's control
routes speak, in one place that both sides import.

The server builds its replies and events from these models; `tsdev reload`, `tsdev watch`, `tsdev profile`
and the tests parse them with these models. It imports pydantic only (no torch), so a client pays nothing
for it. Wave 2 (weights, parallelism) adds its bodies here.

Replies are dumped with `dump()` (JSON-ready dicts, `None` fields kept so the shape is stable); clients
read with `Model.model_validate(json)` and ignore fields they do not know, so an older client can talk to
a newer server.
"""
import re
from typing import Annotated, Literal, Union

from pydantic import (AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, ValidationInfo,
                      field_validator)

# a restart's weights, from the server that stops to its standby (runtime/tsdev_runtime/weights/handover.py): the
# Unix socket tsdev watch names for both
WEIGHTS_HANDOVER_ENV = "TSDEV_WEIGHTS_HANDOVER"


def restart_marker(handover_path: str) -> str:
    """The file tsdev watch writes beside the hand-over socket when it stops the server for a restart (a standby
    preparing to take over), and not when it quits: only then does the stopping server wait for the standby."""
    return handover_path + ".restart"
RELOAD_ROUTE = "/v1/rl/engine/reload_forward"
COMPILE_AHEAD_ROUTE = "/v1/rl/engine/compile_ahead"  # an editor's unsaved buffer: its kernels built, nothing reloaded
MODULES_ROUTE = "/v1/rl/engine/modules"
KERNEL_CHECK_ROUTE = "/v1/rl/engine/kernel_check"
PAUSE_ROUTE = "/v1/rl/engine/pause_generation"
CONTINUE_ROUTE = "/v1/rl/engine/continue_generation"
EVENTS_ROUTE = "/v1/rl/engine/events"
FLUSH_ROUTE = "/flush_cache"
START_PROFILE_ROUTE = "/start_profile"
STOP_PROFILE_ROUTE = "/stop_profile"
SERVER_INFO_ROUTE = "/server_info"
SLEEP_ROUTE = "/sleep"  # vLLM's sleep mode routes
WAKE_UP_ROUTE = "/wake_up"
IS_SLEEPING_ROUTE = "/is_sleeping"
RELOAD_WEIGHTS_ROUTE = "/v1/rl/engine/reload_weights"
UPDATE_WEIGHTS_FROM_DISK_ROUTE = "/update_weights_from_disk"  # SGLang's name (its body: model_path)
UPDATE_WEIGHTS_ROUTE = "/v1/rl/engine/update_weights"
WEIGHTS_CHECKSUM_ROUTE = "/v1/rl/engine/weights_checksum"
UPDATE_MODES = ("direct", "full")  # direct: in place, graphs kept; full: graphs released and recaptured
UpdateMode = Literal[UPDATE_MODES]
SLEEP_TAGS = ("weights", "kv_cache")
SleepTag = Literal[SLEEP_TAGS]

# The timed steps of a reload, in the order the server runs them. jit compiles edited kernels ahead while the
# old code serves (a failure there only warns); the others run while serving is paused.
STEPS = ("jit", "drain", "flush", "reload", "warm", "recapture")
FAILING_STEPS = STEPS[1:]  # where a reload can fail
GRAPH_KINDS = ("decode", "prefill")  # recapture is reported split by graph kind too: recapture_decode, ...
# Every key a worker's timings may hold: the steps, the recapture split, the pause serving saw, the total.
# `rebuild`: the part of the reload step that rebuilt the model (a layer's __init__ or post-load hook changed);
# `jit_slowest`: the slowest single compile of the jit step (compiled side by side, it bounds that step);
# `kernel_check`: checking the changed kernels against their references (kernel_checks): in the pause under `strict`
# (a failure rolls the reload back), after it under `report`; `check_prepare`: before the pause, the checks' inputs
# drawn (if the GPU is idle) while the jit step compiles -- the time it took beyond that step; `commit`: the pause's
# last step, the point of no return (every rank's transaction committed); `resumed`: from the request to serving
# resumed (the new code serves; what follows, report-mode checks, does not hold it).
TIMINGS = (*STEPS, "jit_slowest", "rebuild", "kernel_check", "check_prepare", "commit",
           *(f"recapture_{kind}" for kind in GRAPH_KINDS), "pause", "resumed", "total")
TimingName = Literal[TIMINGS]
# What a server is doing now (EngineControl.phase, runtime/tsdev_runtime/engine/control.py), the first that holds:
# /server_info's and the events' `state`
Phase = Literal["stopping", "sleeping", "weights_unloaded", "paused", "holding", "serving"]
StepName = Literal[STEPS]


class _Message(BaseModel):
    """Unknown fields are ignored (a newer peer may send more)."""
    model_config = ConfigDict(extra="ignore")

    def dump(self) -> dict:
        return self.model_dump(mode="json")


def valid_unicode(text: str) -> str:
    """`text` unless it holds a lone surrogate: JSON's \\ud800 escapes can carry one, but it is no character, and
    neither the tokenizer, a file name nor a UTF-8 reply can hold it (they failed with a 500 before)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{text[exc.start]!r} at character {exc.start} is half of a UTF-16 surrogate pair, not a "
                         "character: send valid Unicode (a character beyond U+FFFF escaped as both halves of its "
                         "pair, or unescaped)") from None
    return text


# A string from a request body: valid Unicode.
Text = Annotated[str, AfterValidator(valid_unicode)]
NAME_MAX = 255  # bytes in one file or directory name on the usual file systems
PATH_MAX = 1024  # bytes in a path a request may name (the kernel's limit, 4096, counts the directory above too)


def file_system_path(value: str | None, suffix: str = "") -> str | None:
    """`value` when a file system takes it (with `suffix` appended): no NUL, no name or path longer than allowed."""
    if value is None:
        return value
    if "\0" in value:
        raise ValueError("must not contain a NUL character")
    path = value + suffix
    longest = max(len(part.encode()) for part in re.split(r"[/\\]", path))
    if longest > NAME_MAX or len(path.encode()) > PATH_MAX:
        raise ValueError(f"is too long for a file system ({longest} bytes in one name, {len(path.encode())} in "
                         f"all{f', with {suffix}' if suffix else ''}): use at most {NAME_MAX} bytes per name and "
                         f"{PATH_MAX} in all")
    return value


# --- reload_forward ---------------------------------------------------------------------------------------


class ReloadRequest(_Message):
    id: Text = Field(min_length=1, description="the same id again returns the first outcome")
    mode: Literal["wait", "abort"] = "wait"  # wait: running requests finish first; abort: they are aborted
    modules: list[Text] | None = None  # force these modules (and their dependents) to re-execute
    timeout_s: float | None = Field(None, gt=0)  # bounds drain + reload; nothing changes when it runs out
    recapture: bool = False  # capture the graphs again even where a kernel-body edit could patch them
    kernel_check: Literal["report", "strict", "off"] | None = None  # this reload's checks (None: the server's mode)


class StaleDefinition(_Message):
    """A definition that could be neither patched nor redirected: callers keep running the old one."""
    name: str
    reason: str = ""
    where: str | None = None
    referrers: list[str] = []


class KernelCheckResult(_Message):
    """One changed op at one serving shape against its torch reference (kernels/tsdev_kernels/checks.py), on fresh
    random inputs."""
    op: str
    shape: list[int]
    dtype: str
    max_abs: float | None  # the largest |kernel - reference|; None: not finite (NaN or Inf in the output)
    max_rel: float | None  # relative to |reference| where that exceeds atol
    atol: float
    rtol: float
    ok: bool  # |kernel - reference| <= atol + rtol * |reference| everywhere, all finite
    seed: int  # the inputs' (drawn fresh for every check)
    error: str | None = None  # the kernel raised, or its output's shape or dtype is not the reference's
    us_before: float | None = None  # median µs per call of the old code (None: not measured)
    us_after: float | None = None  # of the new code (None: not measured: requests were running)
    before_fresh: bool = False  # us_before was measured just before this reload (else at an earlier one)
    timed: str | None = None  # "graph": device time in a CUDA graph; "eager": launched one by one, launch cost
    #                           included (the op cannot be captured); "wall": the wall clock (off CUDA)
    bytes: int | None = None  # moved per call at this shape (the op's declared cost, over the inputs timed)
    flops: int | None = None  # tensor-core FLOPs per call (2·M·N·K of its matmuls; 0 for elementwise ops)
    share: float | None = None  # of the GPU's limit at us_after: max(bytes / bandwidth, flops / rate) / time
    bound: str | None = None  # the limit `share` is of: "bandwidth", "bf16 tensor cores", "fp8 tensor cores"


class WorkerReport(_Message):
    """One rank's outcome of a reload: ok only when it reloaded (or had nothing to reload)."""
    rank: int = 0
    ok: bool
    error: str | None = None  # "file:line: Type: message" when it failed
    reloaded: list[str] = []  # changed (or forced) modules re-executed
    dependents: list[str] = []  # re-executed because they use those
    patched: int = 0  # live objects updated in place or redirected
    stale: list[StaleDefinition] = []
    needs_restart: list[str] = []  # changed modules outside the reloadable packages
    rebuilt: list[str] = []  # model modules rebuilt (their class's __init__ or post-load hook changed)
    jit_kernels: int = 0  # Triton binaries ready ahead (built before the pause, or found in Triton's disk cache),
    #                       or the kernels reset to compile on their next launch
    # module.name -> dialect ("triton", "gluon", "cute") of each kernel the reload replaced
    kernels: dict[str, str] = {}
    kernels_only: bool = False  # only Triton kernel bodies changed (binaries loaded): the warm step ran nothing
    compiled_in_pause: dict[str, float] = {}  # module.name -> seconds its new binaries compiled in the reload step
    #                                            (in the pause): none of them had been compiled ahead
    graph_nodes_patched: int = 0  # with kernels_only: the recapture step pointed this many captured kernel nodes at
    #                               the new binaries instead of capturing the graphs again
    graphs: bool = True  # the engine runs CUDA graphs; False on a CPU or under --enforce-eager: nothing is captured
    kernel_checks: list[KernelCheckResult] = []  # the changed ops against their references, per serving shape
    warnings: list[str] = []
    timings: dict[TimingName, float] = {}  # seconds, in step order

    def step_seconds(self, step: str) -> float:
        return self.timings.get(step, 0.0)

    @property
    def failed_step(self) -> str | None:
        """The step that failed: the last one timed among those that can fail."""
        if self.ok:
            return None
        return next((s for s in reversed(list(self.timings)) if s in FAILING_STEPS), None)


class ReloadReply(_Message):
    id: str
    ok: bool  # every worker reloaded
    workers: list[WorkerReport]

    @classmethod
    def of(cls, request_id: str, workers: list[WorkerReport]) -> "ReloadReply":
        return cls(id=request_id, ok=all(w.ok for w in workers), workers=workers)

    @property
    def first_failure(self) -> WorkerReport:
        """The worker to show when only one is shown: the first that failed, else rank 0's."""
        return next((w for w in self.workers if not w.ok), self.workers[0])


class KernelCheckRequest(_Message):
    """Check these ops (all declared ones when None) against their references at the serving shapes, now. The server
    runs one (op, shape) case at a time on its engine thread, between steps and never beside a request, and stops
    between cases once the client has gone away: a check cannot hold serving, nor outlive its `tsdev check`."""
    ops: list[Text] | None = Field(None, min_length=1)  # an empty list would check nothing: refused
    # Server-sent events instead of one JSON reply: a KernelCheckProgress before each case (and while the check waits
    # for requests), then the KernelCheckReply, or an ErrorBody if the check could not go on. What `tsdev check` asks
    # for: it shows the progress, and its Ctrl-C closes the stream, which stops the check.
    stream: bool = False


class KernelCheckProgress(_Message):
    """Where a running check is: one of its events (stream), and /load's and /health's `kernel_check` meanwhile."""
    type: Literal["kernel_check_progress"] = "kernel_check_progress"
    done: int  # cases finished
    total: int  # cases in all (one per op and serving shape)
    op: str | None = None  # the case running now (None: between cases)
    shape: list[int] = []
    waiting_for: int = 0  # requests the check gives way to: the next case starts once none is running or waiting


class KernelCheckReply(_Message):
    ok: bool  # every check passed
    checks: list[KernelCheckResult]
    ops: list[str]  # every op declared (what `ops` may name)
    seconds: float = 0.0


class CompileAheadRequest(_Message):
    """An editor's unsaved buffer: `text` is what the file at `path` (a module of the reloadable packages) will hold
    once saved. The server compiles the Triton kernels it changes into Triton's disk cache while the old code serves,
    and reloads nothing: the save's reload finds them built."""
    path: Text = Field(min_length=1)
    text: Text
    id: Text | None = None  # the caller's name for this build, in its reply and event (`tsdev watch` knows its own)

    @field_validator("path")
    @classmethod
    def _a_path_the_file_system_takes(cls, value: str) -> str:
        return file_system_path(value)


# compiled: built now (or `reused`: the same text was built before); nothing: nothing to build (`reason`);
# superseded: a newer buffer of the same file came before this one's turn; failed: the text does not compile, or a
# kernel does not (`error`)
AheadOutcome = Literal["compiled", "nothing", "superseded", "failed"]


class CompileAheadReply(_Message):
    path: str  # the file, resolved
    id: str | None = None  # the request's
    module: str | None = None  # its module (None: not one the server has imported)
    outcome: AheadOutcome
    ok: bool  # not failed
    compiled: int = 0  # binaries built into Triton's disk cache (one per kernel and specialisation the server runs)
    kernels: list[str] = []  # module.name of each kernel built
    reused: bool = False  # the same text (and code served) was built before: nothing compiled now
    seconds: float = 0.0  # building (side by side in the compile pool: about the slowest compile)
    slowest: float = 0.0  # the slowest single compile
    waited: float = 0.0  # for its turn (another buffer's build, a reload)
    reason: str | None = None  # why nothing was built
    error: str | None = None  # "file:line: Type: message" (the buffer's syntax error), or the kernels that failed


class ModulesReply(_Message):
    modules: list[str]  # loaded modules under the reloadable packages: what a reload may force


# --- pause / continue / cache / profile ----------------------------------------------------------------------


class PauseRequest(_Message):
    mode: Literal["abort", "wait", "keep"] = "abort"


class PauseReply(_Message):
    paused: bool = True
    mode: Literal["abort", "wait", "keep"]
    aborted: int = 0


class ContinueReply(_Message):
    paused: bool = False


class FlushReply(_Message):
    flushed: bool = True


ProfileActivity = Literal["CUDA_PROFILER", "TORCH"]


class ProfileRequest(_Message):
    activities: list[ProfileActivity] = Field(["CUDA_PROFILER"], min_length=1)
    num_steps: int = Field(20, ge=1)
    output_dir: Text | None = None  # a subdirectory of the server's profile directory (tsdev serve --profile-dir)
    name: Text | None = None  # the range's name (the trace file's, for TORCH): a plain file name

    @field_validator("output_dir", "name")
    @classmethod
    def _a_path_the_file_system_takes(cls, value: str | None, info: ValidationInfo) -> str | None:
        """The trace's write failed with a 500 otherwise."""
        return file_system_path(value, ".trace.json" if info.field_name == "name" else "")


class ProfileRange(_Message):
    """A capture range as /start_profile and /stop_profile describe it."""
    n: int
    name: str
    activities: list[ProfileActivity]
    num_steps: int | None = None  # when it started: steps it will last
    steps: int | None = None  # when it closed: steps it lasted
    trace: str | None = None  # TORCH: the Chrome/Perfetto trace written
    error: str | None = None  # when it closed: why its trace could not be written


# --- sleep / wake / weights ---------------------------------------------------------------------------------


class SleepRequest(_Message):
    level: Literal[1, 2] = 1  # 1: weights kept in host memory, KV discarded; 2: both discarded


class SleepStatus(_Message):
    """GET /is_sleeping (vLLM's `is_sleeping` key, and more); the state part of the sleep and wake replies."""
    is_sleeping: bool
    level: int | None = None  # while sleeping
    asleep: list[SleepTag] = []  # what is still freed (a wake_up with tags may bring back one of them)
    weights_loaded: bool = True  # False after a level-2 sleep until reload_weights


class SleepReply(SleepStatus):
    freed_bytes: int = 0  # device bytes of the weights and the KV pool freed (0: it was asleep already)
    device_freed_bytes: int | None = None  # what cudaMemGetInfo saw come free (graphs' pools too); None off CUDA
    seconds: float = 0.0  # drain included


class WakeUpRequest(_Message):
    tags: list[SleepTag] | None = None  # default: everything asleep


class WakeUpReply(SleepStatus):
    woken: list[SleepTag] = []
    recapture_seconds: float = 0.0  # the graphs are recaptured once weights and KV are both back
    seconds: float = 0.0


class ReloadWeightsRequest(_Message):
    # under the served model's directory or an --allowed-weight-dir; default: the served model's directory.
    # SGLang's /update_weights_from_disk sends it as model_path.
    path: Text | None = Field(None, validation_alias=AliasChoices("path", "model_path"))

    @field_validator("path")
    @classmethod
    def _a_path_the_file_system_takes(cls, value: str | None) -> str | None:
        return file_system_path(value)


class UpdateWeightsRequest(ReloadWeightsRequest):
    """POST /v1/rl/engine/update_weights; SGLang's /update_weights_from_disk body ({"model_path", ...}) too."""
    mode: UpdateMode = "direct"
    id: Text | None = None  # the caller's name for this update (a training step), echoed in the reply and event


class ReloadWeightsReply(_Message):
    success: bool = True  # SGLang's key
    message: str = ""
    path: str
    format: str  # pinned or plain
    nbytes: int
    load_seconds: float
    seconds: float  # drain included
    mode: UpdateMode = "direct"
    id: str | None = None
    recapture_seconds: float = 0.0  # mode full: the graphs were recaptured; direct: 0 (addresses kept)


class WeightsChecksumReply(_Message):
    """GET /v1/rl/engine/weights_checksum: sha256 per parameter and persistent buffer (in its runtime layout: its
    dtype, shape and bytes), and `overall`, the sha256 of the sorted `name digest` lines."""
    algorithm: str = "sha256"
    overall: str
    tensors: dict[str, str]
    seconds: float = 0.0


# --- what the server is ---------------------------------------------------------------------------------------


class EngineInfo(_Message):
    """What an engine serves, and how (`LLMEngine.describe()`): the `tsdev serve` banner, GET /server_info."""
    model_dir: str
    architecture: str
    device: str
    dtype: str
    parameters: int
    max_model_len: int
    vocab_size: int
    rank: int = 0
    world_size: int = 1
    max_running: int | None = None  # the most requests computed at once
    kv_pages: int | None = None
    page_size: int | None = None  # tokens per KV page
    decode_graph_sizes: list[int] = []  # batch sizes replayed from decode graphs ([]: none)
    prefill_graph_buckets: list[int] = []  # token counts of the prefill graphs ([]: none)
    prefill_graphs_failed: str | None = None  # why prefill runs eagerly after its graphs failed to capture
    decode_graphs_used: list[int] = []  # batch sizes the steps replayed since the last capture
    prefill_graphs_used: list[int] = []  # prefill buckets the steps replayed since the last capture
    graphs_pending: int = 0  # graphs left to capture after serving (re)started: captured while idle, steps eager
    quantization: str | None = None  # e.g. fp8
    kv_cache_dtype: str | None = None  # the KV pool's (e.g. bfloat16, float8_e4m3fn)


class ServerInfo(EngineInfo):
    """GET /server_info: what a client (the daemon's status line, a benchmark's record) needs to know."""
    model: str  # the served name
    allow_reload_forward: bool = False
    pid: int
    state: Phase = "serving"
    startup: dict[str, float] = {}  # where the start's seconds went, in order (the startup line); {}: unknown
    # when (seconds since the epoch) the start began (a standby's: when it took it), the startup line was said and the
    # server began serving: `tsdev watch` splits what its restart took beyond `startup` by them; {}: unknown
    moments: dict[str, float] = {}


# --- events (GET /v1/rl/engine/events, one SSE `data:` line each) -------------------------------------------


class _Event(_Message):
    time: float | None = None  # server clock, seconds since the epoch


class Hello(_Event):
    """The first event of every connection: the state a new subscriber needs."""
    type: Literal["hello"] = "hello"
    paused: bool
    sleeping: bool = False
    state: Phase = "serving"


class StateChanged(_Event):
    """The server's phase moved (EngineControl.phase: runtime/tsdev_runtime/engine/control.py)."""
    type: Literal["state"] = "state"
    state: Phase


class Paused(_Event):
    type: Literal["paused"] = "paused"
    mode: str
    aborted: int = 0


class Continued(_Event):
    type: Literal["continued"] = "continued"


class ReloadStarted(_Event):
    type: Literal["reload_started"] = "reload_started"
    id: str
    n: int  # the server's count of reloads
    modules: list[str] = []  # forced modules, if any


class ReloadStep(_Event):
    type: Literal["reload_step"] = "reload_step"
    id: str
    step: StepName
    state: Literal["started", "done", "failed"]
    seconds: float | None = None  # when done or failed
    running: int | None = None  # drain, when started: the requests it waits for (wait) or aborts (abort)


class ReloadFinished(_Event):
    """reload_finished when the worker reloaded, reload_failed otherwise."""
    type: Literal["reload_finished", "reload_failed"]
    id: str
    n: int
    worker: WorkerReport


class Sleeping(_Event):
    type: Literal["sleeping"] = "sleeping"
    level: int
    freed_bytes: int = 0


class Awake(_Event):
    """Everything is awake again (a wake_up that leaves a tag asleep sends none)."""
    type: Literal["awake"] = "awake"
    weights_loaded: bool = True


class WeightsReloaded(_Event):
    type: Literal["weights_reloaded"] = "weights_reloaded"
    path: str
    seconds: float
    mode: UpdateMode = "direct"
    id: str | None = None


class CompiledAhead(_Event):
    """An editor's buffer was compiled ahead (or failed to): the watch daemon says so."""
    type: Literal["compiled_ahead"] = "compiled_ahead"
    reply: CompileAheadReply


class ProfileStarted(ProfileRange, _Event):
    type: Literal["profile_started"] = "profile_started"


class ProfileFinished(ProfileRange, _Event):
    type: Literal["profile_finished"] = "profile_finished"


Event = Annotated[Union[Hello, StateChanged, Paused, Continued, ReloadStarted, ReloadStep, ReloadFinished,
                        ProfileStarted, ProfileFinished, Sleeping, Awake, WeightsReloaded, CompiledAhead],
                  Field(discriminator="type")]
_EVENT = TypeAdapter(Event)


def parse_event(data: str | bytes | dict) -> Event | None:
    """An event from its SSE `data:` payload; None for a type this client does not know (a newer server)."""
    from pydantic import ValidationError

    try:
        return _EVENT.validate_json(data) if isinstance(data, (str, bytes)) else _EVENT.validate_python(data)
    except ValidationError as exc:
        if any(e["type"] == "union_tag_invalid" for e in exc.errors()):
            return None
        raise


# --- errors (OpenAI's shape, for every route) ---------------------------------------------------------------


class ErrorDetail(_Message):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: int | None = None


class ErrorBody(_Message):
    error: ErrorDetail
