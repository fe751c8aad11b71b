"""FastAPI dependencies: the app's settings, worker and metrics, API keys, JSON bodies."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from qfserve.engine.models.loading import LoadedModel
from qfserve.engine.serving.worker import Worker
from qfserve.server.errors import APIError
from qfserve.server.metrics import Metrics
from qfserve.server.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_worker(request: Request) -> Worker:
    return request.app.state.worker


def served_model(worker: Worker) -> LoadedModel:
    """The model the worker serves; 503 (retry shortly) while it is still loading."""
    if worker.loaded is None:
        raise APIError(
            503, "the model is still loading", code="unavailable", headers={"Retry-After": "5"}
        )
    return worker.loaded


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
WorkerDep = Annotated[Worker, Depends(get_worker)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


def _check_bearer(request: Request, key: str | None, what: str) -> None:
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    # Constant-time comparison so the key cannot be guessed byte by byte from timings.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401,
            f"missing or invalid {what} (send 'Authorization: Bearer <key>')",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def require_api_key(request: Request, settings: SettingsDep) -> None:
    """Every route but /health when ``--api-key`` is set."""
    _check_bearer(request, settings.api_key, "API key")


def require_admin_key(request: Request, settings: SettingsDep) -> None:
    """The admin endpoint: ``--admin-key`` when set, else the API key (if any)."""
    if settings.admin_key is not None:
        _check_bearer(request, settings.admin_key, "admin key")
    else:
        _check_bearer(request, settings.api_key, "API key")


def require_json(request: Request) -> None:
    """POST bodies must be JSON (415 otherwise, before the body is parsed)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(
            415,
            f"Content-Type must be application/json, got {media or 'none'!r}",
            code="unsupported_media_type",
        )
