"""Admission by KV memory: what a request's caches can hold, known before it starts.

An evicting cache never holds more than its budget (plus the one free slot of the decode
step's slot layout), so its KV bytes are bounded by its settings alone; a full cache holds
its prompt and its completion. The worker admits a request only while the sum of what the
running ones can hold, plus its own, fits ``max_kv_bytes``; one that can never fit is refused
with the parameter to lower. Transient rows (a prefill chunk, before the block eviction
trims it) are activations of that step, not cache, and are not reserved.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from qfserve.engine.kv.config import CacheConfig, default_recent, fit_chunk
from qfserve.engine.kv.layout import layout
from qfserve.engine.serving.jobs import Admission, Job

if TYPE_CHECKING:
    from qfserve.engine.serving.config import EngineConfig
    from qfserve.engine.text.requests import GenerationRequest

DEFAULT_KV_SHARE = 0.25  # of physical memory, when --max-kv-bytes is not given
# The smallest budget an auto request is evicted to, memory allowing: on SmolLM2 the
# needle study kept the full cache's answers at 2x and lost them from 8x (docs/eviction.md).
MIN_AUTO_BUDGET = 512


def default_max_kv_bytes() -> int:
    """A quarter of the machine's physical memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: 4 GiB
        total = 16 * 2**30
    return int(total * DEFAULT_KV_SHARE)


def _shape(model: Any, config: dict[str, Any]) -> tuple[int, int, int]:
    """(full-attention layers, KV heads, head_dim) from the model's arguments, else its
    ``config.json`` (sliding-window layers: :func:`window_bytes`)."""
    args = getattr(model, "args", None)

    def field(name: str, default: Any = None) -> Any:
        value = getattr(args, name, None) if args is not None else None
        return config.get(name, default) if value is None else value

    layers = (
        layout(model).full_layers
        if getattr(model, "layers", None)
        else int(field("num_hidden_layers"))
    )
    heads = int(field("num_attention_heads"))
    kv_heads = int(field("num_key_value_heads") or heads)
    head_dim = int(field("head_dim") or int(field("hidden_size")) // heads)
    return layers, kv_heads, head_dim


def kv_row_bytes(model: Any, config: dict[str, Any], cache: CacheConfig | None = None) -> int:
    """Bytes one position occupies in one request's caches, over layers and KV heads: keys
    and values, plus an evicting cache's own per-row arrays (its float32 score and int32
    slot order; with chunks, per-token scores and positions; with adaptive budgets, the
    padding mask)."""
    layers, kv_heads, head_dim = _shape(model, config)
    per_head = 2 * head_dim * _activation_bytes(model)
    if cache is not None and cache.evicts:
        per_head += (
            8
            + (8 if cache.chunk > 1 or cache.method == "kvzip" else 0)
            + (1 if cache.budget_mode == "adaptive" else 0)
        )
    return layers * kv_heads * per_head


def window_bytes(model: Any, config: dict[str, Any], tokens: int) -> int:
    """Bytes the sliding-window layers hold after ``tokens`` positions (mlx-lm's rotating
    caches: keys and values of their last ``window`` rows, never evicted)."""
    _, kv_heads, head_dim = _shape(model, config)
    rows = layout(model).window_rows(tokens) if getattr(model, "layers", None) else 0
    return rows * kv_heads * 2 * head_dim * _activation_bytes(model)


def _activation_bytes(model: Any) -> int:
    """Bytes per element of the keys the model writes (its norm weights' float type)."""
    from mlx.utils import tree_flatten

    for entry in tree_flatten(model.parameters()):
        name, p = cast("tuple[str, Any]", entry)
        if "norm" in name and hasattr(p, "dtype"):
            return int(p.dtype.size)
    return 4


def rows_needed(cache: CacheConfig, n_kv_heads: int, prompt_tokens: int, max_tokens: int) -> int:
    """Rows per KV head the request's caches hold at most."""
    if not cache.evicts:
        return prompt_tokens + max_tokens
    if cache.budget_mode == "adaptive":  # the longest head, padded: every other at its floor
        rows = n_kv_heads * cache.budget - (n_kv_heads - 1) * cache.floor_rows
    else:
        rows = cache.budget
    rows = min(rows + 1, prompt_tokens + max_tokens)  # + the decode step's free slot
    if cache.method == "kvzip" and prompt_tokens > cache.budget:
        # The reconstruction pass holds the whole prompt plus one chunk of its own rows.
        from qfserve.engine.kv.kvzip import DEFAULT_CHUNK, REPEAT_ROWS

        rows = max(rows, prompt_tokens + min(prompt_tokens, DEFAULT_CHUNK) + REPEAT_ROWS)
    return rows


def kv_need(
    loaded: Any, cache: CacheConfig, prompt_tokens: int, max_tokens: int
) -> tuple[int, str]:
    """(bytes the request's caches hold at most, the parameter that sets them)."""
    row = kv_row_bytes(loaded.model, loaded.config, cache)
    _, kv_heads, _ = _shape(loaded.model, loaded.config)
    rows = rows_needed(cache, kv_heads, prompt_tokens, max_tokens)
    param = "qfilters_budget" if cache.evicts else "max_tokens"
    windows = window_bytes(loaded.model, loaded.config, prompt_tokens + max_tokens)
    return rows * row + windows, param


def hold_need(loaded: Any, cache: CacheConfig, prompt_tokens: int, max_tokens: int) -> int | None:
    """Bytes a kvzip request holds when its turn runs on its full cache and is compressed
    only when kept for the next turn: every row, then the reconstruction pass's chunk
    beside them (``None``: the request never holds more than its budget)."""
    total = prompt_tokens + max_tokens
    if cache.method != "kvzip" or total <= cache.budget:
        return None
    from qfserve.engine.kv.kvzip import DEFAULT_CHUNK, REPEAT_ROWS

    rows = total + min(total, DEFAULT_CHUNK) + REPEAT_ROWS
    windows = window_bytes(loaded.model, loaded.config, total)
    return rows * kv_row_bytes(loaded.model, loaded.config, cache) + windows


def kvzip_limit(
    loaded: Any, cache: CacheConfig, max_kv_bytes: int, prefill_chunk: int
) -> tuple[int, int] | None:
    """Rows a kvzip prompt too long for ``max_kv_bytes`` may hold before what is read so far
    is compressed, and the bytes it then needs: that many rows, a prefill chunk read beside
    them, and the pass's chunk (``None``: not even what a compressed layer keeps fits
    beside those). Layers are counted together (:func:`qfserve.engine.kv.kvzip.over_limit`):
    the limit is their mean."""
    from qfserve.engine.kv.kvzip import DEFAULT_CHUNK, REPEAT_ROWS

    row = max(1, kv_row_bytes(loaded.model, loaded.config, cache))
    # The sliding layers' windows fill first (a long prompt's are full): the rest is the limit's.
    windows = window_bytes(loaded.model, loaded.config, 2**31)
    fit = (max_kv_bytes - windows) // row - REPEAT_ROWS
    read = prefill_chunk + 1  # a read may take one token more: no one-token chunk is left
    # At most: the limit, a chunk read past it, and a pass over those unscored rows.
    limit = fit // 2 - read
    if limit + read > DEFAULT_CHUNK:
        limit = fit - read - DEFAULT_CHUNK
    _, kv_heads, _ = _shape(loaded.model, loaded.config)
    # What a compressed layer keeps, padded to its longest head (rows shared across layers
    # are capped to fit instead: qfserve.engine.kv.kvzip.shares).
    kept = cache.budget
    if cache.budget_mode == "adaptive":
        kept = kv_heads * cache.budget - (kv_heads - 1) * cache.floor_rows
    if limit <= kept:
        return None
    peak = limit + read + min(DEFAULT_CHUNK, limit + read) + REPEAT_ROWS
    return limit, peak * row + windows


def resolve_auto(
    loaded: Any,
    template: CacheConfig,
    auto: Any,
    prompt_tokens: int,
    max_tokens: int,
    config: EngineConfig,
    max_kv_bytes: int,
) -> CacheConfig:
    """The settings a request whose budget follows memory runs with: every row (``full``)
    while its full cache fits ``max_kv_bytes``, so a user who sets nothing never gets a
    worse answer than the full cache while memory allows it; beyond, ``template``'s method
    with the largest budget whose cache fits the request's share (``max_kv_bytes /
    max_batch``, at least :data:`MIN_AUTO_BUDGET` rows where the memory holds them) and a
    recent window of a quarter of it (``auto``: what the request sent for ``recent`` and
    ``chunk``, a :class:`qfserve.engine.kv.config.AutoBudget`)."""
    total = prompt_tokens + max_tokens
    full = dataclasses.replace(
        template, method="full", budget=max(total, 1), recent=0, chunk=1, budget_mode="per_head"
    )
    if kv_need(loaded, full, prompt_tokens, max_tokens)[0] <= max_kv_bytes:
        return full
    row = max(1, kv_row_bytes(loaded.model, loaded.config, template))
    room = max_kv_bytes - window_bytes(loaded.model, loaded.config, total)  # sliding layers'
    fits = room // row - 1  # - the decode step's free slot
    share = room // max(1, config.max_batch) // row - 1
    budget = max(1, min(fits, max(share, MIN_AUTO_BUDGET)))
    recent = auto.recent if auto.recent is not None else default_recent(budget, template.n_sink)
    chunk = (
        auto.chunk if auto.chunk is not None else fit_chunk(config.chunk, template.method, budget)
    )
    return dataclasses.replace(template, budget=budget, recent=recent, chunk=chunk)


def prepare(
    job: Job,
    loaded: Any,
    caches_for: Callable[[CacheConfig], list[Any]],
    fetch: Callable[[tuple[Any, ...], list[int]], tuple[list[Any] | None, int]] | None,
    key_for: Callable[[GenerationRequest], tuple[Any, ...]],
    max_kv_bytes: int,
    config: EngineConfig,
) -> Admission:
    """A queued job made ready for the batch: its prompt encoded, an ``auto`` budget
    resolved (:func:`resolve_auto`; the job then carries the settings that run), its caches
    (a kept turn's copy from ``fetch`` when one holds a prefix of the prompt, else
    ``caches_for``) and the KV bytes they need. A kvzip prompt too long to hold whole within
    ``max_kv_bytes`` is set to compress as it is read, whenever its rows reach what fits.

    Raises:
        PromptError: the prompt cannot be encoded, or its caches can never fit.
        ConfigError: the request's cache settings do not suit this model.
    """
    from qfserve.engine.kv import kvzip
    from qfserve.engine.text.prompts import PromptError, encode_prompt

    request = job.request
    prompt, max_tokens = encode_prompt(loaded, request)
    job.record.prompt_tokens = len(prompt)
    if request.auto is not None:
        cache = resolve_auto(
            loaded, request.cache, request.auto, len(prompt), max_tokens, config, max_kv_bytes
        )
        if request.cache.evicts and not cache.evicts:
            # Settings this model cannot honour are refused whether or not eviction runs.
            caches_for(request.cache)
        request = job.request = dataclasses.replace(request, cache=cache, auto=None)
        job.record.configure(cache)
    caches, cached = fetch(key_for(request), prompt) if fetch is not None else (None, 0)
    if caches is None:
        caches = caches_for(request.cache)
    need, param = kv_need(loaded, request.cache, len(prompt), max_tokens)
    if need > max_kv_bytes and request.cache.method == "kvzip":
        fit = kvzip_limit(loaded, request.cache, max_kv_bytes, config.prefill_chunk)
        if fit is not None:
            kvzip.set_limit(caches, fit[0], config.prefill_chunk)
            # A kept turn compressed without a limit may hold more than a pass leaves
            # (a position's bytes over every layer, divided by the layers: a layer-row's).
            layers = _shape(loaded.model, loaded.config)[0]
            layer_row = kv_row_bytes(loaded.model, loaded.config, request.cache) // max(1, layers)
            need = fit[1] + kvzip.beyond_keep(caches) * layer_row
    if need > max_kv_bytes:
        raise PromptError(
            f"this request's KV cache can hold {need} bytes, more than the server's "
            f"--max-kv-bytes {max_kv_bytes}; lower {param}",
            param,
        )
    return Admission(job, prompt, max_tokens, caches, need, cached)
