"""``POST /v1/completions``: a raw prompt (text or token ids), no chat template."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from qfserve.server.dependencies import (
    MetricsDep,
    SettingsDep,
    WorkerDep,
    require_api_key,
    require_json,
)
from qfserve.server.formats import CompletionFormat
from qfserve.server.generation import Generation
from qfserve.server.openapi import Completion, CompletionChunk, generation
from qfserve.server.schemas import CompletionRequest

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post(
    "/v1/completions",
    dependencies=[Depends(require_json)],
    responses=generation(Completion, CompletionChunk),
)
async def create_completion(
    body: CompletionRequest,
    request: Request,
    worker: WorkerDep,
    settings: SettingsDep,
    metrics: MetricsDep,
):
    generation = await Generation(
        body,
        request,
        worker=worker,
        settings=settings,
        metrics=metrics,
        fmt=CompletionFormat(),
        endpoint="completions",
    ).start()
    return generation.sse() if body.stream else await generation.json()
