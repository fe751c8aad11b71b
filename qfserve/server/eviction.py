"""The request fields that choose eviction (OpenAI-compatible extensions, sent in
``extra_body``): ``kv_method`` and the ``qfilters_*`` knobs, validated against the engine's
one list of methods and its :class:`CacheConfig`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from qfserve.engine.kv.config import METHODS
from qfserve.server.messages import Strict

KVMethod = Literal["qfilters", "kvzip", "kvzap", "knorm", "streaming", "snapkv", "tova", "full"]
assert set(METHODS) == set(KVMethod.__args__)  # type: ignore[attr-defined]
CACHE_PARAMS = {
    "method": "kv_method",
    "budget": "qfilters_budget",
    "recent": "qfilters_recent",
    "n_sink": "qfilters_n_sink",
    "chunk": "qfilters_chunk",
    "budget_mode": "qfilters_budget_mode",
    "floor": "qfilters_floor",
    "positions": "kv_cache_detail",
    "threshold": "kvzap_threshold",
}


def http_param(name: str | None) -> str | None:
    """The request field an engine setting's name stands for (other names are fields)."""
    return CACHE_PARAMS.get(name, name) if name else None


class EvictionFields(Strict):
    """qfserve's extensions: how this request's KV caches evict (server flags are defaults)."""

    qfilters_budget: Annotated[
        int | None,
        Field(
            ge=1,
            description="KV rows kept per layer and KV head, sinks and recent rows "
            "included. Default: the server's --budget.",
        ),
    ] = None
    qfilters_recent: Annotated[
        int | None,
        Field(ge=0, description="Most recent positions never evicted. Default: --recent."),
    ] = None
    qfilters_n_sink: Annotated[
        int | None,
        Field(
            ge=0,
            description="Leading positions (attention sinks) never evicted. Default: --n-sink.",
        ),
    ] = None
    qfilters_chunk: Annotated[
        int | None,
        Field(
            ge=1,
            description="Prefill and new turns keep whole chunks of this many positions, "
            "ranked by their mean score (1 = token by token). Default for qfilters and knorm: "
            "--chunk where below the budget, or without --chunk 8 at budgets of 256 or more; "
            "otherwise 1.",
        ),
    ] = None
    qfilters_budget_mode: Annotated[
        Literal["per_head", "adaptive", "global"] | None,
        Field(
            description="per_head: budget rows in every KV head; adaptive: a layer's heads "
            "share budget x heads rows (AdaKV), ranked by expected attention logits (qfilters: "
            "needs calibrated filters with query scales) or by kvzip's scores; global (kvzip "
            "and kvzap): every layer and head share budget x heads x layers rows by kvzip's "
            "or kvzap's scores. Default: --budget-mode.",
        ),
    ] = None
    qfilters_floor: Annotated[
        float | None,
        Field(
            gt=0,
            le=1,
            description="Share of the budget every head keeps under adaptive budgets. "
            "Default: --floor.",
        ),
    ] = None
    qfilters_reuse: Annotated[
        bool | None,
        Field(
            description="Continue a finished request's KV cache when it holds the start of "
            "this prompt (multi-turn chat), and keep this one's for the next turn. "
            "Default: true (when the server keeps a prompt cache).",
        ),
    ] = None
    kv_method: Annotated[
        KVMethod | None,
        Field(
            description="Eviction method: qfilters (calibrated projection), kvzip (a prompt "
            "over its budget is scored by the attention a reconstruction of it pays each key: "
            "one extra pass over the prompt), kvzap (that attention predicted from each key's "
            "hidden state by the model's learned surrogates: no extra pass), knorm, streaming "
            "(sinks + recent), snapkv or tova (query-aware references: they read the model's "
            "queries to evict) or full (no eviction). Default: --kv-method."
        ),
    ] = None
    kvzap_threshold: Annotated[
        float | None,
        Field(
            allow_inf_nan=False,
            description="kv_method kvzap only: also evict rows outside the sinks and the "
            "recent window whose predicted log KVzip+ score is below this (for example -6), "
            "the budget still the cap; kv_cache.compression_ratio says what it reached. "
            "Default: none (the budget alone).",
        ),
    ] = None
    kv_cache_detail: Annotated[
        bool | None,
        Field(
            description="Report, with the answer (the final stream chunk, or the body), which "
            "prompt tokens the KV cache still holds: per token, how many layers x KV heads keep "
            "its row (run-length coded), and the same counts over each message's characters. "
            "Refused for kv_method full (it keeps everything) and for prompts over the "
            "server's --kv-detail-max-tokens. Default: false.",
        ),
    ] = None
