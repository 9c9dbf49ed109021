"""OpenAI-style errors: every error status the server answers has this one body shape."""
from fastapi.responses import JSONResponse

from runtime.control_protocol import ErrorBody, ErrorDetail


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def error_body(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error") -> dict:
    return ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=status)).dump()


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
    return JSONResponse(error_body(status, message, param, type_), status_code=status)
