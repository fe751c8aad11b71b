"""``POST /v1/chat/completions``: messages through the model's chat template."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from qfserve.server.dependencies import (
    MetricsDep,
    SettingsDep,
    WorkerDep,
    require_api_key,
    require_json,
)
from qfserve.server.formats import ChatFormat
from qfserve.server.generation import Generation
from qfserve.server.openapi import ChatCompletion, ChatCompletionChunk, generation
from qfserve.server.schemas import ChatCompletionRequest

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post(
    "/v1/chat/completions",
    dependencies=[Depends(require_json)],
    responses=generation(ChatCompletion, ChatCompletionChunk),
)
async def create_chat_completion(
    body: ChatCompletionRequest,
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
        fmt=ChatFormat(tools=body.tool_names),
        endpoint="chat",
    ).start()
    return generation.sse() if body.stream else await generation.json()
