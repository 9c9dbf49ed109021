"""Talking to a tsdev (or any seed-style) server over HTTP, and printing what it says."""
import subprocess
import time
import uuid

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


RELOAD_ROUTE = "/v1/rl/engine/reload_forward"


def reload_body(modules: list[str] | None = None, mode: str = "wait", timeout_s: float | None = None,
                request_id: str | None = None) -> dict:
    body = {"id": request_id or f"reload-{uuid.uuid4().hex[:12]}", "mode": mode}
    if modules:
        body["modules"] = modules
    if timeout_s:
        body["timeout_s"] = timeout_s
    return body


def reply_or_raise(response: httpx.Response) -> dict:
    """The JSON reply of a 200; RuntimeError("status: the error's message") otherwise."""
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        raise RuntimeError(f"{response.status_code}: {message}")
    return response.json()


def reload_forward(url: str, modules: list[str] | None = None, mode: str = "wait",
                   timeout_s: float | None = None) -> dict:
    """POST reload_forward and return the reply; raises httpx errors and RuntimeError for refusals."""
    response = httpx.post(url.rstrip("/") + RELOAD_ROUTE, json=reload_body(modules, mode, timeout_s),
                          timeout=None if timeout_s is None else timeout_s + 30)
    return reply_or_raise(response)


def graph_split(timings: dict, step: str = "recapture") -> str:
    """' (decode 0.25, prefill 0.20)' after the recapture step when the server reports the two graph kinds
    apart; '' for any other step."""
    kinds = [(k, timings[f"{step}_{k}"]) for k in ("decode", "prefill") if f"{step}_{k}" in timings]
    return f" ({', '.join(f'{k} {s:.2f}' for k, s in kinds)})" if kinds else ""


def worker_notes(worker: dict) -> list[str]:
    """What a successful reload still wants the user to know: warnings, and definitions left stale."""
    notes = [f"warning: {w}" for w in worker.get("warnings") or []]
    if worker.get("stale"):
        names = ", ".join(s.get("name", "?") if isinstance(s, dict) else str(s) for s in worker["stale"])
        notes.append(f"stale (could not be patched): {names}")
    return notes


def format_worker(worker: dict) -> str:
    """One line per worker, as the README shows it, with rich markup (stripped when not a terminal)."""
    t = worker.get("timings", {})
    rank = f"[dim]rank {worker['rank']}:[/dim] " if worker.get("rank") else ""
    if not worker.get("ok"):
        return f"{rank}[red]reload failed[/red]: {worker.get('error')}"
    reloaded = ", ".join(worker.get("reloaded") or []) or "nothing (no source changed)"
    line = (f"{rank}reloaded [bold]{reloaded}[/bold] and {len(worker.get('dependents') or [])} dependent module(s), "
            f"{worker.get('patched', 0)} object(s) patched in {t.get('reload', 0):.2f} s;\n"
            f"warmed in {t.get('warm', 0):.2f} s; recaptured in {t.get('recapture', 0):.2f} s{graph_split(t)}; "
            f"JIT-compiled {worker.get('jit_kernels', 0)} kernel(s) in {t.get('jit', 0):.2f} s; "
            f"serving paused {t.get('pause', 0):.2f} s")
    for note in worker_notes(worker):
        line += f"\n[yellow]{note}[/yellow]"
    if worker.get("needs_restart"):
        line += f"\n[yellow]needs restart: {', '.join(worker['needs_restart'])} changed outside the reloadable packages[/yellow]"
    return line


def wait_until_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 600, log=None,
                       interval: float = 0.2) -> None:
    """Poll GET /health every `interval` s until it answers 200; fail early if `proc` (the server) exits.
    `log()` adds context."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was healthy"
                               + (f":\n{log()}" if log else ""))
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server at {url} was not healthy within {timeout:.0f} s" + (f":\n{log()}" if log else ""))
        time.sleep(interval)
