"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, for every error the server
answers, including FastAPI's own validation errors and unexpected exceptions."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# What a client is told about a request the engine ended with finish_reason "error" (a step that failed,
# or a failure confined to that request); the cause is in the server's log.
ENGINE_FAILED = "the engine failed while running this request (the server log has the cause)"
RETRY_AFTER_S = 5  # told to clients with a 503 for a store (Redis) that is down or a server not ready

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with its HTTP status, shown to the client in OpenAI's error format."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {"Retry-After": str(RETRY_AFTER_S)} \
        if status == 503 else None
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _validation_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        details = "; ".join(f"{_validation_param(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors[:5])
        first = errors[0] if errors else {}
        json_invalid = first.get("type") == "json_invalid"
        status = 400 if json_invalid else 422
        message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}" if json_invalid else details
        return error_response(status, message, _validation_param(first.get("loc", ())), first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, message)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def store_down(request: Request, exc: Exception) -> JSONResponse:
        log.warning("Redis unreachable on %s %s: %s", request.method, request.url.path, exc)
        return error_response(503, f"the caption store (Redis) is unreachable: {exc}; retry later",
                              code="store_unavailable")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")
