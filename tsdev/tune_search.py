"""`tsdev tune`'s fast search: a few configurations per token bucket chosen by the shape, then the neighbours of the
best, instead of the full grid (216 MoE configurations a bucket, ~430 binaries to compile: more GPU time than a
device session has). Pure Python: the timer is a function passed in (CUDA graphs on a GPU: tsdev/tune_gpu.py; a
table of recorded timings in the tests).

Two regimes bound a grouped or block GEMM. With few rows per expert (decode) it streams the weights: the tile's rows
are mostly padding, so the smallest BLOCK_M, narrow BLOCK_N (many programs, every SM reading) and deep pipelines
(more stages, a long BLOCK_K) win. With many (prefill) it is compute-bound: large tiles for Hopper's wgmma (BLOCK_M
64-128, BLOCK_N 128, 8 warps). The seeds are the corners of both regimes that the bucket's rows allow; the refinement
then steps one parameter at a time to its neighbouring values around the best until no step is faster.
"""
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Config = dict  # a kernel's launch parameters: BLOCK_M, BLOCK_N, ... (the keys of the tuned files' entries)


@dataclass(frozen=True)
class Space:
    """A kernel's grid: each parameter's values in order (neighbours are adjacent values), and which configurations
    make sense for a bucket (`allowed(config, rows)`, rows: what one expert or GEMM gets on average)."""
    axes: dict[str, tuple]
    allowed: Callable[[Config, float], bool] = lambda config, rows: True
    fixed: dict = field(default_factory=dict)  # parameters the shape fixes (a block-FP8 checkpoint's BLOCK_K)

    def grid(self, rows: float) -> list[Config]:
        """Every allowed configuration: what the full search times."""
        configs = (self.fixed | dict(zip(self.axes, values)) for values in itertools.product(*self.axes.values()))
        return [c for c in configs if self.allowed(c, rows)]

    def snap(self, config: Config) -> Config:
        """`config` with each parameter moved to the nearest value the axis has (seeds are written by regime)."""
        return self.fixed | {name: min(values, key=lambda v: (abs(v - config[name]), v)) if name in config
                             else values[0] for name, values in self.axes.items()}

    def neighbours(self, config: Config, rows: float) -> list[Config]:
        """The allowed configurations one step away along one axis."""
        out = []
        for name, values in self.axes.items():
            i = values.index(config[name])
            for j in (i - 1, i + 1):
                if 0 <= j < len(values) and self.allowed(moved := config | {name: values[j]}, rows):
                    out.append(moved)
        return out


def _allowed_moe(config: Config, rows: float) -> bool:
    """Not BLOCK_M far above the rows an expert gets on average (most of such a block is padding)."""
    return config["BLOCK_M"] <= 16 or config["BLOCK_M"] <= 4 * rows


MOE_AXES = dict(BLOCK_M=(16, 32, 64, 128), BLOCK_N=(32, 64, 128), BLOCK_K=(64, 128, 256), num_warps=(4, 8),
                num_stages=(2, 3, 4))


def moe_space(block: bool) -> Space:
    """The fused MoE GEMMs' grid (benchmarks/tune_moe.py's until now); a block-FP8 checkpoint's experts: BLOCK_K the
    block's 128 and BLOCK_N at most 128, fixed by the scales, one more stage of room."""
    if block:
        axes = MOE_AXES | dict(BLOCK_K=(128,), num_stages=(2, 3, 4, 5))
        return Space({k: v for k, v in axes.items() if k != "BLOCK_K"}, _allowed_moe, fixed=dict(BLOCK_K=128))
    return Space(MOE_AXES, _allowed_moe)


GEMM_AXES = dict(BLOCK_M=(16, 32, 64, 128), BLOCK_N=(32, 64, 128), num_warps=(4, 8), SPLIT_K=(1, 2, 4, 8))


def _allowed_gemm(config: Config, rows: float) -> bool:
    return config["BLOCK_M"] <= 16 or config["BLOCK_M"] <= 4 * rows


GEMM_SPACE = Space(GEMM_AXES, _allowed_gemm)


def seeds(space: Space, rows: float) -> list[Config]:
    """The starting configurations for a bucket whose expert (or GEMM) gets `rows` rows on average: the
    weight-streaming corner (the smallest BLOCK_M, narrow and wide BLOCK_N, long BLOCK_K or a split of K, deep
    pipelines), the tile that just holds the rows, and the compute-bound corner (64- and 128-row wgmma tiles,
    BLOCK_N 128, 4 and 8 warps)."""
    sizes = space.axes["BLOCK_M"]
    fit = next((m for m in sizes if m >= rows), sizes[-1])  # the tile that holds an expert's rows
    streaming = [dict(BLOCK_M=sizes[0], BLOCK_N=n, BLOCK_K=k, num_warps=4, num_stages=s, SPLIT_K=split)
                 for n in (32, 64, 128) for k, s, split in ((128, 4, 4), (256, 3, 8))]
    between = [dict(BLOCK_M=fit, BLOCK_N=n, BLOCK_K=128, num_warps=4, num_stages=3, SPLIT_K=2) for n in (64, 128)]
    compute = [dict(BLOCK_M=m, BLOCK_N=128, BLOCK_K=k, num_warps=w, num_stages=3, SPLIT_K=1)
               for m in (64, 128) for w in (4, 8) for k in (64, 128)]
    out = []
    for config in map(space.snap, streaming + between + compute):
        if space.allowed(config, rows) and config not in out:
            out.append(config)
    return out


@dataclass
class Found:
    """A search's result: the fastest configuration, its time, and how many configurations were timed."""
    config: Config | None
    us: float
    timed: int


Timer = Callable[[Config], float | None]  # µs of one configuration at this bucket, None if it cannot run


def _best(timed: dict[str, tuple[float, Config]]) -> tuple[float, Config] | None:
    return min(timed.values(), key=lambda pair: pair[0], default=None)


def _time_all(configs: Iterable[Config], time: Timer, timed: dict, prepare: Callable[[list], None] | None) -> None:
    todo = [c for c in configs if repr(sorted(c.items())) not in timed]
    if prepare and todo:
        prepare(todo)  # the GPU timer compiles a round's kernels in parallel first
    for config in todo:
        us = time(config)
        timed[repr(sorted(config.items()))] = (float("inf") if us is None else us, config)


def fast_search(space: Space, rows: float, time: Timer, prepare: Callable[[list], None] | None = None,
                max_rounds: int = 8) -> Found:
    """The regime seeds (`seeds`), then from the best the neighbours along each axis, moving to the fastest while one
    is faster (at most max_rounds steps)."""
    timed: dict = {}
    _time_all(seeds(space, rows), time, timed, prepare)
    best = _best(timed)
    for _ in range(max_rounds):
        if best is None or best[0] == float("inf"):
            break
        _time_all(space.neighbours(best[1], rows), time, timed, prepare)
        step = _best(timed)
        if step[0] >= best[0]:
            break
        best = step
    if best is None or best[0] == float("inf"):
        return Found(None, float("inf"), len(timed))
    return Found(best[1], best[0], len(timed))


def full_search(space: Space, rows: float, time: Timer, prepare: Callable[[list], None] | None = None) -> Found:
    """Every allowed configuration of the grid: what the fast search is measured against."""
    timed: dict = {}
    _time_all(space.grid(rows), time, timed, prepare)
    best = _best(timed)
    if best is None or best[0] == float("inf"):
        return Found(None, float("inf"), len(timed))
    return Found(best[1], best[0], len(timed))
