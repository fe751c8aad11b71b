"""``GET /metrics``: Prometheus text format from the app's own registry."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from qfserve.server.dependencies import MetricsDep, require_api_key
from qfserve.server.openapi import errors

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {}}},
        **errors(401),
    },
)
async def metrics(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
