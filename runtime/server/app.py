"""The HTTP front: OpenAI-compatible routes over an AsyncEngine."""
import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.config import ServerConfig
from runtime.control_protocol import SERVER_INFO_ROUTE, ServerInfo
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.async_engine import AsyncEngine
from runtime.engine.reload_forward import ForwardReloader, ReloadForward
from runtime.server.body_limit import BodyLimit
from runtime.server.chat import ChatTemplate
from runtime.server.control import add_control_routes
from runtime.server.errors import APIError, error_response
from runtime.server.metrics import EngineMetrics
from runtime.server.openai import add_openai_routes
from runtime.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                     supported_fields)
from runtime.server.security import Guard, SecurityPolicy


log = logging.getLogger("runtime.server")

# What the body of a POST route must be, for the message that answers a body that is not a JSON object.
BODY_SHAPES = {
    "/v1/completions": '"prompt" (a string, a list of strings, a list of token ids or a list of such lists), '
                       'e.g. {"prompt": "Hello", "max_tokens": 16}',
    "/v1/chat/completions": '"messages" (a list of {"role", "content"} objects), '
                            'e.g. {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}',
}
# The fields each route reads, for the message that answers an unknown one.
BODY_FIELDS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
               "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def server_version() -> str:
    try:
        return version("tsdev")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_app(engine: LLMEngine, served_model_name: str, reloader: ForwardReloader | None = None,
              max_request_body_bytes: int = ServerConfig.max_request_body_bytes,
              security: SecurityPolicy | None = None, chat_template: str | None = None) -> FastAPI:
    """The app; `reloader` (a tsdev.hotreload.Reloader or alike) enables reload_forward, None refuses it (403).
    `security`: who may call what (API key, loopback-only control routes, profile and weight directories).
    `chat_template`: a jinja2 file to render chat prompts with instead of the checkpoint's own.
    `app.state.async_engine.shutdown()` ends its requests and streams (what a server does on SIGTERM)."""
    metrics = EngineMetrics(engine, served_model_name)
    async_engine = AsyncEngine(engine, on_step=metrics.on_step)
    chat_template = ChatTemplate(engine.tokenizer_dir, chat_template)
    created = int(time.time())
    # Tokenizing (and chat templates) run here, neither on the event loop nor on the engine's thread.
    tokenizer_pool = ThreadPoolExecutor(2, thread_name_prefix="tokenize")
    max_prompt_chars = prompt_char_limit(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_engine.start()
        yield
        await async_engine.stop()
        tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="tsdev runtime", lifespan=lifespan)
    security = security or SecurityPolicy()
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes)
    app.add_middleware(Guard, policy=security)  # added last: runs first, before the body is read
    app.state.engine, app.state.async_engine, app.state.security = engine, async_engine, security
    reload_forward = ReloadForward(async_engine, reloader, engine.config.rank) if reloader is not None else None
    add_control_routes(app, async_engine, reload_forward, APIError, security)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        # A validator's own message says more than the type mismatches of a union's other members.
        first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        # Field names only: no list indexes, no union members ("list[int]", "function-after[valid_unicode(), str]").
        field = ".".join(p for p in loc if p.isidentifier() and p[:1].islower()) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            field = ".".join(loc)
            message = unknown_field(request.url.path, field)
        elif first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})"
        elif not field and first.get("type") in ("missing", "model_attributes_type", "dict_type", "model_type"):
            message = not_an_object(request.url.path, first.get("input"))
        elif field:
            message = f"{field}: {message}"
        return error_response(400, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            message = (f"no route {method} {path}: the OpenAI routes are POST /v1/completions, "
                       "POST /v1/chat/completions and GET /v1/models (docs/runtime.md lists them all)")
        elif exc.status_code == 405:
            allowed = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), "another method")
            message = f"{method} is not allowed on {path}: use {allowed}"
        elif exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's body parsing
            message = f"the request body is not UTF-8 text ({exc.__cause__}): send JSON encoded as UTF-8"
        else:
            message = str(exc.detail)
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(NotImplementedError)
    async def _not_implemented(request, exc: NotImplementedError):  # e.g. sleep under tensor parallelism
        return error_response(501, str(exc), None, "not_implemented_error")

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc} (see the server log)", None, "server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "tsdev", "max_model_len": engine.max_model_len,
                                            "vocab_size": engine.model_config.vocab_size}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != served_model_name:
            raise APIError(404, f"the model {model_id!r} does not exist: this server serves {served_model_name!r}",
                           "model", "not_found_error")
        return (await models())["data"][0]

    @app.get("/version")
    async def server_version_route():
        return {"version": server_version()}

    @app.get(SERVER_INFO_ROUTE)
    async def server_info():
        return ServerInfo(model=served_model_name, allow_reload_forward=reloader is not None, pid=os.getpid(),
                          **dict(engine.describe())).dump()

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check_length(prompt_ids: list[int], max_tokens: int | None) -> int:
        """Validate the prompt and return max_tokens (default: the rest of the context)."""
        try:
            engine.check_prompt(prompt_ids)
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        limit = engine.max_model_len
        if max_tokens is None:
            max_tokens = limit - len(prompt_ids)
        if len(prompt_ids) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but {len(prompt_ids)} "
                                f"prompt tokens + {max_tokens} max_tokens were requested: shorten the prompt or "
                                "lower max_tokens", "max_tokens")
        return max_tokens

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; one so long that it cannot fit the context is refused without tokenizing it."""
        if len(text) > max_prompt_chars:
            raise APIError(400, f"this model's maximum context length is {engine.max_model_len} tokens, but the "
                                f"prompt has {len(text)} characters, more than that many tokens can hold: shorten it",
                           "prompt")
        return engine.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    async def off_loop(fn: Callable):
        """Run `fn` (tokenizing, checking lengths) in the tokenizer threads: the event loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(tokenizer_pool, fn)

    add_openai_routes(app, engine, async_engine, served_model_name, off_loop, encode, check_length, chat_template)
    return app


def prompt_char_limit(engine: LLMEngine) -> int:
    """Characters beyond which a prompt surely has more tokens than the context holds: no token covers more
    characters than the longest vocabulary entry (halved again for normalisation that merges characters)."""
    longest = max(map(len, engine.tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return 2 * max(longest, 1) * engine.max_model_len


def unknown_field(path: str, field: str) -> str:
    """A field the server does not read is refused rather than ignored, with the fields it does read."""
    model = BODY_FIELDS.get(path)
    known = f"; the fields {path} reads are: {', '.join(supported_fields(model))}" if model else ""
    return (f"unknown field {field!r}: this server does not implement it, and refuses rather than ignore it "
            f"(drop the field, or see docs/runtime.md for what each route supports){known}")


def not_an_object(path: str, value) -> str:
    """What to send instead of a body that is not a JSON object (an array, a string, nothing)."""
    what = {list: "a JSON array", str: "a JSON string", type(None): "no body (or null)",
            bool: "a boolean", int: "a number", float: "a number",
            bytes: "a body sent without the header Content-Type: application/json (send that header)"
            }.get(type(value), "something else")
    shape = BODY_SHAPES.get(path)
    return (f"the request body must be a JSON object" + (f" with {shape}" if shape else "") + f", not {what}"
            + (" (one request per body: send several prompts as a list in \"prompt\")" if path == "/v1/completions"
               and isinstance(value, list) else ""))
