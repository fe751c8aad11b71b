"""``GET /v1/models``: the one served model, with its context length."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from server.dependencies import WorkerDep, require_api_key
from server.errors import APIError
from server.openapi import errors
from server.schemas import ModelCard, ModelList

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/models", response_model=ModelList, responses=errors(401, 503))
async def list_models(worker: WorkerDep) -> ModelList:
    loaded = worker.loaded
    if loaded is None:
        raise APIError(
            503, "the model is still loading", code="unavailable", headers={"Retry-After": "5"}
        )
    card = ModelCard(
        id=loaded.name, created=worker.started_at, context_length=loaded.context_length
    )
    return ModelList(data=[card])
