"""OpenAI-style errors: every error status the server answers has this one body shape, and says what to do next."""
import json
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tsdev_runtime.control_protocol import ErrorBody, ErrorDetail
from tsdev_runtime.engine.errors import Unavailable
from tsdev_runtime.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                     supported_fields)

log = logging.getLogger("tsdev_runtime.server")

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


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def error_body(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error") -> dict:
    return ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=status)).dump()


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
    return JSONResponse(error_body(status, message, param, type_), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Every failure answers in the one error shape: an APIError as raised, a body that does not validate (the
    field and what to send), no such route or method, NotImplementedError (501), anything else (500, logged)."""

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
            message = f"{field}: {message}{sent_as(first)}"
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
        elif exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):  # FastAPI's body parsing
            message = ("the request body's JSON is nested too deeply to parse (arrays or objects thousands of levels "
                       "deep): no route reads anything that deep; send the fields it reads")
        else:
            message = str(exc.detail)
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Unavailable)
    async def _unavailable(request, exc: Unavailable):  # e.g. a control call in progress when the server stops
        return error_response(503, str(exc), None, "server_error")

    @app.exception_handler(NotImplementedError)
    async def _not_implemented(request, exc: NotImplementedError):  # e.g. sleep under tensor parallelism
        return error_response(501, str(exc), None, "not_implemented_error")

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc} (see the server log)", None,
                              "server_error")


JSON_KINDS = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
              dict: "an object", type(None): "null"}


def sent_as(error: dict) -> str:
    """What a value of the wrong type was sent as: JSON types are taken as sent (the models are strict), so the
    message shows that "3" is a string and true a boolean, not the integer the field takes."""
    if not error.get("type", "").endswith("_type") or type(error.get("input")) not in JSON_KINDS:
        return ""
    value = error["input"]
    shown = json.dumps(value) if isinstance(value, (str, bool, int, float)) else ""
    shown = shown if len(shown) <= 40 else shown[:36] + "...\""
    return f", not {JSON_KINDS[type(value)]}" + (f" ({shown})" if shown else "")


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
    return ("the request body must be a JSON object" + (f" with {shape}" if shape else "") + f", not {what}"
            + (" (one request per body: send several prompts as a list in \"prompt\")" if path == "/v1/completions"
               and isinstance(value, list) else ""))
