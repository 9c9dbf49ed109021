"""The `tsdev` command line."""
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from tsdev_runtime.config import (API_KEY_ENV_VARS, KERNEL_CHECK_MODES, EngineConfig, ServerConfig,
                                  parse_size)  # no torch: serve's defaults are the configs'
from tsdev.cli_help import Context, Typer

LIST_FLAGS = ("--cudagraph-capture-sizes", "--prefill-graph-capture-sizes")
# Every reload recaptures every prefill bucket: the ladder (40 buckets up to 2048 tokens) takes 1.2-1.7 s of
# it on the H200, three buckets ~0.1 s. A server that allows reloads is for development: it pads prompts more
# and reloads faster.
RELOAD_PREFILL_BUCKETS = [256, 1024]


def _is_list_value(token: str) -> bool:
    """'16', '1,16,64', '1 16 64' (one quoted argv token): a list flag's value, not MODEL or another flag."""
    return bool(token.strip()) and all(part.isdigit() for part in re.split(r"[,\s]+", token.strip()))


def join_list_flags(argv: list[str]) -> list[str]:
    """Let list flags take their values as vLLM's do: `--cudagraph-capture-sizes 1 16 64`, or one token
    `"1,16,64"` / `"1 16 64"`; all become one comma-joined value. And vLLM's `--save-result` without a file
    name (`tsdev bench`) gets an empty value: the default file name."""
    out, i = [], 0
    while i < len(argv):
        out.append(argv[i])
        if argv[i] in LIST_FLAGS:
            values = []
            while i + 1 < len(argv) and _is_list_value(argv[i + 1]):
                i += 1
                values.append(argv[i])
            if values:  # none: click takes the next token and parse_sizes says what is wrong with it
                out.append(",".join(re.split(r"[,\s]+", " ".join(values).strip())))
        elif argv[i] == "--save-result" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("")
        i += 1
    return out


class _Group(TyperGroup):
    context_class = Context

    def main(self, args=None, *rest, **kwargs):
        """Every way in (the `tsdev` script, `python -m tsdev`, typer's CliRunner) reads list flags alike."""
        return super().main(join_list_flags(list(sys.argv[1:] if args is None else args)), *rest, **kwargs)


# Plain help (click's formatter, not rich's tables): it never truncates an option name, whatever the terminal
# width, and prints brackets as written. Up to 120 columns on a wide terminal.
app = Typer(
    help="Edit a Triton kernel or a layer, save, and see the effect on a running LLM server in about a second.",
    no_args_is_help=True,
    rich_markup_mode=None,
    cls=_Group,
    pretty_exceptions_enable=False,
    context_settings={"max_content_width": 120},
)


def parse_sizes(flag: str, value: str) -> list[int]:
    """A list flag's value ("1,16,64", "1 16 64") as sorted distinct positive integers."""
    try:
        sizes = sorted({int(v) for v in re.split(r"[,\s]+", value) if v})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise typer.BadParameter(f"give positive integers, e.g. {flag} 1 16 64", param_hint=flag)
    return sizes


def prefill_capture_sizes(flag: str | None, allow_reload_forward: bool) -> list[int] | None:
    """Explicit buckets from the flag; else a few when reloads are allowed; else None (the ladder)."""
    if flag:
        return parse_sizes("--prefill-graph-capture-sizes", flag)
    return list(RELOAD_PREFILL_BUCKETS) if allow_reload_forward else None


def api_key_option(help: str = "The server's API key, sent as `Authorization: Bearer KEY`."):
    """--api-key, read from the environment when not given (docs/security.md)."""
    return typer.Option("--api-key", envvar=list(API_KEY_ENV_VARS), metavar="KEY", show_default=False,
                        help=f"{help} Default: $TSDEV_API_KEY, else $VLLM_API_KEY: prefer the environment, which "
                             "`ps` does not show.")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@app.command(short_help="Serve a model over an OpenAI-compatible HTTP API.")
def serve(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(
        help="A Hugging Face checkpoint directory (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V2/V3), or a hub id "
             "(ORG/NAME) found in the local Hugging Face cache (never downloaded). Omit it (or give default) to serve "
             "the embedded default model; default-moe serves the embedded mixture of experts (Qwen3-MoE), default-fp8 "
             "and default-moe-fp8 those stored as block-quantized FP8, default-mla a DeepSeek-V3-kind model "
             "(multi-head latent attention).")] = None,
    model_opt: Annotated[Optional[str], typer.Option("--model", help="Same as the MODEL argument.")] = None,
    revision: Annotated[Optional[str], typer.Option(
        help="The cached revision of a hub id: a branch or tag (refs/ in the cache) or a "
             "commit hash. Default: main.")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(metavar="DIR", help="Where tokenizer.json (and the chat "
                                                     "template, tokenizer_config.json) come from, when not the "
                                                     "model's directory: a directory or a cached hub id.")] = None,
    chat_template: Annotated[Optional[Path], typer.Option(
        metavar="FILE", help="A jinja2 chat template to render chat prompts with, instead of the checkpoint's "
                             "own (chat_template.jinja, else tokenizer_config.json's).")] = None,
    device: Annotated[Optional[str], typer.Option(help="cuda or cpu; default: cuda when a GPU is visible.")] = None,
    host: Annotated[str, typer.Option(
        help="Address to bind. The default keeps the server private to this machine.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port for the HTTP API.")] = 8000,
    max_running: Annotated[int, typer.Option(
        "--max-running", "--max-num-seqs",
        help="Most requests computed at once (the batch size). Decode graphs are captured up to it: a larger value "
             "serves bigger batches from graphs but makes startup and "
             "every reload's recapture longer.")] = EngineConfig.max_running,
    max_batched_tokens: Annotated[int, typer.Option(
        "--max-batched-tokens", "--max-num-batched-tokens",
        help="Token budget per engine step; longer prompts are prefilled in "
             "chunks of this size.")] = EngineConfig.max_batched_tokens,
    kv_pages: Annotated[Optional[int], typer.Option(
        "--kv-pages", "--num-gpu-blocks-override",
        help="Pages (vLLM: blocks) in the KV pool; default: fit the free GPU memory (or max-running "
             "full contexts on CPU).")] = EngineConfig.kv_pages,
    page_size: Annotated[int, typer.Option(
        "--page-size", "--block-size", help="Tokens per KV page (vLLM: block).")] = EngineConfig.page_size,
    max_model_len: Annotated[Optional[int], typer.Option(
        help="Longest prompt + completion, in tokens; default: the "
             "model's, capped at 8192.")] = EngineConfig.max_model_len,
    dtype: Annotated[str, typer.Option(
        help="auto (checkpoint dtype on CUDA, float32 on CPU), bfloat16, float16, float32.")] = EngineConfig.dtype,
    gpu_memory_utilization: Annotated[float, typer.Option(
        help="Fraction of GPU memory the server may use in all.")] = EngineConfig.gpu_memory_utilization,
    load_format: Annotated[str, typer.Option(
        metavar="auto|pinned|plain", help="How weights reach the GPU. pinned: reader threads fill a page-locked "
             "staging buffer, copied to the GPU while the next part is read; plain: safetensors, one tensor at a "
             "time. auto: pinned on CUDA (plain, with a warning, if pinning fails), "
             "plain on CPU.")] = EngineConfig.load_format,
    load_memory_limit: Annotated[str, typer.Option(
        metavar="SIZE", help="Most host memory the pinned staging buffer may take: bytes, or e.g. 16GiB, "
                             "512MB.")] = f"{EngineConfig.load_memory_limit >> 30}GiB",
    quantization: Annotated[Optional[str], typer.Option(
        "--quantization", "-q", metavar="fp8", help="fp8: projections and MoE experts in e4m3 with per-output-channel "
             "scales derived from the checkpoint's weights at load (which stay loaded too); past a few tokens a step, "
             "activations are quantized too, per token at run time. CUDA needs compute capability >= 8.9, CPU runs "
             "the torch references. Not needed (and refused) for a checkpoint stored as FP8: one whose config.json "
             "says quantization_config fp8 with weight_block_size [128, 128] (Qwen's *-FP8, DeepSeek-V3) loads as "
             "stored.")] = EngineConfig.quantization,
    kv_cache_dtype: Annotated[str, typer.Option(
        "--kv-cache-dtype", metavar="auto|fp8|fp8_e4m3", help="The KV pool's dtype. auto: the model's; fp8 (= "
             "fp8_e4m3): e4m3 with a scale of 1 per tensor, half the bytes per token, so the pool holds twice the "
             "tokens in the same memory and decode attention reads half as much; keys and values are rounded to 3 "
             "mantissa bits (docs/runtime.md, \"An fp8 KV cache\").")] = EngineConfig.kv_cache_dtype,
    no_prefix_caching: Annotated[bool, typer.Option(
        "--no-prefix-caching/--enable-prefix-caching", "--no-enable-prefix-caching", show_default=False,
        help="Do not share KV pages between requests with a common prefix "
             "(shared by default).")] = not EngineConfig.enable_prefix_caching,
    served_model_name: Annotated[Optional[str], typer.Option(
        help="Model name in the API; default: the checkpoint directory's name.")] = None,
    seed: Annotated[int, typer.Option(
        help="Seed of the noise for requests that give no seed of their own.")] = EngineConfig.seed,
    cudagraph_capture_sizes: Annotated[Optional[str], typer.Option(
        metavar="SIZES", help="Decode batch sizes to capture as CUDA graphs, e.g. `--cudagraph-capture-sizes 1 16 64` "
             "(or 1,16,64); larger batches run eagerly. Default: 1 2 4 8 16 24 ... 256 (up to --max-running). Fewer "
             "sizes capture faster (and reload faster).")] = None,
    enforce_eager: Annotated[bool, typer.Option(
        "--enforce-eager", help="No CUDA graphs: every step runs eagerly.")] = EngineConfig.enforce_eager,
    prefill_graph_max_tokens: Annotated[int, typer.Option(
        help="Largest token count of a prefill (or mixed prefill + decode) step replayed from a breakable CUDA graph "
             "(attention runs eagerly between graph pieces); clamped to --max-batched-tokens. Buckets step from 16 by "
             "about 1/8 of their size. 0 turns prefill graphs off.")] = EngineConfig.prefill_graph_max_tokens,
    disable_prefill_graph: Annotated[bool, typer.Option(
        "--disable-prefill-graph", help="Run prefill and mixed steps eagerly (decode graphs stay on).")] = False,
    prefill_graph_capture_sizes: Annotated[Optional[str], typer.Option(
        metavar="SIZES", help="Explicit prefill token buckets instead of the ladder, e.g. "
             "`--prefill-graph-capture-sizes 64 256 1024`; clamped to the largest, which is always captured. Default: "
             "the ladder; with --allow-reload-forward, 256 1024 (fewer graphs to "
             "recapture after each reload).")] = None,
    cudagraph_capture_first: Annotated[Optional[str], typer.Option(
        metavar="SIZES", help="Capture only these decode batch sizes before serving, the others between steps after "
             "(eager until then): a shorter start. tsdev watch passes, on a restart, the sizes the server it replaces "
             "had used.")] = None,
    prefill_graph_capture_first: Annotated[Optional[str], typer.Option(
        metavar="SIZES", help="The same for the prefill token buckets.")] = None,
    full_recapture: Annotated[bool, typer.Option(
        "--full-recapture", help="A reload captures every CUDA graph again before serving resumes. Default: a "
             "reload that changed only Triton kernel bodies points the captured graphs' kernel nodes at the new "
             "binaries (milliseconds, every graph); any other captures only the batch sizes and prefill buckets used "
             "since the last capture, the others one at a time between steps right after, eager until then (a "
             "shorter pause).")] = EngineConfig.full_recapture,
    allow_reload_forward: Annotated[bool, typer.Option(
        "--allow-reload-forward",
        help="Enable POST /v1/rl/engine/reload_forward, which re-executes edited model/kernel code from disk "
             "in this process. For development only (`tsdev watch` turns it on); without it the route answers 403. "
             "With a --host other than loopback it needs --api-key.")] = False,
    kernel_check: Annotated[Optional[str], typer.Option(
        metavar="report|strict|off",
        help="With --allow-reload-forward: a reload that changes a Triton kernel (or an @jit helper it calls) checks "
             "each changed op against its torch reference at the serving shapes, on fresh random inputs, and times "
             "it before and after (the reply's kernel_checks, the reload line). report: say so (checked once serving "
             "resumed: the pause does not wait); strict: checked in the pause, a check that fails rolls the reload "
             "back; off: no checks. The checks run the Triton kernels: on a GPU, or on the CPU under "
             "TRITON_INTERPRET=1 (strict is refused elsewhere; report says they are off). `tsdev reload "
             "--kernel-check` picks one for one reload. Default: report.")] = None,
    compile_workers: Annotated[Optional[int], typer.Option(
        metavar="N", show_default=False,
        help="With --allow-reload-forward on a GPU: N processes that compile an edit's Triton kernels side by side "
             "while the old code serves, started with the server (Triton imported, the compiler warmed up). "
             "Default: half the CPU cores, at most 8 (a never-seen edit served in 0.83 s instead of 2.69 s on the "
             "H200); 0: one after another in the server.")] = None,
    api_key: Annotated[Optional[str], api_key_option(
        "Require `Authorization: Bearer KEY` on every route but /health and /metrics (401 otherwise); "
        "docs/security.md.")] = None,
    allow_remote_control: Annotated[bool, typer.Option(
        "--allow-remote-control", help="Let control routes (reload, pause, profile, events, ...) answer clients on "
                                       "other machines without an API key; by default only loopback clients (403). "
                                       "For development on a trusted network only.")] = False,
    metrics_require_api_key: Annotated[bool, typer.Option(
        "--metrics-require-api-key", help="Close /metrics behind --api-key too (it is open by default, for "
                                          "Prometheus).")] = False,
    profile_dir: Annotated[str, typer.Option(
        metavar="DIR", help="Where POST /start_profile writes traces; a request may name a subdirectory, never a "
                            "path outside it.")] = ServerConfig.profile_dir,
    allowed_weight_dir: Annotated[Optional[list[str]], typer.Option(
        "--allowed-weight-dir", metavar="DIR", help="A directory the weight routes may load checkpoints from, besides "
                                                    "the served model's. Repeatable.")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level (warning shows errors only).")] = "warning",
    api_process: Annotated[bool, typer.Option(
        "--api-process/--no-api-process",
        help="Serve HTTP from a process of its own: tokenizing, chat templates, detokenizing, stop strings, logprobs, "
             "JSON and SSE run there, and the engine's process only schedules and launches steps, fed token ids "
             "(docs/architecture.md). --no-api-process: one process does both (the host's Python then paces the "
             "steps at large batches).")] = ServerConfig.api_process,
    tp: Annotated[int, typer.Option(
        "--tp", "--tensor-parallel-size", metavar="N",
        help="Tensor-parallel ranks: the heads, the MLP and the vocabulary split over N GPUs (CPU: N processes over "
             "gloo), one process each, started by this command (or by torchrun: docs/parallel.md). Weight checksums "
             "(and tsdev weights verify) need --tp 1 for now.")] = EngineConfig.world_size,
    dp: Annotated[int, typer.Option(
        "--dp", "--data-parallel-size", metavar="N",
        help="Engine replicas (each with --tp ranks of its own, on its own GPUs) behind one HTTP front: completions "
             "go to the least busy replica; reloads, weight loads and other control calls reach every replica "
             "(docs/parallel.md).")] = 1,
    rank_timeout: Annotated[float, typer.Option(
        metavar="SECONDS", help="With --tp: how long rank 0 waits for another rank's outcome of a call "
        "(warm-up, graph capture, a reload) before it takes that rank for wedged and stops the server (status 70; "
        "tsdev watch restarts it).")] = EngineConfig.rank_timeout_s,
    max_request_body_bytes: Annotated[int, typer.Option(
        metavar="BYTES", help="Largest request body accepted (4 MiB by default); a larger one is answered 413 "
                              "before it is parsed.")] = ServerConfig.max_request_body_bytes,
):
    """Serve a Llama, Qwen2, Qwen3, Qwen3-MoE or DeepSeek-V2/V3 model (bf16, or stored as block FP8) over an
    OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    from rich.console import Console
    from rich.markup import escape

    from tsdev.serve_flags import problem

    console = Console(stderr=True, soft_wrap=True)
    if why := problem(ctx.command, ctx.params):  # before anything imports, binds or loads
        console.print(f"[red]error:[/red] {escape(why)}", highlight=False)
        raise typer.Exit(2)
    console.print(f"starting tsdev serve: {model or model_opt or 'the embedded default model'}"
                  f"{f' on {device}' if device else ''} (torch imports first; a first start on a machine compiles its "
                  "kernels, saying which as it goes)", highlight=False, markup=False)

    from tsdev.launch.serve import early_compile_pool, nvidia_gpu_visible, run_server  # (torch when run)
    from tsdev_runtime.weights.default_model import DEFAULT_NAMES, EMBEDDED_NAMES, write_ahead

    early_pool = early_compile_pool(device, allow_reload_forward, compile_workers, tp * dp)  # before torch
    if early_pool is not None:
        ctx.call_on_close(early_pool.close)  # however the command ends
    name = model or model_opt
    if name in DEFAULT_NAMES and (device or "cuda").startswith("cuda") and nvidia_gpu_visible():
        write_ahead(device or "cuda", name)  # a GPU's first run writes its embedded checkpoint beside torch's import
    if device and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            console.print(f"[red]error:[/red] --device {device}, but this torch ({torch.__version__}) sees no CUDA "
                          "GPU: use --device cpu, or install a CUDA build of torch on a machine with a GPU")
            raise typer.Exit(2)
    from tsdev_runtime.weights.hub import is_hub_id, resolve_model

    try:
        checkpoint = name if name in DEFAULT_NAMES else str(resolve_model(name, revision, EMBEDDED_NAMES))
        tokenizer_dir = None if tokenizer is None else str(resolve_model(tokenizer))
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2)
    config = EngineConfig(
        model=checkpoint, tokenizer=tokenizer_dir, device=device or _default_device(), dtype=dtype,
        max_running=max_running,
        max_batched_tokens=max_batched_tokens, max_model_len=max_model_len, page_size=page_size, kv_pages=kv_pages,
        gpu_memory_utilization=gpu_memory_utilization, seed=seed, enable_prefix_caching=not no_prefix_caching,
        enforce_eager=enforce_eager, prefill_graph_max_tokens=0 if disable_prefill_graph else prefill_graph_max_tokens,
        load_format=load_format, load_memory_limit=parse_size(load_memory_limit), quantization=quantization,
        kv_cache_dtype=kv_cache_dtype, world_size=tp,
        rank_timeout_s=rank_timeout, full_recapture=full_recapture,
        kernel_check=kernel_check or EngineConfig.kernel_check,
    )
    if cudagraph_capture_sizes:
        config.cudagraph_capture_sizes = parse_sizes("--cudagraph-capture-sizes", cudagraph_capture_sizes)
    config.prefill_graph_capture_sizes = prefill_capture_sizes(prefill_graph_capture_sizes, allow_reload_forward)
    if allow_reload_forward and config.kernel_check == "strict":
        from tsdev_runtime.engine.kernel_checks import why_off

        if why := why_off(config.device):
            console.print(f"[red]error:[/red] --kernel-check strict cannot hold here: {escape(why)}; use "
                          "--kernel-check report", highlight=False)
            raise typer.Exit(2)
    if cudagraph_capture_first:
        config.cudagraph_capture_first = parse_sizes("--cudagraph-capture-first", cudagraph_capture_first)
    if prefill_graph_capture_first:
        config.prefill_graph_capture_first = parse_sizes("--prefill-graph-capture-first", prefill_graph_capture_first)
    if served_model_name is None and name is not None and (is_hub_id(name) or name in DEFAULT_NAMES):
        served_model_name = name  # the hub id, as vLLM serves it
    server = ServerConfig(host=host, port=port, served_model_name=served_model_name, log_level=log_level,
                          chat_template=str(chat_template) if chat_template else None,
                          allow_reload_forward=allow_reload_forward, compile_workers=compile_workers,
                          max_request_body_bytes=max_request_body_bytes,
                          api_key=api_key or None, allow_remote_control=allow_remote_control,
                          metrics_require_api_key=metrics_require_api_key, profile_dir=profile_dir,
                          allowed_weight_dirs=list(allowed_weight_dir or []), api_process=api_process)
    if dp > 1:
        from tsdev.launch.data_parallel import run_front

        raise typer.Exit(run_front(server, dp, tp, sys.argv[sys.argv.index("serve") + 1 :], console))
    raise typer.Exit(run_server(config, server, console, early_pool))


@app.command(short_help="Reload the server's forward pass after an edit.")
def reload(
    url: Annotated[str, typer.Option(
        help="The server (started with --allow-reload-forward, or by `tsdev watch`).")] = "http://127.0.0.1:8000",
    modules: Annotated[Optional[list[str]], typer.Option(
        "--modules", "-m", metavar="MODULE",
        help="Force these modules (and their dependents) to re-execute, changed or not. Repeat "
             "the flag for several.")] = None,
    mode: Annotated[str, typer.Option(
        help="wait: running requests finish first; abort: they are aborted.")] = "wait",
    timeout_s: Annotated[Optional[float], typer.Option(
        help="Give up (changing nothing) if drain + reload take longer.")] = None,
    files: Annotated[Optional[list[str]], typer.Option(
        "--file", "-f", metavar="PATH",
        help="A file just saved (for editor save hooks): reload what changed, or say that nothing did; files outside "
             "the reloadable packages' projects are ignored. Repeatable.")] = None,
    recapture: Annotated[bool, typer.Option(help="Capture the CUDA graphs again even when only Triton kernel bodies "
                                                 "changed (the server then points the captured graphs at the new "
                                                 "binaries instead).")] = False,
    kernel_check: Annotated[Optional[str], typer.Option(
        metavar="report|strict|off", show_default=False,
        help="This reload's kernel checks instead of the server's --kernel-check: strict rolls the edit back when a "
             "changed kernel fails its reference check; report checks once serving resumed; off skips them.")] = None,
    ahead: Annotated[Optional[str], typer.Option(
        "--ahead", metavar="PATH",
        help="Compile ahead, reload nothing: PATH's unsaved text (from --stdin or --text, else the file) is sent to "
             "the server, which builds the Triton kernels it changes while the old code serves; saving that text "
             "then reloads without compiling them. For editor hooks that fire on idle (docs/editor-hooks.md). Exit "
             "status 0 built or nothing to build, 1 the text (or a kernel) does not compile, 2 no server or "
             "refused.")] = None,
    stdin: Annotated[bool, typer.Option(
        "--stdin", help="With --ahead: the buffer's text from standard input.")] = False,
    text: Annotated[Optional[str], typer.Option(
        "--text", metavar="TEXT", help="With --ahead: the buffer's text itself (VS Code's ${selectedText}).")] = None,
    api_key: Annotated[Optional[str], api_key_option()] = None,
):
    """Reload the server's forward pass now: edited modules and their dependents re-execute in place.

    Prints one line per worker, its first words the outcome. While the reload waits (running requests
    finishing first in --mode wait, or a slow step) it shows which step runs and for how long.

    Exit status (for editor save hooks and scripts):

    \b
      0  reloaded, or nothing to reload
      3  needs a server restart: an edit outside the reloadable packages
         (even when other modules reloaded); `tsdev watch` restarts by itself
      1  the reload failed (file:line shown); the old code keeps serving
      2  no server at --url, or it refused (403: no --allow-reload-forward;
         401: no or a wrong --api-key)
    """
    from rich.console import Console
    from rich.markup import escape

    from tsdev import outcome
    from tsdev.client import ErrorReply, reload_forward

    console = Console(soft_wrap=True, highlight=False)
    if ahead is not None:
        if files or modules:
            raise typer.BadParameter("--ahead takes one file and reloads nothing: leave out --file and --modules")
        raise typer.Exit(_compile_ahead(url, ahead, stdin, text, api_key, console))
    if stdin or text is not None:
        raise typer.BadParameter("--stdin and --text go with --ahead PATH (the buffer's text)")
    if mode not in ("wait", "abort"):
        raise typer.BadParameter("--mode is wait or abort")
    if kernel_check is not None and kernel_check not in KERNEL_CHECK_MODES:
        raise typer.BadParameter(f"use one of {', '.join(KERNEL_CHECK_MODES)}", param_hint="--kernel-check")
    import httpx

    if files:
        from tsdev.watch.watcher import classify_files

        saved, others, ignored = classify_files(files)
        if not saved and not others:
            console.print(f"nothing to reload: {', '.join(ignored)} not in a reloadable package's project")
            raise typer.Exit(outcome.RELOADED)
        # not forced: the server reloads what changed since the last reload (the saved files, if they did) and
        # reports an edit outside the reloadable packages as needing a restart

    progress = outcome.ReloadProgress(console, mode)
    try:
        reply = reload_forward(url, modules, mode, timeout_s, on_event=progress.event, on_tick=progress.tick,
                               api_key=api_key, recapture=recapture, kernel_check=kernel_check)
    except httpx.TimeoutException:
        console.print(f"[red]error:[/red] no reply from {url} within --timeout-s + 30 s: the reload may still be "
                      "running; its outcome shows in the server's log and in `tsdev watch`")
        raise typer.Exit(outcome.FAILED) from None
    except httpx.TransportError as exc:
        console.print(f"[red]error:[/red] cannot reach {url} ({exc}): is a server running there? Start one with "
                      "`tsdev watch` or `tsdev serve --allow-reload-forward`, or pass --url")
        raise typer.Exit(outcome.UNREACHABLE) from None
    except ErrorReply as exc:  # 4xx: refused (403 without --allow-reload-forward, 401 without the key, ...)
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(outcome.FAILED if exc.status >= 500 else outcome.UNREACHABLE) from None
    finally:
        progress.close()
    if files and not modules and reply.ok and not any(w.reloaded or w.needs_restart for w in reply.workers):
        console.print(f"nothing changed: {', '.join(map(str, files))} holds the code the server runs (no source "
                      "changed since the last reload); `--modules MODULE` re-executes a module anyway")
        raise typer.Exit(outcome.RELOADED)
    for worker in reply.workers:
        console.print(outcome.worker_text(worker))
    raise typer.Exit(outcome.exit_status(reply))


def _compile_ahead(url: str, path: str, stdin: bool, text: str | None, api_key: str | None, console) -> int:
    """`tsdev reload --ahead PATH`: the buffer sent (a file outside the reloadable packages is not: nothing of it
    compiles ahead), the server's answer printed; the exit status."""
    import httpx
    from rich.markup import escape

    from tsdev import outcome
    from tsdev.client import ErrorReply, compile_ahead
    from tsdev.watch.watcher import classify_files

    if stdin and text is not None:
        raise typer.BadParameter("--stdin or --text, not both")
    reloadable, others, _ = classify_files([path])
    if not reloadable:
        why = ("outside the reloadable packages: its save restarts the server" if others
               else "not in a reloadable package's project")
        console.print(f"nothing to compile ahead: {escape(path)} is {why}")
        return outcome.RELOADED
    try:
        buffer = sys.stdin.read() if stdin else text if text is not None else Path(path).read_text()
        reply = compile_ahead(url, os.path.abspath(path), buffer, api_key)
    except OSError as exc:
        console.print(f"[red]error:[/red] cannot read {escape(path)}: {exc}")
        return outcome.FAILED
    except httpx.TimeoutException:
        console.print(f"[red]error:[/red] no reply from {url} within 600 s")
        return outcome.FAILED
    except httpx.TransportError as exc:
        console.print(f"[red]error:[/red] cannot reach {url} ({exc}): is a server running there? Start one with "
                      "`tsdev watch` or `tsdev serve --allow-reload-forward`, or pass --url")
        return outcome.UNREACHABLE
    except ErrorReply as exc:  # 403 without --allow-reload-forward, 400 a path the server refuses, 401 no key
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return outcome.FAILED if exc.status >= 500 else outcome.UNREACHABLE
    console.print(escape(outcome.ahead_text(reply)), style=None if reply.ok else "red")
    return outcome.RELOADED if reply.ok else outcome.FAILED


@app.command(short_help="Check the server's Triton kernels against their torch references, now.")
def check(
    ops: Annotated[Optional[list[str]], typer.Argument(
        metavar="OPS", show_default=False,
        help="Ops to check (e.g. silu_and_mul rms_norm); default: all.")] = None,
    url: Annotated[str, typer.Option(
        help="The server (started with --allow-reload-forward, or by `tsdev watch`).")] = "http://127.0.0.1:8000",
    shapes: Annotated[bool, typer.Option("--shapes", help="A line per op and shape instead of one per op.")] = False,
    api_key: Annotated[Optional[str], api_key_option()] = None,
):
    """Run each op's Triton kernel against its torch reference in the server, at the shapes it serves (its decode
    batch sizes and prefill buckets, its model's dimensions), on fresh random inputs, and time it when the server
    is idle: the quick "did I break anything" between edits. A reload runs the same checks on the ops it changed
    (`tsdev serve --kernel-check`); docs/kernels.md says how an op declares its check.

    The server runs one op and shape at a time, between requests (a completion waits for one case at most), and
    stops when this command does: Ctrl-C stops the server's check too. The case running shows on stderr (a status
    line on a terminal, a line per case elsewhere); the summary goes to stdout.

    Exit status: 0 every check passed, 1 one failed, 2 no server at --url or it refused (403: no
    --allow-reload-forward; 400: an op no family declares, the reply lists them; 409: another check runs),
    130 stopped by Ctrl-C.
    """
    import httpx
    from rich.console import Console
    from rich.markup import escape

    from tsdev import outcome
    from tsdev.client import ErrorReply, kernel_check

    console, errors = Console(soft_wrap=True, highlight=False), Console(stderr=True, soft_wrap=True, highlight=False)
    shown: dict = {"status": None, "said": None}

    def show(progress) -> None:
        """The case running ("checking rms_norm [256 x 1024] (12/80)") or the requests the check waits for: a live
        status line on a terminal, a line each elsewhere (a check under Triton's interpreter runs for minutes:
        silence looked like a hang)."""
        if progress.op is not None:
            text = (f"checking {progress.op} [{' x '.join(map(str, progress.shape))}] "
                    f"({progress.done + 1}/{progress.total})")
        else:
            text = (f"waiting for {progress.waiting_for} request(s) to finish: the check runs between requests "
                    f"({progress.done}/{progress.total} done)")
        if errors.is_terminal:
            if shown["status"] is None:
                shown["status"] = errors.status(escape(text))
                shown["status"].start()
            else:
                shown["status"].update(escape(text))
        elif text != shown["said"]:  # a wait is said again every second: once is enough here
            errors.print(escape(text))
        shown["said"] = text

    try:
        reply = kernel_check(url, ops, on_progress=show, api_key=api_key)
    except httpx.TransportError as exc:
        console.print(f"[red]error:[/red] cannot reach {url} ({exc}): is a server running there? Start one with "
                      "`tsdev watch` or `tsdev serve --allow-reload-forward`, or pass --url")
        raise typer.Exit(2) from None
    except ErrorReply as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:  # the connection closed as this left kernel_check: the server's check stops too
        console.print("stopped: the server stops its check after the case it is running")
        raise typer.Exit(130) from None
    finally:
        if shown["status"] is not None:
            shown["status"].stop()
    lines = outcome.checks_table(reply.checks) if shapes else outcome.checks_summary(reply.checks)
    for line in lines:
        console.print(escape(line))
    console.print(f"{len(reply.checks)} check(s) in {reply.seconds:.2f} s: "
                  f"{'all ok' if reply.ok else 'some FAILED'}")
    raise typer.Exit(0 if reply.ok else 1)


@app.command(short_help="Load-test a server: throughput, TTFT, TPOT, ITL.")
def bench(
    url: Annotated[str, typer.Option(
        "--url", "--base-url", help="Any OpenAI-compatible server.")] = "http://127.0.0.1:8000",
    endpoint: Annotated[str, typer.Option(
        metavar="ENDPOINT", help="/v1/completions (token-id prompts) or /v1/chat/completions (text prompts); "
                                 "completions and chat work too.")] = "/v1/completions",
    model: Annotated[Optional[str], typer.Option(help="Model name to send; default: the server's first model.")] = None,
    dataset_name: Annotated[Optional[str], typer.Option(
        metavar="NAME", help="random (generated prompts) or jsonl (vLLM: custom; the requests of --dataset-path). "
                             "Default: jsonl with --dataset-path, else random.")] = None,
    dataset_path: Annotated[Optional[Path], typer.Option(
        "--dataset-path", "--prompts", metavar="FILE.jsonl",
        help='The jsonl dataset: {"prompt": ..., "max_tokens": ...} or {"messages": [...]} per line.')] = None,
    num_prompts: Annotated[int, typer.Option(help="Requests to measure.")] = 100,
    input_len: Annotated[int, typer.Option(
        "--random-input-len", "--input-len", help="Prompt tokens per request (random dataset).")] = 256,
    output_len: Annotated[int, typer.Option(
        "--random-output-len", "--output-len", help="Output tokens per request (max_tokens; random dataset).")] = 128,
    range_ratio: Annotated[float, typer.Option(
        "--random-range-ratio", "--range-ratio",
        help="Lengths uniform in [len*(1-r), len*(1+r)], as in `vllm bench serve`.")] = 0.0,
    request_rate: Annotated[float, typer.Option(
        help="Requests per second (Poisson arrivals); inf sends all at once.")] = float("inf"),
    max_concurrency: Annotated[Optional[int], typer.Option(help="Most requests in flight at once.")] = None,
    ignore_eos: Annotated[bool, typer.Option(
        help="Generate exactly max_tokens (the server must support ignore_eos).")] = True,
    seed: Annotated[int, typer.Option(help="Seed of the workload (lengths, token ids, arrivals).")] = 0,
    warmup: Annotated[int, typer.Option(help="Requests sent (one at a time) before measuring.")] = 0,
    save_result: Annotated[Optional[str], typer.Option(
        metavar="[FILE.json]", help="Write metrics, config and per-request records as JSON: to FILE.json, or (vLLM's "
                                    "flag form, no value) "
                                    "to --result-filename, default bench-MODEL-DATE-TIME.json.")] = None,
    result_filename: Annotated[Optional[str], typer.Option(help="File name for --save-result (implies it).")] = None,
    result_dir: Annotated[Optional[Path], typer.Option(help="Folder for --save-result's file; default: here.")] = None,
    baseline: Annotated[Optional[Path], typer.Option(
        help="A JSON from --save-result: print the change per metric. Refused (exit status 2) when its endpoint or "
             "workload (dataset, lengths, range ratio, prompts, rate, concurrency, seed) "
             "differs from this run's.")] = None,
    api_key: Annotated[Optional[str], api_key_option()] = None,
):
    """Load-test a server and report throughput, TTFT, TPOT, ITL and latency (mean, median, p90, p99).

    Takes the workload flags of `vllm bench serve` (--dataset-name, --random-input-len, ...); tsdev's
    earlier names (--input-len, --output-len, --range-ratio, --prompts) still work.
    """
    import asyncio
    import json
    import time

    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from tsdev.bench import BenchConfig, run_bench, workload_differences
    from tsdev.bench_report import render

    console = Console(soft_wrap=True)

    def refuse(message: str):
        console.print(f"[red]error:[/red] {escape(message)}")
        raise typer.Exit(2)

    try:
        config = BenchConfig(url=url, endpoint=endpoint, model=model, num_prompts=num_prompts, input_len=input_len,
                             output_len=output_len, range_ratio=range_ratio, dataset_name=dataset_name,
                             prompts_file=str(dataset_path.resolve()) if dataset_path else None,
                             request_rate=request_rate, max_concurrency=max_concurrency, ignore_eos=ignore_eos,
                             seed=seed, warmup=warmup)
        config.check()
        before = json.loads(baseline.read_text()) if baseline else None
        differences = workload_differences(config, BenchConfig.saved(before["config"])) if before else []
    except (ValueError, OSError, KeyError, TypeError) as exc:
        refuse(str(exc) if not isinstance(exc, (KeyError, TypeError)) else f"--baseline {baseline}: not a saved result")
    if differences:
        refuse(f"--baseline {baseline} measured another workload, so the change per metric would compare unlike "
               "runs:\n  " + "\n  ".join(differences) + "\nRun with the baseline's values of these flags, or save "
               "a new baseline with --save-result (and drop --baseline).")
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("requests", total=num_prompts)
        try:
            result = asyncio.run(run_bench(config, lambda done, total: bar.update(task, completed=done), api_key))
        except (ConnectionError, PermissionError, ValueError) as exc:
            refuse(str(exc))
    console.print(render(result, before))
    if save_result is not None or result_filename:
        name = (result_filename or save_result
                or f"bench-{result['model'].replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json")
        path = (result_dir or Path()) / name
        path.write_text(json.dumps(result, indent=1))
        console.print(f"saved to {path}")
    raise typer.Exit(1 if result["metrics"]["failed_requests"] else 0)


@app.command(short_help="Serve under Nsight Systems, one report per reload.",
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             options_metavar="[MODEL] [SERVER FLAGS] [OPTIONS]")
def profile(
    ctx: typer.Context,
    out: Annotated[Optional[Path], typer.Option(help="Report folder; default profiles/<date-time>.")] = None,
    num_steps: Annotated[int, typer.Option(help="Engine steps per capture range.")] = 20,
    ranges: Annotated[Optional[int], typer.Option(help="Stop after this many ranges (default: until Ctrl-C).")] = None,
    port: Annotated[int, typer.Option(help="Port of the profiled server.")] = 8000,
    api_key: Annotated[Optional[str], api_key_option(
        "An API key the profiled server requires (passed in its environment, not its argv); profile sends it."
    )] = None,
):
    """Serve under Nsight Systems and take one report per reload: `tsdev profile [MODEL] [server flags]`.

    A range is taken at start (reload-0) and after every successful reload (`tsdev reload`, an editor hook,
    `tsdev watch --attach`), each while a small fixed workload runs; every report is summarised (top
    kernels by GPU time, NVTX step ranges, change against the previous range). nsys writes its reports
    when the server stops (Ctrl-C, or --ranges reached); they are then named reload-N and summarised.
    Without nsys it takes torch profiler traces instead, summarised as each range closes: GPU kernels by
    GPU time on a GPU server, CPU ops by self time on a CPU one, and the step ranges either way.
    """
    import time as _time

    from rich.console import Console

    from tsdev.profile import run_profile

    folder = out or Path("profiles") / _time.strftime("%Y%m%d-%H%M%S")
    raise typer.Exit(run_profile(list(ctx.args), folder, num_steps, ranges, port, Console(soft_wrap=True),
                                 api_key or None))


@app.command(short_help="Serve and reload on every save, with a live TUI.",
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             options_metavar="[MODEL] [SERVER FLAGS] [OPTIONS]")
def watch(
    ctx: typer.Context,
    attach: Annotated[Optional[str], typer.Option(
        help="Watch for a server that is already running at this URL instead of starting one (it cannot be "
             "restarted for you then).")] = None,
    no_tui: Annotated[bool, typer.Option(
        "--no-tui", help="One plain line per event instead of the screen (CI, editors, logs).")] = False,
    settle_ms: Annotated[int, typer.Option(
        help="Quiet time after the last file event before reloading, on top of watchfiles' 50 ms (editors write in "
             "bursts; raise it if a formatter rewrites the file after each save).")] = 50,
    probe_batch: Annotated[int, typer.Option(help="Batch size of the decode probe run after every reload.")] = 8,
    probe_steps: Annotated[Optional[int], typer.Option(
        help="Tokens per request of the decode probe (fewer: faster checks, a noisier figure). Default: 128 on a GPU, "
             "32 on the CPU.", show_default=False)] = None,
    server_log: Annotated[Optional[Path], typer.Option(
        help="Where the child server's output goes; default $TMPDIR/tsdev-watch-PORT.log.")] = None,
    profile_each_reload: Annotated[bool, typer.Option(
        "--profile-each-reload",
        help="Record every reload's decode probe in a profiler capture range (POST /start_profile), as `p` does "
             "for the next one.")] = False,
    weights: Annotated[Optional[Path], typer.Option(
        "--weights", metavar="DIR",
        help="Load each new complete checkpoint written into DIR (DIR itself, or its newest subdirectory such as "
             "DIR/step-123) with update_weights (direct), then run the checks; the server watch "
             "starts gets --allowed-weight-dir DIR.")] = None,
    api_key: Annotated[Optional[str], api_key_option(
        "An API key: the server watch starts requires it (passed in its environment, not its argv), and watch "
        "sends it. With --attach: the running server's key.")] = None,
):
    """Serve MODEL and reload it on every save: `tsdev watch [MODEL] [server flags...]`.

    Starts `tsdev serve --allow-reload-forward` with the server flags given (`tsdev serve --help` lists them).
    Reloads what changed on every save; restarts the server when an edit cannot be reloaded or when it dies.
    After every reload: a golden completion (did the output change?) and a decode probe (ms/step).

    Keys: r reload all, R restart, b quick bench, p profile next reload, g new golden, k kernel checks (of the reload
    selected in the history), c clear, q or ctrl+c quit.
    See docs/watch.md.
    """
    from tsdev.serve_flags import problem
    from tsdev.launch.child import flag_value
    from tsdev.watch import WatchConfig, run, serve_flags, split_server_args

    try:
        serve_command = typer.main.get_command(app).get_command(ctx, "serve")
        model, server_args = split_server_args(list(ctx.args), serve_flags(serve_command))
        if attach and (model or server_args):
            raise ValueError("--attach watches a running server: MODEL and server flags are for the server tsdev "
                             "watch starts")
        if not attach:  # the server's flags, refused here as `tsdev serve` would, before anything starts
            try:
                parsed = serve_command.make_context("serve", [*([model] if model else []), *server_args], parent=ctx)
            except typer.TyperException as exc:  # (click's errors: a value of the wrong type, an unknown flag)
                raise ValueError(exc.format_message()) from None
            if why := problem(serve_command, parsed.params):
                raise ValueError(why)
            if parsed.params["port"] == 0:
                raise ValueError("--port 0 (any free port) leaves tsdev watch without the server's address: give a "
                                 "port (default 8000)")
        config = WatchConfig(model=model, server_args=server_args, attach=attach, settle=settle_ms / 1000,
                             probe_batch=probe_batch, probe_steps=probe_steps, server_log=server_log,
                             profile_each_reload=profile_each_reload, api_key=api_key or None,
                             weights=weights.resolve() if weights else None,
                             host=flag_value(server_args, "--host") or "127.0.0.1",
                             port=int(flag_value(server_args, "--port") or 8000))
        code = run(config, tui=not no_tui)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command(short_help="Print or install an editor save hook.")
def hook(
    editor: Annotated[str, typer.Argument(help="vscode, neovim, emacs or jetbrains.")],
    install: Annotated[bool, typer.Option(
        "--install", help="Write it where the editor reads it (and say where) instead of printing it.")] = False,
    url: Annotated[Optional[str], typer.Option(help="The server to reload, if not http://127.0.0.1:8000.")] = None,
):
    """Print (or --install) an editor hook that runs `tsdev reload --file PATH` on every save. See
    docs/editor-hooks.md."""
    from tsdev.hooks import EDITORS, install as install_hook, snippet

    if editor not in EDITORS:
        raise typer.BadParameter(f"one of {', '.join(EDITORS)}", param_hint="EDITOR")
    if not install:
        hook_ = snippet(editor, url)
        typer.echo(hook_.text.rstrip("\n"))
        typer.echo(f"\n# goes in: {hook_.where}" + (f"\n# {hook_.note}" if hook_.note else ""), err=True)
        return
    try:
        for line in install_hook(editor, Path.cwd(), url):
            typer.echo(line)
    except (ValueError, FileExistsError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command(short_help="Every save tsdev watch saw: kernels' errors, µs, share of the limit; charts, best, restore.")
def history(
    kernel: Annotated[Optional[str], typer.Argument(
        help="A kernel (op) to chart: its µs per served shape across saves.")] = None,
    kernel_filter: Annotated[Optional[str], typer.Option("--kernel", help="Only saves that checked this op.")] = None,
    file: Annotated[Optional[str], typer.Option(help="Only saves of this file (a path, or its end).")] = None,
    since: Annotated[Optional[str], typer.Option(help="Only saves since: an age (30m, 2h, 3d) or a date.")] = None,
    outcome: Annotated[Optional[str], typer.Option(
        help="Only saves that ended so: ok, rolled back, kernel check failed, nothing to reload, restarted...")] = None,
    limit: Annotated[int, typer.Option(help="The newest this many saves (0: all).")] = 50,
    html_file: Annotated[Optional[Path], typer.Option(
        "--html", help="Write the charts as a self-contained page (KERNEL's, else every kernel's).")] = None,
    best: Annotated[Optional[str], typer.Option(
        help="The fastest version of this op that passed its check, with its diff from the file now.")] = None,
    shape: Annotated[Optional[str], typer.Option(help="One served shape, as shown (256x1024).")] = None,
    restore_id: Annotated[Optional[int], typer.Option(
        "--restore", help="Write the files of save ID back (a running tsdev watch reloads them).")] = None,
    prune: Annotated[bool, typer.Option(
        help="Delete old saves now (never a kernel's best): by --keep-days and --max-mb, else [tool.tsdev] "
             "history-keep-days / history-max-mb.")] = False,
    keep_days: Annotated[Optional[float], typer.Option(help="With --prune: keep this many days (0: no limit).")] = None,
    max_mb: Annotated[Optional[float], typer.Option(help="With --prune: stay under this many MB (0: none).")] = None,
    project: Annotated[Path, typer.Option(help="The project tsdev watch ran in (its notebook).")] = Path("."),
):
    """The project's notebook: one record per save `tsdev watch` saw (docs/watch.md, "The notebook")."""
    from rich.console import Console

    from tsdev import history as h
    from tsdev.notebook import Notebook, notebook_path, prune_settings

    console, path = Console(highlight=False), notebook_path(project)
    if not path.is_file():
        console.print(f"no notebook for {project.resolve()} yet ({path}): `tsdev watch` writes one record per save")
        raise typer.Exit(0 if restore_id is None and best is None else 2)
    notebook = Notebook(path)
    if prune:
        days, mb = prune_settings(project)
        deleted = notebook.prune(days if keep_days is None else (keep_days or None),
                                 mb if max_mb is None else (max_mb or None))
        console.print(f"pruned {deleted} save(s); the notebook uses {notebook.used_mb():.1f} MB")
    elif restore_id is not None:
        try:
            written = h.restore(notebook, restore_id, project)
        except ValueError as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from None
        console.print(f"restored save #{restore_id}: " + (", ".join(written) or "the files already hold it")
                      + (" (a running tsdev watch reloads them)" if written else ""))
    elif best is not None:
        found, lines = h.best_report(notebook, best, shape, project)
        console.print("\n".join(lines), markup=False)
        raise typer.Exit(0 if found is not None else 1)
    elif html_file is not None:
        html_file.write_text(h.html_page(notebook, [kernel] if kernel else notebook.ops(), shape))
        console.print(f"wrote {html_file}")
    elif kernel is not None:
        for line in h.chart(notebook, kernel, shape):
            console.print(line)
    else:
        try:
            since_at = h.parse_since(since) if since else None
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--since") from None
        console.print(h.saves_table(notebook, kernel_filter, file, since_at, outcome, limit or None))


from tsdev.weights_cli import sleep, wake, weights_app  # noqa: E402

app.command(short_help="Put a server to sleep: its GPU memory freed.")(sleep)
app.command(short_help="Wake a sleeping server.")(wake)
app.add_typer(weights_app, name="weights", short_help="Reload, update or verify a server's weights.")

from tsdev.tune_cli import tune_command  # noqa: E402

app.command("tune", short_help="Tune the MoE and block-FP8 kernels for this GPU at a model's shapes.")(tune_command)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"tsdev {version('tsdev')}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="Print tsdev's version and exit.")] = False) -> None:
    """tsdev: serve an LLM and hot-reload its forward pass while you edit its kernels."""
