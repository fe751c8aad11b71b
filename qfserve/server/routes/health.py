"""``GET /health``: 200 when the worker can take requests, else 503 saying why (no auth)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from qfserve.server.dependencies import SettingsDep, WorkerDep
from qfserve.server.errors import APIError
from qfserve.server.openapi import HealthStatus, errors

router = APIRouter()


@router.get("/health", responses={200: {"model": HealthStatus}, **errors(503)})
async def health(worker: WorkerDep, settings: SettingsDep) -> JSONResponse:
    if worker.ready and not worker.draining:
        return JSONResponse(
            {
                "status": "ok",
                "model": worker.loaded.name,  # type: ignore[union-attr]
                "queue_length": worker.queue_length(),
                "api_key_required": settings.api_key is not None,
            }
        )
    reason = "draining" if worker.draining else worker.status
    detail = f": {worker.error}" if worker.error else ""
    raise APIError(503, f"not ready ({reason}){detail}", code=reason, headers={"Retry-After": "5"})
