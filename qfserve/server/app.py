"""The FastAPI app: ``build_app(settings)``; its ``lifespan`` starts the worker that loads
the model (never at import), and stops it on shutdown."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from qfserve.engine.serving.worker import Worker
from qfserve.server.errors import install_error_handlers
from qfserve.server.metrics import Metrics
from qfserve.server.middleware import BodyLimitMiddleware, StatusCountMiddleware
from qfserve.server.openapi import install_openapi
from qfserve.server.routes import admin, chat, completions, health, metrics, models, page, status
from qfserve.server.settings import Settings

logger = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # The worker thread loads the model itself, so /health answers 503 while it loads.
    app.state.worker.start()
    yield
    app.state.worker.drain()
    app.state.worker.stop()


def build_app(settings: Settings | None = None, *, worker: Worker | None = None) -> FastAPI:
    """An app serving ``settings.model``; ``worker`` replaces the default one (tests)."""
    settings = settings or Settings()
    app = FastAPI(
        title="qfserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.settings = settings
    app.state.worker = worker or Worker(settings)
    app.state.metrics = Metrics(app.state.worker)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(StatusCountMiddleware, counter=app.state.metrics.responses)  # outermost
    for module in (chat, completions, models, health, metrics, status):
        app.include_router(module.router)
    if settings.admin_enabled:
        app.include_router(admin.router)
    if not settings.no_webui:
        app.include_router(page.router)
        app.mount("/page", page.files(), name="page")
    install_openapi(app)
    return app
