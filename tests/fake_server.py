"""An in-process stand-in for `tsdev serve --allow-reload-forward` (an httpx transport), for testing the
watch daemon and its screen quickly and deterministically: it records the reloads it is asked for and
answers them as told. The real server is exercised by tests/test_watch_e2e.py."""
import asyncio
import json
import time
from pathlib import Path

import httpx

from tsdev.watch.checks import prompt_ids

URL = "http://fake-server"
TIMINGS = {"jit": 0.078, "drain": 0.011, "flush": 0.002, "reload": 0.034, "warm": 0.123, "recapture": 0.456,
           "recapture_decode": 0.3, "recapture_prefill": 0.156, "pause": 0.63, "total": 0.64}  # the server's order


def ok_worker(reloaded=("kernels.ops.act",), dependents=("runtime.layers.norm",), **extra) -> dict:
    return {"rank": 0, "ok": True, "error": None, "reloaded": list(reloaded), "dependents": list(dependents),
            "patched": 3, "stale": [], "needs_restart": [], "jit_kernels": 1, "timings": dict(TIMINGS), **extra}


def failed_worker(error: str) -> dict:
    return {"rank": 0, "ok": False, "error": error, "reloaded": [], "dependents": [], "patched": 0, "stale": [],
            "needs_restart": [], "jit_kernels": 0, "timings": {"drain": 0.01, "flush": 0.0, "reload": 0.02}}


class FakeServer:
    def __init__(self):
        self.reloads: list[dict] = []  # bodies of the reload_forward calls, in order
        self.reload_delay = 0.0
        self.answer = lambda body: ok_worker()  # the worker entry to reply with
        self.output_changed_at: int | None = None  # golden tokens differ from here on, after the next reload
        self._changed_at = None
        self.pending_events: list[dict] = []  # delivered on the next events connection
        self.profiles: list[dict] = []
        self.loaded: list[str] | None = None  # GET /v1/rl/engine/modules answers these (None: no such route)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model", "vocab_size": 1000, "max_model_len": 512}]})
        if path == "/v1/completions":
            return self.completion(body)
        if path == "/v1/rl/engine/reload_forward":
            self.reloads.append(body)
            await asyncio.sleep(self.reload_delay)
            worker = self.answer(body)
            if worker["ok"] and worker["reloaded"]:
                self._changed_at = self.output_changed_at
            return httpx.Response(200, json={"id": body["id"], "ok": worker["ok"], "workers": [worker]})
        if path == "/v1/rl/engine/events":
            events, self.pending_events = [{"type": "hello", "paused": False}, *self.pending_events], []
            return httpx.Response(200, content="".join(f"data: {json.dumps(e)}\n\n" for e in events).encode(),
                                  headers={"content-type": "text/event-stream"})
        if path == "/v1/rl/engine/modules" and self.loaded is not None:
            return httpx.Response(200, json={"modules": self.loaded})
        if path == "/start_profile":
            self.profiles.append(body)
            return httpx.Response(200, json={"n": len(self.profiles), "name": body.get("name")})
        return httpx.Response(404, json={"error": {"message": f"no route {path}"}})

    def completion(self, body: dict) -> httpx.Response:
        first = body["prompt"][0]
        ids = [first + i for i in range(body["max_tokens"])]
        if self._changed_at is not None and body["prompt"] == prompt_ids(0, 1000) and len(ids) > self._changed_at:
            ids[self._changed_at] += 1
        chunks = [{"choices": [{"index": 0, "text": f"t{i}", "token_ids": [i], "finish_reason": None}]} for i in ids]
        stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=stream.encode(), headers={"content-type": "text/event-stream"})


def make_project(root: Path) -> Path:
    """A small project with two reloadable packages and one that is not."""
    files = {"kernels/__init__.py": "", "kernels/ops/__init__.py": "", "kernels/ops/act.py": "def act(x):\n    return x\n",
             "runtime/__init__.py": "", "runtime/layers/__init__.py": "", "runtime/layers/norm.py": "X = 1\n",
             "runtime/engine/__init__.py": "", "runtime/engine/scheduler.py": "Y = 1\n",
             "pyproject.toml": '[tool.tsdev]\nreload-packages = ["kernels.ops", "runtime.layers"]\n'}
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


async def until(condition, timeout: float = 10.0, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached in time")
        await asyncio.sleep(step)
