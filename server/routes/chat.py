"""``POST /v1/chat/completions``: messages through the model's chat template."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from server.dependencies import MetricsDep, SettingsDep, WorkerDep, require_api_key, require_json
from server.formats import ChatFormat
from server.generation import Generation
from server.openapi import ChatCompletion, ChatCompletionChunk, generation
from server.schemas import ChatCompletionRequest

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
        fmt=ChatFormat(tools=body.wants_tool_calls),
        endpoint="chat",
    ).start()
    return generation.sse() if body.stream else await generation.json()
