"""`tsdev sleep`, `tsdev wake` and `tsdev weights reload|update|verify|drill`: a server's sleep mode and weights.

sleep, wake, reload and update are control calls over HTTP (with the API key, as `tsdev reload`); `verify` asks a
server for its checksums and compares them with a fresh in-process load; `drill` builds engines in-process, as
`tsdev serve` does (docs/runtime.md, "Sleep, wake and weight reloads").
"""
import os
from typing import Annotated, Optional

import typer

from tsdev_runtime.config import API_KEY_ENV_VARS
from tsdev_runtime.control_protocol import SLEEP_TAGS
from tsdev.outcome import FAILED, UNREACHABLE  # the exit statuses tsdev reload documents
from tsdev.cli_help import Typer

URL_OPTION = typer.Option(help="The server.")
API_KEY = typer.Option("--api-key", envvar=list(API_KEY_ENV_VARS), metavar="KEY", show_default=False,
                       help="The server's API key (as `tsdev reload`). Default: $TSDEV_API_KEY, else $VLLM_API_KEY.")
weights_app = Typer(help="Reload or update a server's weights from disk, verify them against a checkpoint; "
                          "check sleep/wake/reload in-process (drill).",
                          no_args_is_help=True)


def _call(url: str, method: str, route: str, model, request=None, api_key: str | None = None):
    import httpx

    from tsdev.client import control_call

    try:
        return control_call(url, method, route, model, request, api_key)
    except httpx.TransportError as exc:
        typer.echo(f"error: cannot reach {url} ({exc}): is a server running there? pass --url", err=True)
        raise typer.Exit(UNREACHABLE) from None
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(FAILED) from None


def _state(reply) -> str:
    if reply.is_sleeping:
        return f"sleeping (level {reply.level}; asleep: {', '.join(reply.asleep)})"
    return "awake" if reply.weights_loaded else "awake, weights not loaded (tsdev weights reload)"


def sleep(
    level: Annotated[int, typer.Option(min=1, max=2, help="1: weights kept in host memory, KV discarded; 2: both "
                                       "discarded (reload the weights after waking).")] = 1,
    url: Annotated[str, URL_OPTION] = "http://127.0.0.1:8000",
    api_key: Annotated[Optional[str], API_KEY] = None,
):
    """Put a server to sleep (POST /sleep): its GPU memory (weights, KV pool, graphs) is given back."""
    from tsdev_runtime.control_protocol import SLEEP_ROUTE, SleepReply, SleepRequest

    reply = _call(url, "POST", SLEEP_ROUTE, SleepReply, SleepRequest(level=level), api_key)
    freed = f"; freed {reply.freed_bytes / 1e9:.2f} GB" if reply.freed_bytes else " (it was asleep already)"
    device = f" ({reply.device_freed_bytes / 1e9:.2f} GB came free on the device)" if reply.device_freed_bytes else ""
    typer.echo(f"{_state(reply)}{freed}{device} in {reply.seconds:.2f} s")


def wake(
    tags: Annotated[Optional[list[str]], typer.Option("--tags", help=f"What to wake ({', '.join(SLEEP_TAGS)}); "
                                                      "repeatable; default: everything.")] = None,
    url: Annotated[str, URL_OPTION] = "http://127.0.0.1:8000",
    api_key: Annotated[Optional[str], API_KEY] = None,
):
    """Wake a sleeping server (POST /wake_up); the CUDA graphs are recaptured once everything is back."""
    from tsdev_runtime.control_protocol import WAKE_UP_ROUTE, WakeUpReply, WakeUpRequest

    bad = [t for t in tags or [] if t not in SLEEP_TAGS]
    if bad:
        raise typer.BadParameter(f"{', '.join(bad)}: use {', '.join(SLEEP_TAGS)}", param_hint="--tags")
    reply = _call(url, "POST", WAKE_UP_ROUTE, WakeUpReply, WakeUpRequest(tags=tags or None), api_key)
    woken = ", ".join(reply.woken) or "nothing (it was awake)"
    typer.echo(f"{_state(reply)}; woke {woken} in {reply.seconds:.2f} s (recapture {reply.recapture_seconds:.2f} s)")


@weights_app.command("reload", short_help="Reload the served checkpoint into the running server.")
def reload_weights(
    path: Annotated[Optional[str], typer.Argument(help="A checkpoint under the served model's directory or an "
                                                  "--allowed-weight-dir (a relative path is taken from the current "
                                                  "directory, as the server's machine sees it); default: the served "
                                                  "model's.")] = None,
    url: Annotated[str, URL_OPTION] = "http://127.0.0.1:8000",
    api_key: Annotated[Optional[str], API_KEY] = None,
):
    """Reload the served weights from disk into the running server (POST /v1/rl/engine/reload_weights)."""
    from tsdev_runtime.control_protocol import RELOAD_WEIGHTS_ROUTE, ReloadWeightsReply, ReloadWeightsRequest

    if path is not None:
        path = os.path.abspath(path)  # the server would take a relative one from the model's directory
    reply = _call(url, "POST", RELOAD_WEIGHTS_ROUTE, ReloadWeightsReply, ReloadWeightsRequest(path=path), api_key)
    typer.echo(f"reloaded {reply.path}: {reply.format}, {reply.nbytes / 1e9:.2f} GB in {reply.load_seconds:.2f} s "
               f"({reply.seconds:.2f} s with the drain)")


@weights_app.command("update", short_help="Load new weights from a checkpoint, in place.")
def update_weights(
    path: Annotated[str, typer.Argument(help="A checkpoint under the served model's directory or an "
                                        "--allowed-weight-dir (as the server's machine sees it).")],
    mode: Annotated[str, typer.Option(help="direct: in place, the CUDA graphs kept; full: graphs recaptured (repairs "
                                      "a failed direct update).")] = "direct",
    update_id: Annotated[Optional[str], typer.Option("--id", help="A name for this update, echoed back.")] = None,
    url: Annotated[str, URL_OPTION] = "http://127.0.0.1:8000",
    api_key: Annotated[Optional[str], API_KEY] = None,
):
    """Update the served weights from a checkpoint (POST /v1/rl/engine/update_weights)."""
    from tsdev_runtime.control_protocol import (UPDATE_MODES, UPDATE_WEIGHTS_ROUTE, ReloadWeightsReply,
                                                UpdateWeightsRequest)

    if mode not in UPDATE_MODES:
        raise typer.BadParameter(f"{mode}: use {' or '.join(UPDATE_MODES)}", param_hint="--mode")
    request = UpdateWeightsRequest(path=os.path.abspath(path), mode=mode, id=update_id)
    reply = _call(url, "POST", UPDATE_WEIGHTS_ROUTE, ReloadWeightsReply, request, api_key)
    graphs = (f", graphs recaptured in {reply.recapture_seconds:.2f} s" if reply.mode == "full"
              else ", in place (graphs kept)")
    typer.echo(f"updated ({reply.mode}) from {reply.path}: {reply.format}, {reply.nbytes / 1e9:.2f} GB in "
               f"{reply.load_seconds:.2f} s{graphs} ({reply.seconds:.2f} s with the drain)")


@weights_app.command("verify", short_help="Compare a server's weights with a checkpoint.")
def verify(
    against: Annotated[str, typer.Option("--against", help="The checkpoint directory the server should hold.")],
    device: Annotated[Optional[str], typer.Option(help="Where to load it (default: the server's device).")] = None,
    url: Annotated[str, URL_OPTION] = "http://127.0.0.1:8000",
    api_key: Annotated[Optional[str], API_KEY] = None,
):
    """Compare a live server's weights (GET /v1/rl/engine/weights_checksum) with a fresh load of DIR in the server's
    dtype and quantization; exit 1 naming the tensors that differ."""
    import dataclasses

    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.control_protocol import (SERVER_INFO_ROUTE, WEIGHTS_CHECKSUM_ROUTE, ServerInfo,
                                                WeightsChecksumReply)
    from tsdev_runtime.engine.weights_drill import fresh_checksum

    info = _call(url, "GET", SERVER_INFO_ROUTE, ServerInfo, None, api_key)
    live = _call(url, "GET", WEIGHTS_CHECKSUM_ROUTE, WeightsChecksumReply, None, api_key)
    config = dataclasses.replace(EngineConfig(model=os.path.abspath(against), device=device or info.device),
                                 dtype=info.dtype, quantization=info.quantization)
    fresh = fresh_checksum(config)
    differ = sorted(n for n in live.tensors.keys() | fresh.keys() if live.tensors.get(n) != fresh.get(n))
    if differ:
        typer.echo(f"DIFFERENT: {len(differ)} of {len(fresh)} tensor(s) differ from a fresh load of {against}: "
                   f"{', '.join(differ[:20])}{', ...' if len(differ) > 20 else ''}", err=True)
        raise typer.Exit(FAILED)
    typer.echo(f"identical: all {len(fresh)} tensor(s) match a fresh load of {against} (overall {live.overall[:16]}; "
               f"the server took {live.seconds:.2f} s)")


@weights_app.command("drill", short_help="Check sleep, wake and reload rounds against a load.")
def drill(
    model: Annotated[Optional[str], typer.Argument(
        help="A checkpoint directory (a block-FP8 one too), or an embedded model: default-moe, default-fp8, "
             "default-moe-fp8, default-mla; default: the embedded dense model.")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds of sleep(2) -> wake_up -> reload_weights per mode.")] = 3,
    mode: Annotated[list[str], typer.Option("--mode", help="eager and/or graphs (repeatable).")] = ["eager", "graphs"],
    device: Annotated[Optional[str], typer.Option(help="cuda or cpu (default: cuda when there is one).")] = None,
    quantization: Annotated[Optional[str], typer.Option(help="e.g. fp8.")] = None,
):
    """Check that every round leaves every tensor (derived ones too) as a fresh load does, and greedy output the
    same; exit 1 naming what differs. TSDEV_DEBUG_DERIVED=skip (or rebind; rebuild for FP8 experts) is its
    negative control: it must fail."""
    import dataclasses

    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.weights_drill import DrillFailed, drill_modes

    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    bad = [m for m in mode if m not in ("eager", "graphs")]
    if bad:
        raise typer.BadParameter(f"{', '.join(bad)}: use eager or graphs", param_hint="--mode")
    config = EngineConfig(model=model, device=device)
    if quantization:
        config = dataclasses.replace(config, quantization=quantization)
    try:
        for report in drill_modes(config, rounds, tuple(mode), on_round=lambda m, n, t: typer.echo(
                f"{m} round {n}: " + ", ".join(f"{k} {v:.3f} s" for k, v in t.items()))):
            typer.echo(f"ok {report}")
    except DrillFailed as exc:
        typer.echo(f"FAILED: {exc}", err=True)
        raise typer.Exit(1) from None
