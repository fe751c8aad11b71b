"""Every error leaves the server in OpenAI's shape: ``{"error": {message, type, param, code}}``.

Validation fails with 400 (not FastAPI's 422) and ``param`` naming the field; unknown routes
and wrong methods get 404 / 405 in the same shape.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}
# pydantic's names for union members and wrappers: not request fields.
_LOC_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    """An error answered to the client; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "header") else loc)
    param = ""
    for part in parts:
        if isinstance(part, int):
            if not param:
                break  # a JSON decode position, not a field
            param += f"[{part}]"
        elif not str(part).isidentifier() or str(part) in _LOC_TAGS:
            break
        else:
            param += f".{part}" if param else str(part)
    return param or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming its field."""
    err = exc.errors()[0]
    kind, param = err.get("type", ""), param_from_loc(tuple(err.get("loc", ())))
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return APIError(400, f"could not parse the body as JSON: {detail}", code="invalid_json")
    if kind == "model_attributes_type" and param is None:
        return APIError(400, "the body must be a JSON object", code="invalid_body")
    if kind == "missing":
        return APIError(
            400,
            f"missing required parameter: '{param}'",
            param=param,
            code="missing_required_parameter",
        )
    if kind == "extra_forbidden":
        return APIError(
            400, f"unrecognized request argument: '{param}'", param=param, code="unknown_parameter"
        )
    received = err.get("input")
    shown = repr(received) if not isinstance(received, dict | list) else type(received).__name__
    return APIError(
        400,
        f"invalid value for '{param}': {err.get('msg')} (got {shown[:80]})",
        param=param,
        code="invalid_value",
    )


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc).response()


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(500, f"internal error: {type(exc).__name__}").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unhandled)
