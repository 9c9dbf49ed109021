"""The channel between the engine process and the API process (docs/architecture.md, "Two processes").

One stream socket (a socketpair made before the API process started: nobody else holds it) carries pickled
messages, each behind its 4-byte length. The API process sends requests in and aborts:

    ("add", request_id, prompt_token_ids, params, after, arrival_time)    ("abort", request_id, reason)

and the engine process sends, besides a first ("hello", facts) with the server's settings and what the routes read
of the model (as soon as its checkpoint is open: the API process builds its app while the model loads) and
("ready",) once it serves:

    ("step", StepOutputs)          one message per step: token ids, finishes, raw logprobs -- no text
    ("error", request_id, kind, message, field)    a request refused or failed (kind: REFUSALS' keys)
    ("unavailable", why)           why new requests are refused now (None: they are not), whenever that changes

Everything per request (detokenizing, stop strings, logprob objects, usage, JSON, SSE) is the API process's. This
module imports no torch: the API process uses it.
"""
import asyncio
import pickle
import struct

from tsdev_runtime.engine.errors import EngineError, ShuttingDown, Unavailable
from tsdev_runtime.engine.sequence import InvalidRequest

LENGTH = struct.Struct("!I")
# an error's kind on the wire -> the exception the API process raises in the request's stream
# (the most specific first: ShuttingDown is an Unavailable, which is an EngineError)
REFUSALS = {"invalid": InvalidRequest, "stopping": ShuttingDown, "unavailable": Unavailable, "failed": EngineError}


def kind_of(exc: BaseException) -> str:
    return next((kind for kind, cls in REFUSALS.items() if isinstance(exc, cls)), "failed")


def frame(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> tuple | None:
    """The next message, or None once the other side closed the socket."""
    try:
        length, = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        return pickle.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
