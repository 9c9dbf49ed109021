"""`python -m tsdev.launch.api LISTEN_FD CHANNEL_FD`: the API process `tsdev serve` starts beside its engine process
(what it serves: runtime/tsdev_runtime/server/api_process.py). LISTEN_FD is the public address, bound by `tsdev serve`;
CHANNEL_FD its end of the channel to the engine process."""
import asyncio
import os
import shutil
import socket
import sys

from tsdev.launch.serve import BACKLOG, GRACEFUL_SHUTDOWN_S, bind_error, leave, log_to_stderr, quiet_server_class
from tsdev_runtime.engine.errors import FATAL_EXIT_STATUS


async def serve(listen: socket.socket, channel_socket: socket.socket) -> int:
    import uvicorn

    from tsdev_runtime.config import ServerConfig
    from tsdev_runtime.server.api_process import build_api_app, connect

    hello: dict = {}

    def engine_gone() -> None:
        """The engine process exited (it said why): leave at once, dropping every connection, as one process would;
        its socket's directory goes too."""
        print("the engine process exited: its API process stops", file=sys.stderr, flush=True)
        if "engine_socket" in hello:
            shutil.rmtree(os.path.dirname(hello["engine_socket"]), ignore_errors=True)
        os._exit(FATAL_EXIT_STATUS)

    if (connected := await connect(channel_socket, engine_gone)) is None:  # the engine did not start (it said why)
        return 0
    channel, said = connected
    hello.update(said)
    try:
        app = build_api_app(channel, hello)
    except Exception:  # a chat template that does not load: the engine process says so and stops
        return 0
    server = ServerConfig(**hello["server"])
    log_to_stderr(server.log_level)  # a line per completion request with --log-level info, errors always
    if not await channel.ready():  # the engine's start failed (it said why)
        return 0
    try:
        listen.listen(BACKLOG)  # another server may have bound the port meanwhile (SO_REUSEADDR): one listens
    except OSError as exc:
        print(f"error: {bind_error(exc, server.host, hello['port'])}", file=sys.stderr, flush=True)
        return 2

    def started() -> None:
        print(f"listening on http://{server.host}:{hello['port']} (OpenAI API under /v1)", flush=True)

    config = uvicorn.Config(app, log_level=server.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    front = quiet_server_class(uvicorn.Server)(config, started, channel.shutdown)
    reading = asyncio.create_task(channel.read())
    await front.serve(sockets=[listen])
    reading.cancel()
    return 0


def main() -> int:
    listen, channel = (socket.socket(fileno=int(fd)) for fd in sys.argv[1:3])
    return leave(asyncio.run(serve(listen, channel)))  # without the interpreter's teardown


if __name__ == "__main__":
    sys.exit(main())
