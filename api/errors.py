"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, for every error the server
answers, including FastAPI's own validation errors and unexpected exceptions."""

from __future__ import annotations

import logging
import math
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
    """An error with its HTTP status, shown to the client in OpenAI's error format. `retry_after_s`: a 503's
    `Retry-After` (the busy resource's own wait: a pool's deadline, the media box's, the grammar compilers'), else
    RETRY_AFTER_S."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_headers(status: int, retry_after_s: float | None = None) -> dict[str, str] | None:
    """The headers of an error answer: 401's `WWW-Authenticate`, 503's `Retry-After` (whole seconds, at least 1)."""
    if status == 401:
        return {"WWW-Authenticate": "Bearer"}
    if status == 503:
        return {"Retry-After": str(max(1, math.ceil(RETRY_AFTER_S if retry_after_s is None else retry_after_s)))}
    return None


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   retry_after_s: float | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=error_headers(status, retry_after_s))


def _walk(value: Any, loc: tuple, absent: bool) -> tuple[bool, list] | None:
    """The steps of `loc` that are keys or indexes of `value`, skipping pydantic's names of union branches and
    tags; (whether the loc's final step was one of them, the steps). `absent`: the final step may be a field the
    body lacks (a missing one) or one it should not have."""
    if not loc:
        return None
    head, rest = loc[0], loc[1:]
    found: list[tuple[bool, list]] = []
    if (isinstance(value, dict) and isinstance(head, str) and head in value) or \
            (isinstance(value, list) and isinstance(head, int) and 0 <= head < len(value)):
        below = _walk(value[head], rest, absent) if rest else None
        found.append((below[0], [head, *below[1]]) if below else (not rest, [head]))
    elif absent and not rest and isinstance(value, dict) and isinstance(head, str):
        found.append((True, [head]))  # a missing or unknown field
    skipped = _walk(value, rest, absent) if rest else None
    if skipped:
        found.append(skipped)
    return max(found, key=lambda f: (f[0], len(f[1])), default=None)


def param_path(loc: tuple, body: Any = None, absent: bool = False) -> str | None:
    """OpenAI's `param` of a validation error at pydantic's `loc`: the field's path in the body, as
    `messages[0].content[1].image_url` (union branch and tag names that pydantic puts in `loc` left out)."""
    where = [p for p in loc if p not in ("body", "query", "path", "header")]
    if loc and loc[0] == "body" and where:
        walked = _walk(body, tuple(where), absent)
        if walked:
            where = walked[1]
    text = ""
    for step in where:
        text += f"[{step}]" if isinstance(step, int) else f".{step}" if text else str(step)
    return text or None


def _validation_code(kind: str) -> str:
    if kind == "extra_forbidden":
        return "unknown_parameter"
    if kind == "missing":
        return "missing_required_parameter"
    return "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """OpenAI's answer to a body that does not fit its schema: 400, `param` the path of the field at fault (of
    several errors, from a union's branches, the deepest), `code` what is wrong (unknown_parameter,
    missing_required_parameter, invalid_type, invalid_value)."""
    errors = exc.errors()
    body = getattr(exc, "body", None)
    if errors and errors[0].get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}",
                              None, "invalid_json")
    paths = [param_path(tuple(e.get("loc", ())), body, e.get("type") in ("missing", "extra_forbidden"))
             for e in errors]
    depth = [(p or "").count(".") + (p or "").count("[") for p in paths]
    ranked = sorted(range(len(errors)), key=lambda i: -depth[i])  # stable: pydantic's order among equals
    first = ranked[0] if ranked else None
    details = []
    for i in ranked[:5]:
        message = "unknown field" if errors[i].get("type") == "extra_forbidden" else errors[i].get("msg")
        details.append(f"{paths[i] or 'body'}: {message}")
    if first is None:
        return error_response(400, "the request is invalid", None, "invalid_value")
    return error_response(400, "; ".join(details), paths[first], _validation_code(str(errors[first].get("type"))))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

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
