"""An in-process stand-in for `tsdev serve --allow-reload-forward` (an httpx transport), for testing the
watch daemon and its screen quickly and deterministically: it records the reloads it is asked for and
answers them as told. The real server is exercised by tests/test_watch_e2e.py."""
import asyncio
import itertools
import json
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from tsdev_runtime.control_protocol import (COMPILE_AHEAD_ROUTE, EVENTS_ROUTE, MODULES_ROUTE, RELOAD_ROUTE,
                                      SERVER_INFO_ROUTE, START_PROFILE_ROUTE, UPDATE_WEIGHTS_ROUTE,
                                      CompileAheadReply, CompileAheadRequest, CompiledAhead, ErrorBody, ErrorDetail,
                                      Hello,
                                      ModulesReply, ProfileRange, ProfileRequest, ReloadReply, ReloadRequest,
                                      ReloadWeightsReply, ServerInfo, UpdateWeightsRequest, WorkerReport)
from tsdev.watch.checks import prompt_ids

URL = "http://fake-server"
TIMINGS = {"jit": 0.078, "drain": 0.011, "flush": 0.002, "reload": 0.034, "warm": 0.123, "recapture": 0.456,
           "recapture_decode": 0.3, "recapture_prefill": 0.156, "pause": 0.63, "total": 0.64}  # the server's order
INFO = ServerInfo(model="fake-model", model_dir="/fake", architecture="Qwen3ForCausalLM", device="cpu",
                  dtype="float32", parameters=1000, max_model_len=512, vocab_size=1000, allow_reload_forward=True,
                  pid=4242)


def ok_worker(reloaded=("tsdev_kernels.ops.act",), dependents=("tsdev_runtime.layers.norm",), **extra) -> WorkerReport:
    return WorkerReport(ok=True, reloaded=list(reloaded), dependents=list(dependents), patched=3, jit_kernels=1,
                        timings=TIMINGS, **extra)


def failed_worker(error: str) -> WorkerReport:
    return WorkerReport(ok=False, error=error, timings={"drain": 0.01, "flush": 0.0, "reload": 0.02})


def sse(payloads: list) -> httpx.Response:
    """An event stream of these JSON payloads (a str goes as it is: "[DONE]")."""
    lines = (f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n" for p in payloads)
    return httpx.Response(200, content="".join(lines).encode(), headers={"content-type": "text/event-stream"})


class FakeServer:
    def __init__(self):
        self.reloads: list[ReloadRequest] = []  # the reload_forward calls, in order
        self.builds: list[CompileAheadRequest] = []  # the compile_ahead calls, in order
        self.calls: list[str] = []  # "reload" and "build", in the order they came
        self.reload_delay = 0.0
        self.answer = lambda request: ok_worker()  # the worker to reply with (a list: one per rank)
        self.output_changed_at: int | None = None  # golden tokens differ from here on, after the next reload
        self._changed_at = None
        self.pending_events: list = []  # control-protocol events delivered on the next events connection
        self.profiles: list[ProfileRequest] = []
        self.loaded: list[str] | None = None  # GET /v1/rl/engine/modules answers these (None: no such route)
        self.info: ServerInfo | None = INFO  # GET /server_info (None: no such route, as on an older server)
        self.weight_updates: list[UpdateWeightsRequest] = []  # the update_weights calls, in order
        self.weights_refusal: str | None = None  # answer update_weights with this 400 instead
        self.weights_change_at = 3  # golden tokens differ from here on after each update (new weights)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model", "vocab_size": 1000, "max_model_len": 512}]})
        if path == SERVER_INFO_ROUTE and self.info is not None:
            return httpx.Response(200, json=self.info.dump())
        if path == "/v1/completions":
            return self.completion(body)
        if path == RELOAD_ROUTE:
            reload = ReloadRequest.model_validate(body)
            self.reloads.append(reload)
            self.calls.append("reload")
            await asyncio.sleep(self.reload_delay)
            answer = self.answer(reload)
            workers = answer if isinstance(answer, list) else [answer]  # a list: one per rank
            if all(w.ok for w in workers) and workers[0].reloaded:
                self._changed_at = self.output_changed_at
            return httpx.Response(200, json=ReloadReply.of(reload.id, workers).dump())
        if path == COMPILE_AHEAD_ROUTE:  # built: the event goes out on the next events connection
            build = CompileAheadRequest.model_validate(body)
            self.builds.append(build)
            self.calls.append("build")
            reply = CompileAheadReply(path=build.path, id=build.id, module="tsdev_kernels.ops.act", outcome="compiled",
                                      ok=True, compiled=1, kernels=["tsdev_kernels.ops.act._act_kernel"], seconds=0.3)
            self.pending_events.append(CompiledAhead(reply=reply))
            return httpx.Response(200, json=reply.dump())
        if path == UPDATE_WEIGHTS_ROUTE:
            update = UpdateWeightsRequest.model_validate(body)
            self.weight_updates.append(update)
            if self.weights_refusal:
                return httpx.Response(400, json=ErrorBody(error=ErrorDetail(message=self.weights_refusal,
                                                                            code=400)).dump())
            self._changed_at = self.weights_change_at
            return httpx.Response(200, json=ReloadWeightsReply(
                message=f"loaded {update.path}", path=update.path, format="plain", nbytes=1000, load_seconds=0.05,
                seconds=0.06, mode=update.mode, id=update.id).dump())
        if path == EVENTS_ROUTE:
            events, self.pending_events = [Hello(paused=False), *self.pending_events], []
            return sse([event.dump() for event in events])
        if path == MODULES_ROUTE and self.loaded is not None:
            return httpx.Response(200, json=ModulesReply(modules=self.loaded).dump())
        if path == START_PROFILE_ROUTE:
            profile = ProfileRequest.model_validate(body)
            self.profiles.append(profile)
            return httpx.Response(200, json=ProfileRange(n=len(self.profiles), name=profile.name or "",
                                                         activities=profile.activities,
                                                         num_steps=profile.num_steps).dump())
        return httpx.Response(404, json=ErrorBody(error=ErrorDetail(message=f"no route {path}", code=404)).dump())

    def completion(self, body: dict) -> httpx.Response:
        first = body["prompt"][0]
        ids = [first + i for i in range(body["max_tokens"])]
        if self._changed_at is not None and body["prompt"] == prompt_ids(0, 1000) and len(ids) > self._changed_at:
            ids[self._changed_at] += 1
        return sse([{"choices": [{"index": 0, "text": f"t{i}", "token_ids": [i], "finish_reason": None}]}
                    for i in ids] + ["[DONE]"])


def paced_probe(monkeypatch, step: float = 0.004) -> None:
    """The probe's clock advances `step` per chunk read: this server answers a stream at once, so a probe's real
    figure is the client's parsing time (microseconds), unsteady on a loaded 2-core machine."""
    from tsdev.watch import checks

    ticks = itertools.count()
    monkeypatch.setattr(checks, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * step))


def make_project(root: Path) -> Path:
    """A small project with two reloadable packages and one that is not."""
    files = {"kernels/tsdev_kernels/__init__.py": "", "kernels/tsdev_kernels/ops/__init__.py": "",
             "kernels/tsdev_kernels/ops/act.py": "def act(x):\n    return x\n",
             "runtime/tsdev_runtime/__init__.py": "", "runtime/tsdev_runtime/layers/__init__.py": "",
             "runtime/tsdev_runtime/layers/norm.py": "X = 1\n", "runtime/tsdev_runtime/engine/__init__.py": "",
             "runtime/tsdev_runtime/engine/scheduler.py": "Y = 1\n",
             "pyproject.toml": '[tool.tsdev]\nreload-packages = ["tsdev_kernels.ops", "tsdev_runtime.layers"]\n'
                               '[tool.setuptools.packages.find]\nwhere = [".", "runtime", "kernels"]\n'}
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
