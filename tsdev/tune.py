"""`tsdev tune`: the tuned files of the kernels a model runs, at its shapes, on this GPU.

What is tuned (a job each): the fused MoE GEMMs of the model's sparse layers (bf16, FP8 per-channel and block-FP8
experts: kernels/tsdev_kernels/ops/moe.py) and the block-FP8 GEMM of a block-FP8 checkpoint's projections (ops/
fp8_block.py, with the crossover against torch._scaled_mm), each at one tensor-parallel rank's shapes (`--tp`). For
each token bucket the fast search (tsdev/tune_search.py) times a few configurations, and the best (never slower than
the kernel's default) is written at once: a stopped run keeps every bucket it finished, `--resume` times the rest.
The files go where `find_tuned` (ops/__init__.py) looks first: `<cache>/tuned/moe_configs` and
`<cache>/tuned/gemm_configs`, named in vLLM's scheme (E=..,I=..,H=..,dtype=..,device=NVIDIA_H200.json), with one line
per bucket in `<cache>/tuned/tune-log.jsonl` (the configurations timed, the default's time). The shapes come from
config.json alone: no weights are loaded (random ones of the shape are timed).
"""
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tsdev.tune_search import GEMM_SPACE, Config, Found, Space, fast_search, full_search, moe_space

MOE_KINDS = ("bf16", "fp8", "block-fp8")  # the fused MoE's experts: bf16, FP8 per output row, FP8 per 128x128 block
KINDS = (*MOE_KINDS, "gemm")  # gemm: the block-FP8 projections' GEMM (and its crossover against _scaled_mm)
MOE_BUCKETS = (1, 16, 64, 256, 1024)  # tokens: moe.TOKEN_BUCKETS
GEMM_BUCKETS = (1, 4, 16, 64, 256, 1024, 2048, 4096)  # tokens of a projection

# config.json values of public checkpoints (the fields the shapes need), for tuning without the checkpoint
NAMED = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128),
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "qwen3-235b-a22b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=1536),
    "deepseek-v3": dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                        first_k_dense_replace=3,
                        quantization_config=dict(quant_method="fp8", weight_block_size=[128, 128])),
}


@dataclass(frozen=True)
class Job:
    """One tuned file: a fused MoE layer (shape E, I, H, top-k) or a block-FP8 projection (N, K) at one rank."""
    kind: str  # one of KINDS
    shape: tuple[int, ...]
    label: str = ""

    @property
    def folder(self) -> str:
        return "gemm_configs" if self.kind == "gemm" else "moe_configs"

    @property
    def stem(self) -> str:
        if self.kind == "gemm":
            from tsdev_kernels.ops.fp8_block import block_gemm_stem

            return block_gemm_stem(*self.shape)
        import torch

        from tsdev_kernels.ops.moe import moe_config_stem

        dtype = torch.bfloat16 if self.kind == "bf16" else torch.float8_e4m3fn
        return moe_config_stem(*self.shape[:3], dtype, (128, 128) if self.kind == "block-fp8" else None)

    @property
    def buckets(self) -> tuple[int, ...]:
        return GEMM_BUCKETS if self.kind == "gemm" else MOE_BUCKETS

    @property
    def space(self) -> Space:
        return GEMM_SPACE if self.kind == "gemm" else moe_space(self.kind == "block-fp8")

    def rows(self, tokens: int) -> float:
        """The rows one expert's (or the projection's) GEMM gets on average at `tokens` tokens."""
        if self.kind == "gemm":
            return tokens
        e, _, _, topk = self.shape
        return tokens * topk / e

    def path(self, out: Path, gpu: str) -> Path:
        from tsdev_kernels.ops import tuned_file_name

        return out / self.folder / tuned_file_name(self.stem, gpu)

    def route_path(self, out: Path, gpu: str) -> Path:
        from tsdev_kernels.ops import tuned_file_name

        return out / self.folder / tuned_file_name(self.stem + ",route=scaled_mm", gpu)

    def default(self, tokens: int) -> Config:
        """The kernel's untuned configuration: the file never holds one slower."""
        if self.kind == "gemm":
            from tsdev_kernels.ops.fp8_block import UNTUNED_GEMM

            return dict(zip(("BLOCK_M", "BLOCK_N", "num_warps"), UNTUNED_GEMM))
        from tsdev_kernels.ops.moe import default_moe_config

        return default_moe_config(tokens) | (dict(BLOCK_K=128) if self.kind == "block-fp8" else {})

    def entry(self, config: Config):
        """A configuration as the file stores it: the MoE's dict; the GEMM's [BLOCK_M, BLOCK_N, num_warps(, split)]."""
        if self.kind != "gemm":
            return config
        return [config[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "SPLIT_K") if k in config]

    def describe(self) -> str:
        if self.kind == "gemm":
            return f"block-FP8 GEMM {self.label} N={self.shape[0]} K={self.shape[1]}".replace("  ", " ")
        e, i, h, k = self.shape
        return f"MoE {self.kind} E={e} I={i} H={h} top-{k}"


class Timer(Protocol):
    """What the tuner times with: CUDA graphs on a GPU (tsdev/tune_gpu.py's CudaTimer), recorded tables in tests."""

    def prepare(self, job: Job, tokens: int, configs: list[Config]) -> None: ...  # compile before timing

    def time(self, job: Job, tokens: int, config: Config) -> float | None: ...  # µs, None: cannot run

    # µs: triton_us (with the quantization launch), inside_us (the GEMM quantizing inside), scaled_mm_us; the last two
    # where they can run
    def crossover(self, job: Job, tokens: int, config: Config) -> dict[str, float] | None: ...


# --- shapes ---------------------------------------------------------------------------------------


def resolve_model(model: str) -> tuple[str, dict]:
    """(a name for the model, its config.json as a dict) for `--model`: a checkpoint directory, a config.json file,
    an embedded model (default-moe, default-mla, ...: their GPU shapes) or a named public shape set (NAMED)."""
    from tsdev_runtime.weights import default_model as embedded

    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.name, json.loads((path / "config.json").read_text())
    if path.is_file():
        return path.parent.name or path.name, json.loads(path.read_text())
    if model in NAMED:
        return model, NAMED[model]
    if model in embedded.EMBEDDED_NAMES:
        shape = {embedded.DEFAULT_MLA: "deepseek-v3-small", embedded.DEFAULT_MOE: "qwen3-moe-small",
                 embedded.DEFAULT_MOE_FP8: "qwen3-moe-small"}.get(model, "qwen3-0.6b")
        config = dict(embedded.SHAPES[shape])
        if model in (embedded.DEFAULT_FP8, embedded.DEFAULT_MOE_FP8):
            config["quantization_config"] = dict(quant_method="fp8", weight_block_size=[128, 128])
        return model, config
    raise ValueError(f"--model {model!r}: not a checkpoint directory, a config.json, an embedded model "
                     f"({', '.join(embedded.EMBEDDED_NAMES)}) or a named shape set ({', '.join(NAMED)})")


def is_block_fp8(config: dict) -> bool:
    return bool((config.get("quantization_config") or {}).get("weight_block_size"))


def moe_shape(config: dict, tp: int) -> tuple[int, int, int, int] | None:
    """(E, I of one rank, H, top-k) of the model's sparse layers, None for a dense model."""
    experts = config.get("num_experts") or config.get("n_routed_experts")
    if not experts:
        return None
    return experts, config["moe_intermediate_size"] // tp, config["hidden_size"], config["num_experts_per_tok"]


def projection_shapes(config: dict, tp: int) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one rank's projections (runtime/tsdev_runtime/models: q|k|v and gate|up merged; latent
    attention's q_a, q_b, kv_a, o; dense and shared-expert MLPs), the shapes the block-FP8 GEMM runs."""
    hidden, shard = config["hidden_size"], lambda n: n // tp
    heads = config["num_attention_heads"]
    if config.get("kv_lora_rank"):  # DeepSeek's latent attention
        qk, rope = config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["qk_rope_head_dim"]
        out = {"kv_a": (config["kv_lora_rank"] + rope, hidden), "o": (hidden, shard(heads * config["v_head_dim"]))}
        if q_lora := config.get("q_lora_rank"):
            out |= {"q_a": (q_lora, hidden), "q_b": (shard(heads * qk), q_lora)}
        else:
            out["q"] = (shard(heads * qk), hidden)
    else:
        d = config.get("head_dim") or hidden // heads
        kv = max(1, config.get("num_key_value_heads", heads) // tp)
        out = {"qkv": ((shard(heads) + 2 * kv) * d, hidden), "o": (hidden, shard(heads) * d)}
    dense = not moe_shape(config, 1) or config.get("mlp_only_layers") or config.get("first_k_dense_replace")
    if dense:
        inter = shard(config["intermediate_size"])
        out |= {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    if shared := config.get("n_shared_experts"):
        inter = shard(config["moe_intermediate_size"] * shared)
        out |= {"shared_gate_up": (2 * inter, hidden), "shared_down": (hidden, inter)}
    return out


def default_kinds(config: dict) -> tuple[str, ...]:
    """What serving the checkpoint runs: a block-FP8 one its experts' and projections' block kernels; another its
    experts in bf16 and FP8 per-channel (`tsdev serve --quantization fp8`). A dense bf16 model: nothing (cuBLAS)."""
    if is_block_fp8(config):
        return ("block-fp8", "gemm") if moe_shape(config, 1) else ("gemm",)
    return ("bf16", "fp8") if moe_shape(config, 1) else ()


def jobs_for(config: dict, tp: int, kinds: Iterable[str]) -> list[Job]:
    """The files to tune for a model at --tp: each MoE kind at its sparse layers' shape, the GEMM at each distinct
    projection shape."""
    jobs, moe = [], moe_shape(config, tp)
    for kind in kinds:
        if kind == "gemm":
            seen = {}
            for name, shape in projection_shapes(config, tp).items():
                seen.setdefault(shape, []).append(name)
            jobs += [Job("gemm", shape, "|".join(names)) for shape, names in seen.items()]
        elif moe:
            jobs.append(Job(kind, moe))
    return jobs


# --- the run -------------------------------------------------------------------------------------


def read_table(path: Path) -> dict[str, object]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def write_table(path: Path, table: dict) -> None:
    """{bucket: entry} as the kernels read it, keys in numeric order, written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    ordered = {str(k): v for k, v in sorted(table.items(), key=lambda item: int(item[0]))}
    temporary.write_text(json.dumps(ordered, indent=2) + "\n")
    os.replace(temporary, path)


def pending(jobs: list[Job], out: Path, gpu: str, resume: bool) -> list[tuple[Job, int]]:
    """(job, bucket) still to search: all of them, or with --resume those the files do not hold yet."""
    todo = []
    for job in jobs:
        done = read_table(job.path(out, gpu)) if resume else {}
        todo += [(job, b) for b in job.buckets if str(b) not in done]
    return todo


def search_bucket(job: Job, tokens: int, timer: Timer, full: bool = False) -> tuple[Config, float, float, int]:
    """(the configuration to write, its µs, the default's µs, configurations timed) for one bucket."""
    rows = job.rows(tokens)
    search = full_search if full else fast_search
    found: Found = search(job.space, rows, lambda c: timer.time(job, tokens, c),
                          lambda configs: timer.prepare(job, tokens, configs))
    default = job.default(tokens)
    default_us = timer.time(job, tokens, default)
    if found.config is None or (default_us is not None and default_us <= found.us):
        return default, (default_us if default_us is not None else float("inf")), default_us, found.timed + 1
    config, us = found.config, found.us
    if job.kind == "block-fp8":  # the GEMMs quantizing their own tiles instead of a launch before each: where faster
        inside = config | dict(quantize_inside=True)
        if (inside_us := timer.time(job, tokens, inside)) is not None and inside_us < us:
            config, us = inside, inside_us
    return config, us, default_us, found.timed + 2


def tune(jobs: list[Job], timer: Timer, out: Path, gpu: str, resume: bool = False, full: bool = False,
         deadline: float | None = None, console=None) -> int:
    """Search every pending bucket of every job, writing each file after each bucket (and the GEMM's crossover
    file), with a progress bar and an ETA, starting none after `deadline` (time.monotonic()); returns the buckets
    searched."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    todo = pending(jobs, out, gpu, resume)
    log = out / "tune-log.jsonl"
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("tuning", total=len(todo))
        for searched, (job, tokens) in enumerate(todo):
            if deadline is not None and time.monotonic() > deadline:
                progress.console.print(f"stopped at the time budget: {len(todo) - searched} bucket(s) left")
                return searched
            progress.update(task, description=f"{job.describe()} @ {tokens} tokens")
            start = time.perf_counter()
            config, us, default_us, timed = search_bucket(job, tokens, timer, full)
            path = job.path(out, gpu)
            record = dict(file=path.name, tokens=tokens, config=job.entry(config), us=us, default_us=default_us,
                          timed=timed, grid=len(job.space.grid(job.rows(tokens))), full=full)
            if job.kind == "gemm" and (times := timer.crossover(job, tokens, config)):  # (before the bucket is done)
                route = job.route_path(out, gpu)
                write_table(route, read_table(route) | {str(tokens): times})
                record |= times
            write_table(path, read_table(path) | {str(tokens): job.entry(config)})  # the bucket is done
            record["seconds"] = round(time.perf_counter() - start, 1)
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            progress.console.print(f"{job.describe()} @ {tokens}: {us:.1f} µs (default "
                                   f"{'-' if default_us is None else f'{default_us:.1f}'}), {timed} of "
                                   f"{record['grid']} configs timed: {config}", highlight=False)
            progress.advance(task)
    return len(todo)


def tuned_dir() -> Path:
    """Where `tsdev tune` writes by default: the first place the kernels look (ops/__init__.py's `find_tuned`)."""
    from tsdev_kernels.cache import cache_dir

    return cache_dir() / "tuned"
