"""``GET /admin/cache``: active requests, recent history and totals (counts only).

Needs ``--admin-key`` when one is set (else the API key, if any); ``--no-admin`` removes it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from qfserve.server.dependencies import SettingsDep, WorkerDep, require_admin_key
from qfserve.server.openapi import errors

router = APIRouter(dependencies=[Depends(require_admin_key)])


@router.get("/admin/cache", responses=errors(401))
async def cache_overview(worker: WorkerDep, settings: SettingsDep) -> dict[str, Any]:
    defaults = settings.cache_defaults()
    return {
        "model": worker.loaded.name if worker.loaded else None,
        "defaults": {
            "method": worker.admitter.picked,  # --kv-method auto's pick for this model
            "budget": settings.budget,
            "recent": settings.recent if settings.auto_budget else defaults.recent,
            "n_sink": defaults.n_sink,
            "chunk": defaults.chunk,
            "budget_mode": defaults.budget_mode,
            "floor": defaults.floor,
        },
        "filter_source": worker.filter_source,
        **worker.snapshot(),
    }
