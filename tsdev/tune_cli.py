"""`tsdev tune` (registered in tsdev/cli.py): the command line over tsdev/tune.py."""
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from tsdev.tune import KINDS, Job, default_kinds, jobs_for, pending, resolve_model, tune, tuned_dir

STOPPED = 3  # exit status of a run stopped by --budget (what it finished is written; --resume goes on)


def make_timer(jobs: int, rep: int):
    """The CUDA timer, or exit 2 saying what to do on a machine without CUDA (tests replace this function)."""
    import torch

    if not torch.cuda.is_available():
        typer.echo("error: tsdev tune times kernels on a CUDA GPU and none is visible here. Run it on the machine "
                   "that serves, with the GPU it serves on (the files are per GPU model: "
                   "E=..,device=NVIDIA_H100_80GB_HBM3.json); `--dry-run` lists what it would tune.", err=True)
        raise typer.Exit(2)
    from tsdev.tune_gpu import CudaTimer

    timer = CudaTimer(jobs, rep)
    timer.gpu = torch.cuda.get_device_name()
    return timer


def _ints(flag: str, value: str, count: tuple[int, ...]) -> tuple[int, ...]:
    try:
        parts = tuple(int(v) for v in value.split(","))
    except ValueError:
        parts = ()
    if len(parts) not in count:
        raise typer.BadParameter(f"{value!r}: expected {' or '.join(str(c) for c in count)} comma-separated integers",
                                 param_hint=flag)
    return parts


def tune_command(
    model: Annotated[Optional[list[str]], typer.Option(
        "--model", metavar="DIR|NAME",
        help="What to tune for (repeatable): a checkpoint directory or its config.json (only the "
                        "config is read), an embedded model (default-moe, default-moe-fp8, default-fp8, default-mla) "
                        "or a public shape set (qwen3-8b, qwen3-32b, qwen3-30b-a3b, qwen3-235b-a22b, "
                        "deepseek-v3).")] = None,
    tp: Annotated[Optional[list[int]], typer.Option(
        "--tp", min=1, metavar="N",
        help="Tensor-parallel ranks (repeatable: --tp 1 --tp 8): each rank's shard is its own "
                            "shape and file. Default 1.")] = None,
    kinds: Annotated[Optional[str], typer.Option(
        metavar="KIND,...",
        help="Comma-separated, of bf16, fp8, block-fp8 (the fused MoE's experts: bf16, FP8 per-channel, FP8 in "
             "128x128 blocks) and gemm (a block-FP8 checkpoint's projections). Default: what the model serves -- "
             "a block-FP8 checkpoint block-fp8,gemm; another MoE bf16,fp8 (fp8: serve --quantization fp8).")] = None,
    moe: Annotated[Optional[list[str]], typer.Option(
        "--moe", metavar="E,I,H[,TOPK]", help="A MoE layer's shape instead of a model's (repeatable): experts, one "
                                                "rank's expert intermediate size, hidden size, experts per token "
                                                "(default 8). Tunes bf16 unless --kinds says.")] = None,
    gemm: Annotated[Optional[list[str]], typer.Option(
        "--gemm", metavar="N,K", help="A block-FP8 projection's shape (one rank's outputs, inputs; repeatable).")
    ] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Keep the token buckets the files already hold (written after each bucket) and tune only "
                         "the others: how a stopped run goes on.")] = False,
    out: Annotated[Optional[Path], typer.Option(
        metavar="DIR",
        help="Where to write (default: <cache>/tuned, which the kernels read first; <cache> is $TSDEV_CACHE_DIR, "
             "else ~/.cache/tsdev).")] = None,
    full: Annotated[bool, typer.Option(
        "--full", help="Time the full grid instead of the fast search (~5x longer; to check the fast one).")] = False,
    budget: Annotated[Optional[float], typer.Option(
        metavar="SECONDS",
        help="Seconds: start no bucket after this long (exit 3; --resume goes on from there).")] = None,
    jobs: Annotated[int, typer.Option(min=1, help="Processes compiling kernels before they are timed.")] = 16,
    rep: Annotated[int, typer.Option(min=1, help="Milliseconds of CUDA graph replays per timing.")] = 50,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List the files and buckets it would tune; time "
                                                             "nothing (no GPU needed).")] = False,
):
    """Tune the Triton kernels a model runs for this GPU, at the model's shapes.

    What: the fused MoE GEMMs of its sparse layers (bf16, FP8 per-channel and block-FP8 experts) and the block-FP8
    GEMM of a block-FP8 checkpoint's projections -- for each, the block sizes, warps and stages per token bucket
    (MoE 1, 16, 64, 256, 1024 tokens; projections 1 to 4096), and for each projection whether torch._scaled_mm
    (cuBLAS, block-scaled) or the Triton kernel is faster at each M.

    How long: a fast search times a few configurations per bucket picked by the shape, then their neighbours: about
    3 minutes per shape and kind on one GPU (a progress bar shows the ETA); --full times the whole grid.

    Where: one JSON file per shape, kind and GPU under <cache>/tuned/moe_configs and <cache>/tuned/gemm_configs,
    named as vLLM names its (E=128,I=768,H=2048,dtype=bfloat16,device=NVIDIA_H100_80GB_HBM3.json), each written
    after every bucket: stop it any time and --resume.

    How serve finds them: `tsdev serve` looks in your cache first, then in the files tsdev ships for this GPU,
    then in those of its sibling of the same architecture (H100 <-> H200), then uses defaults, and says at startup
    which file serves each shape. Nothing to pass: restart the server after tuning.

    Examples: tsdev tune --model ~/models/Qwen3-30B-A3B;  tsdev tune --model deepseek-v3 --tp 8 --kinds block-fp8;
    tsdev tune --moe 128,768,2048 --kinds fp8 --resume
    """
    targets = _jobs(model or [], tp or [1], kinds, moe or [], gemm or [])
    if not targets:
        typer.echo("nothing to tune: a dense bf16 model's projections run cuBLAS and the GEMV, which have no tuned "
                   "files; pass --kinds gemm for a block-FP8 one, or --moe / --gemm shapes", err=True)
        raise typer.Exit(2)
    out = out or tuned_dir()
    if dry_run:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "<GPU>"
        for job in targets:
            buckets = ", ".join(str(b) for j, b in pending([job], out, gpu, resume) if j == job)
            typer.echo(f"{job.describe()}: {job.path(out, gpu)}  buckets {buckets or '(done)'}")
        return
    timer = make_timer(jobs, rep)
    deadline = None if budget is None else time.monotonic() + budget
    try:
        done = tune(targets, timer, out, timer.gpu, resume=resume, full=full, deadline=deadline)
    finally:
        getattr(timer, "close", lambda: None)()
    left = len(pending(targets, out, timer.gpu, resume=True))
    typer.echo(f"{done} bucket(s) tuned into {out} for the {timer.gpu}" +
               (f"; {left} left: run again with --resume" if left else "; restart `tsdev serve` to use them"))
    if left:
        raise typer.Exit(STOPPED)


def _jobs(models: list[str], tps: list[int], kinds: str | None, moes: list[str], gemms: list[str]) -> list[Job]:
    chosen = tuple(k.strip() for k in kinds.split(",")) if kinds else None
    if chosen and (bad := [k for k in chosen if k not in KINDS]):
        raise typer.BadParameter(f"{', '.join(bad)}: use {', '.join(KINDS)}", param_hint="--kinds")
    jobs: list[Job] = []
    for name in models:
        try:
            label, config = resolve_model(name)
        except (ValueError, OSError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--model") from None
        for ranks in tps:
            jobs += jobs_for(config, ranks, chosen or default_kinds(config))
    for value in moes:
        e, i, h, *k = _ints("--moe", value, (3, 4))
        jobs += [Job(kind, (e, i, h, k[0] if k else 8)) for kind in (chosen or ("bf16",)) if kind != "gemm"]
    jobs += [Job("gemm", _ints("--gemm", value, (2,))) for value in gemms]
    return list(dict.fromkeys(jobs))  # a shape two models share: once
