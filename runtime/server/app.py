"""The HTTP front: OpenAI-compatible routes over an AsyncEngine."""
import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.config import ServerConfig
from runtime.control_protocol import SERVER_INFO_ROUTE, ErrorBody, ErrorDetail, ServerInfo
from runtime.engine.llm_engine import LLMEngine, RequestOutput
from runtime.engine.async_engine import AsyncEngine, EngineError, Unavailable
from runtime.engine.reload_forward import ForwardReloader, ReloadForward
from runtime.server.body_limit import BodyLimit
from runtime.server.chat import ChatTemplate
from runtime.server.control import add_control_routes
from runtime.server.metrics import EngineMetrics
from runtime.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from runtime.server.security import Guard, SecurityPolicy
from runtime.server.sse import sse_response


log = logging.getLogger("runtime.server")

# What the body of a POST route must be, for the message that answers a body that is not a JSON object.
BODY_SHAPES = {
    "/v1/completions": '"prompt" (a string, a list of strings, a list of token ids or a list of such lists), '
                       'e.g. {"prompt": "Hello", "max_tokens": 16}',
    "/v1/chat/completions": '"messages" (a list of {"role", "content"} objects), '
                            'e.g. {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}',
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def error_body(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error") -> dict:
    return ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=status)).dump()


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
    return JSONResponse(error_body(status, message, param, type_), status_code=status)


def build_app(engine: LLMEngine, served_model_name: str, reloader: ForwardReloader | None = None,
              max_request_body_bytes: int = ServerConfig.max_request_body_bytes,
              security: SecurityPolicy | None = None) -> FastAPI:
    """The app; `reloader` (a tsdev.hotreload.Reloader or alike) enables reload_forward, None refuses it (403).
    `security`: who may call what (API key, loopback-only control routes, profile and weight directories).
    `app.state.async_engine.shutdown()` ends its requests and streams (what a server does on SIGTERM)."""
    metrics = EngineMetrics(engine)
    async_engine = AsyncEngine(engine, on_step=metrics.on_step)
    chat_template = ChatTemplate(engine.model_dir)
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
        if first.get("type") == "json_invalid":
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

    @app.get(SERVER_INFO_ROUTE)
    async def server_info():
        return ServerInfo(model=served_model_name, allow_reload_forward=reloader is not None, pid=os.getpid(),
                          **dict(engine.describe())).dump()

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check_model(body: SamplingRequest) -> None:
        if body.model is not None and body.model != served_model_name:
            raise APIError(400, f"model {body.model!r} does not exist: this server serves {served_model_name!r} "
                                "(GET /v1/models)", "model")

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

    def check_available() -> None:
        """503 while the server sleeps (or has no weights loaded), saying what brings it back."""
        if why := async_engine.unavailable():
            raise APIError(503, why, None, "server_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        check_available()
        prompts = body.prompt
        if isinstance(prompts, str) or not prompts or isinstance(prompts[0], int):
            prompts = [prompts]  # one prompt (an empty one is refused by check_length)
        max_tokens = body.max_tokens or 16

        def prepare() -> tuple[list[list[int]], list]:
            token_lists = [encode(p) if isinstance(p, str) else list(p) for p in prompts]
            return token_lists, [body.sampling_params(check_length(ids, max_tokens)) for ids in token_lists]

        token_lists, params = await off_loop(prepare)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = [async_engine.generate(f"{request_id}-{i}", ids, p) for i, (ids, p) in enumerate(zip(token_lists, params))]

        def chunk(index: int, out: RequestOutput) -> dict:
            choice = {"index": index, "text": out.new_text, "logprobs": None, "finish_reason": out.finish_reason}
            return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": served_model_name,
                    "choices": [with_token_ids(body, choice, out.new_token_ids)]}

        if body.stream:
            return sse(streams, chunk, body.include_usage, request_id, "text_completion")
        results = await collect(streams, request)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": served_model_name,
                "choices": [with_token_ids(body, {"index": i, "text": text, "logprobs": None, "finish_reason": reason}, ids)
                            for i, (text, reason, _, ids) in enumerate(results)],
                "usage": usage([r[2] for r in results])}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        check_available()

        def prepare() -> tuple[list[int], object]:
            try:
                text = chat_template.render([m.for_template() for m in body.messages])
            except Exception as exc:
                raise APIError(400, f"the chat template failed on these messages: {exc}", "messages") from exc
            ids = encode(text, add_special_tokens=False)
            return ids, body.sampling_params(check_length(ids, body.max_completion_tokens or body.max_tokens))

        ids, params = await off_loop(prepare)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = [async_engine.generate(request_id, ids, params)]
        first = True

        def chunk(index: int, out: RequestOutput) -> dict:
            nonlocal first
            delta = {"role": "assistant", "content": out.new_text} if first else {"content": out.new_text}
            first = False
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": out.finish_reason}
            return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": served_model_name, "choices": [with_token_ids(body, choice, out.new_token_ids)]}

        if body.stream:
            return sse(streams, chunk, body.include_usage, request_id, "chat.completion.chunk")
        (content, reason, last, ids), = await collect(streams, request)
        choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": reason}
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": served_model_name,
                "choices": [with_token_ids(body, choice, ids)],
                "usage": usage([last])}

    def sse(streams, chunk, include_usage: bool, request_id: str, object_name: str) -> StreamingResponse:
        async def events() -> AsyncIterator[dict]:
            finals = []
            try:
                async for index, out in merge(streams):
                    body = chunk(index, out)
                    if include_usage:
                        body["usage"] = None
                    yield body
                    if out.finished:
                        finals.append(out)
                if include_usage:
                    yield {"id": request_id, "object": object_name, "created": int(time.time()),
                           "model": served_model_name, "choices": [], "usage": usage(finals)}
            except Unavailable as exc:
                yield error_body(503, str(exc), type_="server_error")
            except EngineError as exc:
                yield error_body(500, str(exc), type_="server_error")
            except ValueError as exc:  # the request itself (as a non-streaming one gets 400)
                yield error_body(400, str(exc))

        return sse_response(events(), done=True)

    async def collect(streams, request: Request) -> list[tuple[str, str, RequestOutput, list[int]]]:
        """Run streams to the end (text, finish reason, final output, token ids); abort them if the client goes away."""
        async def run():
            texts = [""] * len(streams)
            ids: list[list[int]] = [[] for _ in streams]
            finals: list = [None] * len(streams)
            async for index, out in merge(streams):
                texts[index] += out.new_text
                ids[index] += out.new_token_ids
                if out.finished:
                    finals[index] = out
            return [(t, f.finish_reason, f, i) for t, f, i in zip(texts, finals, ids)]

        task = asyncio.create_task(run())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    raise APIError(499, "the client disconnected; the request was aborted",
                                   type_="client_closed_request")
        except BaseException:  # the client left, or this handler was cancelled (a forced shutdown): abort the
            task.cancel()      # request's streams, which frees its KV pages, instead of orphaning them
            await asyncio.gather(task, return_exceptions=True)
            raise
        try:
            return task.result()
        except Unavailable as exc:
            raise APIError(503, str(exc), type_="server_error") from exc
        except EngineError as exc:
            raise APIError(500, str(exc), type_="server_error") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    return app


def prompt_char_limit(engine: LLMEngine) -> int:
    """Characters beyond which a prompt surely has more tokens than the context holds: no token covers more
    characters than the longest vocabulary entry (halved again for normalisation that merges characters)."""
    longest = max(map(len, engine.tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return 2 * max(longest, 1) * engine.max_model_len


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


def with_token_ids(body: SamplingRequest, choice: dict, token_ids: list[int]) -> dict:
    """vLLM's `return_token_ids` extension: the generated token ids beside the text."""
    return {**choice, "token_ids": token_ids} if body.return_token_ids else choice


def usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(f.num_prompt_tokens for f in finals)
    completion = sum(f.num_output_tokens for f in finals)
    cached = sum(f.num_cached_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def merge(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as items arrive, tagging each with its stream's index."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    await queue.put((index, out))
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
