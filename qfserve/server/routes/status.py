"""``GET /v1/status``: the light figures a client polls while its answer streams: the served
model (and what its decode products round activations to), the server's KV memory (used, reserved, its ``--max-kv-bytes``) and, with
``?request=<id>`` (the id of a response), that request's cache figures. Counts only, never
text; behind the API key like the generation routes (``/admin/cache`` holds the rest)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from qfserve.engine.models.memory import resident_bytes
from qfserve.server.dependencies import SettingsDep, WorkerDep, require_api_key, served_model
from qfserve.server.errors import APIError
from qfserve.server.openapi import errors

router = APIRouter(dependencies=[Depends(require_api_key)])

_REQUEST_FIELDS = (
    "state",
    "method",
    "budget",
    "recent",
    "chunk",
    "prompt_tokens",
    "completion_tokens",
    "tokens_seen",
    "tokens_kept",
    "kept_bytes",
    "full_seq_bytes",
    "compression_ratio",
)


@router.get("/v1/status", responses=errors(401, 404, 503))
async def status(
    worker: WorkerDep, settings: SettingsDep, request: str | None = None
) -> dict[str, Any]:
    loaded = served_model(worker)
    kept, full = worker.active_kv_bytes()
    body: dict[str, Any] = {
        "model": loaded.name,
        "context_length": loaded.context_length,
        "decode_activations": worker.ledger.decode_activations,
        "defaults": {
            "kv_method": worker.admitter.picked,  # --kv-method auto's pick for this model
            "qfilters_budget": settings.budget,
        },
        "memory": {
            "max_kv_bytes": worker.max_kv_bytes,
            "kv_used_bytes": kept,
            "kv_full_bytes": full,
            "kv_reserved_bytes": worker.admitter.reserved(),
            "weights_bytes": worker.ledger.weights_bytes,
            "resident_bytes": resident_bytes(),
        },
        "queue_length": worker.queue_length(),
    }
    if request is not None:
        record = worker.ledger.find(request)
        if record is None:
            raise APIError(
                404, f"no live or recent request {request!r}", param="request", code="not_found"
            )
        body["request"] = {name: record[name] for name in _REQUEST_FIELDS}
    return body
