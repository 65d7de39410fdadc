"""HTTP errors: ``ApiError`` (status, message, type, param, code) and the FastAPI exception
handlers that turn request validation failures, bodies the JSON parser refuses (nested too
deeply, an integer too long), unsupported parameters, invalid requests, an engine that is not
ready or has died, unknown routes or methods, and crashes into JSON error bodies with the
right status code: in OpenAI's shape, or in Anthropic's under ``/v1/messages``.
"""

from __future__ import annotations

import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from warmboot.core.errors import EngineDeadError, InvalidRequestError
from warmboot.server.admission import Overloaded
from warmboot.server.engine_holder import EngineNotReady
from warmboot.server.fields import UnsupportedParameter, error_body


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param=None, code=None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def response(self, path: str = "") -> JSONResponse:
        """The error as JSON, in the shape of the API that ``path`` belongs to."""
        if path.startswith(ANTHROPIC_PATH):
            body = anthropic_error_body(self.status, str(self))
        else:
            body = error_body(str(self), self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


def model_not_found(model: str, served: str) -> ApiError:
    """A 404 in OpenAI's shape for a request naming a model this server does not serve;
    ``served``: what it serves, as the message says it (``ServedAdapters.served``)."""
    message = f"the model {model!r} does not exist; this server serves {served}"
    return ApiError(404, message, "invalid_request_error", "model", "model_not_found")


ANTHROPIC_PATH = "/v1/messages"
"""Where errors take Anthropic's shape (the Messages API's routes)."""
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error shape; the type follows the status."""
    default = "api_error" if status >= 500 else "invalid_request_error"
    error = {"type": _ANTHROPIC_TYPES.get(status, default), "message": message}
    return {"type": "error", "error": error}


RETRY_STARTING_S = 5
"""``Retry-After`` of a 503 while the engine starts."""


def body_parse_error(cause: BaseException | None) -> ApiError:
    """The 400 for a body that ``json.loads`` refuses with something other than a syntax
    error: nesting past the recursion limit, an integer past Python's digit limit."""
    if isinstance(cause, RecursionError):
        depth = sys.getrecursionlimit()
        msg = f"the request body is nested too deeply: JSON may nest about {depth} levels at most"
    elif isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        digits = sys.get_int_max_str_digits()
        msg = f"the request body holds an integer longer than {digits} digits"
    else:
        msg = "the request body could not be parsed" + (f": {cause}" if cause else "")
    return ApiError(400, msg, "invalid_request_error")


def install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, e: ApiError):
        return e.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return _validation_error(e).response(request.url.path)

    @app.exception_handler(UnsupportedParameter)
    async def _unsupported(request: Request, e: UnsupportedParameter):
        return ApiError(400, str(e), "invalid_request_error", e.param).response(request.url.path)

    @app.exception_handler(InvalidRequestError)
    async def _bad_request(request: Request, e: InvalidRequestError):
        return ApiError(400, str(e), "invalid_request_error").response(request.url.path)

    @app.exception_handler(EngineNotReady)
    async def _not_ready(request: Request, e: EngineNotReady):
        response = ApiError(503, str(e), "service_unavailable").response(request.url.path)
        response.headers["Retry-After"] = str(RETRY_STARTING_S)
        return response

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, e: Overloaded):
        error = ApiError(429, str(e), "rate_limit_error", code="server_overloaded")
        response = error.response(request.url.path)
        response.headers["Retry-After"] = str(e.retry_after)
        return response

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return ApiError(503, str(e), "service_unavailable").response(request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        if e.status_code == 400 and e.__cause__ is not None:  # NOTE: FastAPI's body parse
            error = body_parse_error(e.__cause__)
        else:
            type_ = "server_error" if e.status_code >= 500 else "invalid_request_error"
            error = ApiError(e.status_code, str(e.detail), type_)
        response = error.response(request.url.path)
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):  # NOTE: uvicorn still logs the traceback
        return ApiError(500, "internal server error", "server_error").response(request.url.path)

    @app.exception_handler(404)
    async def _not_found(request: Request, _):
        msg = f"no route {request.url.path}"
        return ApiError(404, msg, "invalid_request_error").response(request.url.path)

    @app.exception_handler(405)
    async def _bad_method(request: Request, _):
        msg = f"method {request.method} not allowed on {request.url.path}"
        response = ApiError(405, msg, "invalid_request_error").response(request.url.path)
        response.headers["Allow"] = ", ".join(_allowed(request))
        return response


def _allowed(request: Request) -> list[str]:
    """The methods the routes at the request's path accept."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def _validation_error(e: RequestValidationError) -> ApiError:
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return ApiError(
            400, f"the request body is not valid JSON: {first.get('msg')}", "invalid_request_error"
        )
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "extra_forbidden":  # NOTE: OpenAI's answer to an unknown field
        where = ".".join(x for x in loc if "[" not in x)  # NOTE: less pydantic's union tags
        msg = f"unrecognized request argument supplied: {where} (no such field)"
        return ApiError(400, msg, "invalid_request_error", where)
    param = loc[0] if loc else None  # NOTE: deeper entries may be pydantic's union branch tags
    msg = first.get("msg", "invalid request")
    text = f"invalid parameter {param}: {msg}" if param else f"invalid request body: {msg}"
    return ApiError(400, text, "invalid_request_error", param)
