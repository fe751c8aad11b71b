"""``GET /v1/models`` and ``GET /v1/models/{model}``: the one served model, with its context
length."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from qfserve.server.dependencies import WorkerDep, require_api_key, served_model
from qfserve.server.generation import check_model
from qfserve.server.openapi import ModelCard, ModelList, errors

router = APIRouter(dependencies=[Depends(require_api_key)])


def _card(worker: WorkerDep) -> ModelCard:
    loaded = served_model(worker)
    return ModelCard(
        id=loaded.name, created=worker.started_at, context_length=loaded.context_length
    )


@router.get("/v1/models", response_model=ModelList, responses=errors(401, 503))
async def list_models(worker: WorkerDep) -> ModelList:
    return ModelList(data=[_card(worker)])


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=errors(401, 404, 503))
async def retrieve_model(model: str, worker: WorkerDep) -> ModelCard:
    card = _card(worker)
    check_model(model, worker)  # 404 in OpenAI's shape for another id
    return card
