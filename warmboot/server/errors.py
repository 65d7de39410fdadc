"""HTTP errors in OpenAI's shape: ``ApiError`` (status, message, type, param, code) and the
FastAPI exception handlers that turn request validation failures, unsupported parameters,
invalid requests, an engine that is not ready or has died, and unknown routes or methods into
JSON error bodies with the right status code.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.routing import Match

from warmboot.core.errors import EngineDeadError, InvalidRequestError
from warmboot.server.engine_holder import EngineNotReady
from warmboot.server.protocol import UnsupportedParameter, error_body


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param=None, code=None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def response(self) -> JSONResponse:
        body = error_body(str(self), self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


def install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        return _validation_error(e).response()

    @app.exception_handler(UnsupportedParameter)
    async def _unsupported(_: Request, e: UnsupportedParameter):
        return ApiError(400, str(e), "invalid_request_error", e.param).response()

    @app.exception_handler(InvalidRequestError)
    async def _bad_request(_: Request, e: InvalidRequestError):
        return ApiError(400, str(e), "invalid_request_error").response()

    @app.exception_handler(EngineNotReady)
    async def _not_ready(_: Request, e: EngineNotReady):
        return ApiError(503, str(e), "service_unavailable").response()

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError):
        return ApiError(503, str(e), "service_unavailable").response()

    @app.exception_handler(404)
    async def _not_found(request: Request, _):
        return ApiError(404, f"no route {request.url.path}", "invalid_request_error").response()

    @app.exception_handler(405)
    async def _bad_method(request: Request, _):
        msg = f"method {request.method} not allowed on {request.url.path}"
        response = ApiError(405, msg, "invalid_request_error").response()
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
    param = loc[0] if loc else None  # NOTE: deeper entries may be pydantic's union branch tags
    msg = first.get("msg", "invalid request")
    text = f"invalid parameter {param}: {msg}" if param else f"invalid request body: {msg}"
    return ApiError(400, text, "invalid_request_error", param)
