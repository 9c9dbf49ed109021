"""How many streamed tokens a second the API process can serve, apart from any engine: a fake engine process on the
other end of its channel answers every request at once, one token per request per step, as fast as the API process
takes them, and `tsdev bench` streams against it.

    python3 benchmarks/api_process_ceiling.py                       # 256 streams of 256 tokens, the tiny tokenizer
    python3 benchmarks/api_process_ceiling.py --streams 64 --step-ms 2

Each fake step hands out one token for every running request (a StepOutputs, as the engine does), every --step-ms
(0: back to back, waiting only until the API process has read the last one). The client's output tok/s is then the
API process's ceiling on this host (the client shares the host: it costs about as much per token).
"""
import argparse
import asyncio
import dataclasses
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tsdev_runtime.config import ServerConfig
from tsdev_runtime.engine.outputs import Finish, StepOutputs
from tsdev_runtime.engine.wire import frame, read_message
from tsdev_runtime.weights.default_model import SHAPES, write_checkpoint


async def fake_engine(channel: socket.socket, hello: dict, step_ms: float, vocab: int) -> None:
    reader, writer = await asyncio.open_unix_connection(sock=channel)
    writer.write(frame(("hello", hello)))
    writer.write(frame(("ready",)))
    writer.write(frame(("unavailable", None)))
    running: dict[str, int] = {}  # request id -> tokens left
    rng = random.Random(0)

    async def take() -> None:
        while (message := await read_message(reader)) is not None:
            if message[0] == "add":
                running[message[1]] = message[3].max_tokens
            elif message[0] == "abort":
                running.pop(message[1], None)

    taking = asyncio.create_task(take())
    while not taking.done():
        if running:
            step = StepOutputs(request_ids=list(running), token_ids=[rng.randrange(3, vocab) for _ in running])
            for request_id in step.request_ids:
                running[request_id] -= 1
                if running[request_id] == 0:
                    del running[request_id]
                    step.finished[request_id] = Finish("length", 0, None)
            writer.write(frame(("step", step)))
            await writer.drain()
        await asyncio.sleep(step_ms / 1e3)


def engine_app(path: str, vocab: int) -> None:
    """The engine process's own app, as far as the client asks of it here (the model list; anything else: {})."""
    import json

    import uvicorn

    models = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 4096,
                                                       "vocab_size": vocab}]}).encode()

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": models if scope["path"] == "/v1/models" else b"{}"})

    uvicorn.run(app, uds=path, log_level="warning")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--port", type=int, default=8461)
    args = parser.parse_args()
    model_dir = Path(tempfile.mkdtemp(prefix="tsdev-ceiling-"))
    write_checkpoint(model_dir, SHAPES["tiny"])
    public = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    public.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    public.bind(("127.0.0.1", args.port))
    ours, theirs = socket.socketpair()
    fds = (public.fileno(), theirs.fileno())
    api = subprocess.Popen([sys.executable, "-m", "tsdev.launch.api", *map(str, fds)], pass_fds=fds,
                           start_new_session=True)
    theirs.close()
    hello = {"server": dataclasses.asdict(ServerConfig(port=args.port)), "served_model_name": "tiny",
             "port": args.port, "engine_socket": str(model_dir / "none.sock"), "tokenizer_dir": str(model_dir),
             "max_model_len": 4096, "vocab_size": SHAPES["tiny"]["vocab_size"], "disabled_routes": {}}

    def engine_side() -> None:
        try:
            asyncio.run(fake_engine(ours, hello, args.step_ms, SHAPES["tiny"]["vocab_size"]))
        except BaseException as exc:
            print("the fake engine failed:", repr(exc))
            raise

    threading.Thread(target=engine_side, daemon=True).start()
    threading.Thread(target=engine_app, args=(hello["engine_socket"], hello["vocab_size"]), daemon=True).start()
    time.sleep(1.5)  # the API process listens
    bench = [sys.executable, "-m", "tsdev", "bench", "--url", f"http://127.0.0.1:{args.port}", "--model", "tiny",
             "--num-prompts", str(args.streams), "--max-concurrency", str(args.streams), "--random-input-len", "32",
             "--random-output-len", str(args.tokens), "--warmup", "2"]
    result = subprocess.run(bench, capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"})
    print("\n".join(line for line in result.stdout.splitlines() if "tok/s" in line or "req/s" in line
                    or "TPOT" in line) or result.stdout + result.stderr)
    api.terminate()
    api.wait(5)


if __name__ == "__main__":
    main()
