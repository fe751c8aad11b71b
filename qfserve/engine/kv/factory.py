"""Build one request's caches: mlx-lm's layout, with full-attention layers made evicting."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from qfserve import kernels
from qfserve.calibrations.kvzap.hidden import install_hidden_taps
from qfserve.calibrations.kvzap.surrogate import Surrogate
from qfserve.engine.kv.attention import install_head_masks
from qfserve.engine.kv.cache import EvictionCache, FullKVCache
from qfserve.engine.kv.config import QUERY_AWARE, TAPPED, CacheConfig, ConfigError
from qfserve.engine.kv.kvzap import kvzap_scorer
from qfserve.engine.kv.kvzip import KVzipScorer
from qfserve.engine.kv.query_aware import SnapKVScorer, TOVAScorer
from qfserve.engine.kv.scorers import (
    KeySVDScorer,
    KNormScorer,
    QFilterScorer,
    RecencyScorer,
    Scorer,
)
from qfserve.engine.kv.selfcal import QueryTap, SelfCalibratingScorer, install_query_taps


def make_scorer(
    config: CacheConfig,
    layer_filters: mx.array | None,
    layer_scale: mx.array | None = None,
    tap: QueryTap | None = None,
    kvzap: tuple[Any, tuple[mx.array, ...]] | None = None,
) -> Scorer:
    """The scorer for one layer: calibrated filters ``(H, D)`` when given (scaled to expected
    logits by ``(H,)`` query scales under adaptive budgets), else filters from the request's
    own queries through the layer's ``tap``, else the key-SVD fallback; or the method's
    (``kvzip`` ranks generated rows by the calibrated filters, else by K-norm; ``kvzap`` by
    its surrogate: ``kvzap`` is the layer's hidden-state tap and weights)."""
    if config.method == "kvzap":
        if kvzap is None:
            raise ValueError("method 'kvzap' needs the layer's hidden-state tap and surrogate")
        return kvzap_scorer(*kvzap, shared=config.budget_mode == "global")
    if config.method == "kvzip":
        if tap is None:
            raise ValueError("method 'kvzip' needs the layer's query tap")
        inner: Scorer = KNormScorer()
        if layer_filters is not None:
            inner = QFilterScorer(layer_filters, sign=config.sign)
        return KVzipScorer(tap, inner, shared=config.budget_mode == "global")
    if config.method == "qfilters":
        if layer_filters is not None:
            return QFilterScorer(layer_filters, sign=config.sign, query_scale=layer_scale)
        if tap is not None:
            return SelfCalibratingScorer(tap, budget=config.budget, sign=config.sign)
        return KeySVDScorer(config.calib_tokens, sign=config.sign)
    if config.method == "knorm":
        return KNormScorer()
    if config.method == "streaming":
        return RecencyScorer()
    if config.method in QUERY_AWARE:
        if tap is None:
            raise ValueError(f"method {config.method!r} needs the layer's query tap")
        if config.method == "snapkv":
            return SnapKVScorer(tap, scale=tap.scale)
        return TOVAScorer(tap, scale=tap.scale)
    raise ValueError(f"method {config.method!r} has no scorer")


def _check_filters(filters: mx.array, caches: list[Any], model: nn.Module) -> None:
    n_layers = len(caches)
    if filters.ndim != 3 or filters.shape[0] != n_layers:
        raise ValueError(
            f"filters must have shape [n_layers={n_layers}, n_kv_heads, head_dim], "
            f"got {tuple(filters.shape)}"
        )
    for i, layer in enumerate(getattr(model, "layers", [])):
        attn = getattr(layer, "self_attn", None)
        n_kv = getattr(attn, "n_kv_heads", None)
        head_dim = getattr(attn, "head_dim", None)
        if n_kv is not None and head_dim is not None and filters.shape[1:] != (n_kv, head_dim):
            raise ValueError(
                f"filters for layer {i} have shape {tuple(filters.shape[1:])}, but the model's "
                f"attention has n_kv_heads={n_kv}, head_dim={head_dim}"
            )


def _adaptive_scale(
    config: CacheConfig, filters: mx.array | None, query_scale: mx.array | np.ndarray | None
) -> mx.array:
    if config.method != "qfilters" or filters is None:
        raise ConfigError(
            "budget_mode",
            "budget_mode='adaptive' needs calibrated Q-Filters: only their scores, scaled by "
            "each head's query scale, are comparable across heads (K-norm, streaming and the "
            "key-SVD fallback are not)",
        )
    if query_scale is None:
        raise ConfigError(
            "budget_mode",
            "budget_mode='adaptive' needs the query scales that calibration format version 2 "
            "records beside the filters; this model's calibration predates them (recalibrate "
            "with `qfserve calibrate`)",
        )
    scale = mx.array(query_scale, dtype=mx.float32)
    if scale.shape != filters.shape[:2]:
        raise ConfigError(
            "budget_mode",
            f"query_scale must have shape {tuple(filters.shape[:2])}, got {tuple(scale.shape)}",
        )
    return scale


def _kvzap_taps(
    model: nn.Module, config: CacheConfig, surrogate: Surrogate | None, n_layers: int
) -> list[Any] | None:
    """Every layer's hidden-state tap where ``config`` runs KVzap (``None`` elsewhere)."""
    if config.method != "kvzap":
        return None
    if surrogate is None:
        raise ConfigError(
            "method",
            "kvzap needs the model's KVzap surrogates and none were found for this model "
            "(make them with `qfserve calibrate --kvzap`)",
        )
    if surrogate.n_layers != n_layers:
        raise ConfigError(
            "method",
            f"the KVzap surrogates hold {surrogate.n_layers} layers, the model {n_layers}",
        )
    try:
        return install_hidden_taps(model)
    except ValueError as exc:
        raise ConfigError("method", f"kvzap needs each layer's input norm: {exc}") from None


def make_caches(
    model: nn.Module,
    config: CacheConfig,
    *,
    filters: mx.array | np.ndarray | None = None,
    query_scale: mx.array | np.ndarray | None = None,
    self_calibrate: bool = False,
    surrogate: Surrogate | None = None,
) -> list[Any]:
    """One cache per layer, built the way mlx-lm does, with plain ``KVCache`` layers replaced.

    Sliding-window, recurrent and other special caches the model asks for are kept as they
    are; only full-attention ``KVCache`` layers become :class:`EvictionCache` (or, for
    ``method="full"``, :class:`FullKVCache`).

    Args:
        model: Any mlx-lm model.
        config: The eviction settings.
        filters: Calibrated Q-Filters ``[n_layers, n_kv_heads, head_dim]`` (qfilters only);
            without them the key-SVD fallback estimates a direction online.
        query_scale: ``[n_layers, n_kv_heads]`` ``E<q, f>`` from the calibration (format
            version 2); required by ``budget_mode="adaptive"``.
        self_calibrate: Without ``filters``, Q-Filters come from the request's own prompt
            queries (:mod:`qfserve.engine.kv.selfcal`) instead of the key-SVD fallback, where the
            model's attention lets its queries be tapped.
        surrogate: The model's KVzap surrogates (``kvzap`` only).
    Returns:
        A list to pass as ``prompt_cache=`` to mlx-lm's generation functions.
    Raises:
        ValueError: filters of the wrong layout, or adaptive budgets without calibrated
            filters and their query scales (scores must be comparable across heads).
    """
    # Resolved once per request: "on" without a GPU backend (or over its budget bound) raises.
    use_kernel = config.evicts and kernels.resolve_kernel_mode(config.kernel, config.budget)
    caches = make_prompt_cache(model)
    try:  # blocked CPU attention and the reconstruction pass go through the attention hook
        install_head_masks(model)
    except ValueError:
        if config.method == "kvzip":
            raise ConfigError("method", "kvzip needs mlx-lm's attention function") from None
    if filters is not None:
        if config.method not in ("qfilters", "kvzip"):
            raise ValueError(
                f"filters are only used by methods 'qfilters' and 'kvzip', got {config.method!r}"
            )
        filters = mx.array(filters, dtype=mx.float32)
        _check_filters(filters, caches, model)
    scale = None
    hidden = _kvzap_taps(model, config, surrogate, len(caches))
    if config.evicts and config.budget_mode != "per_head":
        # kvzip's scores are attention weights, kvzap's their logs: comparable across heads
        if config.method not in ("kvzip", "kvzap"):
            scale = _adaptive_scale(config, filters, query_scale)
        try:
            install_head_masks(model)
        except ValueError as exc:
            raise ConfigError("budget_mode", str(exc)) from None

    taps: list[QueryTap] | None = None
    if config.method in TAPPED:
        try:
            taps = install_query_taps(model)
        except ValueError as exc:
            raise ConfigError(
                "method", f"{config.method} needs the model's queries: {exc}"
            ) from None
    elif self_calibrate and filters is None and config.method == "qfilters" and config.evicts:
        try:
            taps = install_query_taps(model)
        except ValueError:  # no standard attention to tap: the key-SVD fallback
            taps = None
    for i, cache in enumerate(caches):
        if type(cache) is not KVCache:  # subclasses and other cache kinds stay as they are
            continue
        if not config.evicts:
            caches[i] = FullKVCache()
            continue
        scorer = make_scorer(
            config,
            None if filters is None else filters[i],
            None if scale is None else scale[i],
            None if taps is None else taps[i],
            None if hidden is None else (hidden[i], surrogate.layer(i)),  # type: ignore[union-attr]
        )
        # Heads of one layer keep different counts (stored padded to the longest) under
        # adaptive budgets and KVzip's rows shared across layers; kvzap's shared rows keep the
        # same count in every head of a layer (qfserve.engine.kv.kvzap.share).
        ragged = config.budget_mode == "adaptive" or (
            config.budget_mode == "global" and config.method != "kvzap"
        )
        caches[i] = EvictionCache(
            scorer,
            budget=config.budget,
            n_sink=config.n_sink,
            recent=config.recent,
            chunk=config.chunk,
            floor=config.floor_rows if ragged else None,
            positions=config.positions,
            use_kernel=use_kernel,
            threshold=config.threshold,
        )
    return caches
