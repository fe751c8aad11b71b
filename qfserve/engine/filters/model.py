"""Which Q-Filters a server's requests get, and how that changes while it serves.

At load, the registry's calibration for the model's weights (:mod:`qfserve.engine.filters.artifact`).
Without one, what happens is the self-calibration mode:

- ``traffic`` (the default): the queries sampled from traffic are pooled into an artifact
  (:mod:`qfserve.engine.filters.traffic`); once it is written, later requests use it. Until then each
  request's cache estimates its direction from its keys (the key-SVD fallback).
- ``prompt``: as ``traffic``, but until the artifact exists each request's Q-Filters come
  from its own prompt's queries (:mod:`qfserve.engine.kv.selfcal`). Not the default: on SmolLM2's pass
  key the prompt's own filters found fewer needles than the fallback, even at 2x (README).
- ``off``: the key-SVD fallback, nothing pooled.

Where the attention cannot be tapped, every mode is ``off``. Owned by the model thread; other
threads only read ``source``.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, get_args

from qfserve.engine.kv.config import CacheConfig, ConfigError
from qfserve.engine.models.loading import LoadedModel

logger = logging.getLogger(__name__)

SelfCalibration = Literal["traffic", "prompt", "off"]
SELF_CALIBRATION_MODES: tuple[str, ...] = get_args(SelfCalibration)
DEFAULT_SELF_CALIBRATION: SelfCalibration = "traffic"


def check_mode(mode: str) -> None:
    """Raises ``ValueError`` unless ``mode`` is a self-calibration mode."""
    if mode not in SELF_CALIBRATION_MODES:
        raise ValueError(
            f"self_calibration must be one of {', '.join(SELF_CALIBRATION_MODES)}, got {mode!r}"
        )


class ModelFilters:
    """The loaded model's filters and where they came from.

    Args:
        loaded: The model.
        self_calibration: What a model without an artifact does (see the module doc).
        traffic_samples: Queries per layer pooled before the artifact is written
            (``None``: calibration's default sample count).
        traffic_prompts: Prompts pooled at least before it is written (``None``:
            :data:`qfserve.engine.filters.traffic.DEFAULT_MIN_PROMPTS`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        self_calibration: str = DEFAULT_SELF_CALIBRATION,
        traffic_samples: int | None = None,
        traffic_prompts: int | None = None,
    ) -> None:
        check_mode(self_calibration)
        self.loaded = loaded
        self.self_calibration = self_calibration
        self.filters: Any = None
        self.kvzap: Any = None  # qfserve.calibrations.kvzap.surrogate.Surrogate, where one exists
        self.query_scale: Any = None
        self.source = "none"
        self._traffic: Any = None  # qfserve.engine.filters.traffic.TrafficCalibration while pooling
        self.ranks = 1  # tensor-parallel ranks the model is split over (see shard)
        try:
            from qfserve.calibrations.model_info import model_fingerprint
            from qfserve.engine.filters.artifact import resolve_calibration
        except ImportError:  # no calibration support installed: the key-SVD fallback
            logger.warning(
                "qfserve.engine.filters.artifact is unavailable; Q-Filters use the online fallback"
            )
            self.source = "fallback"
            self.fingerprint = loaded.model_id
        else:
            self.fingerprint = model_fingerprint(loaded.model, loaded.config)
            self.filters, self.query_scale, self.source = resolve_calibration(
                loaded.model, loaded.model_id, fingerprint=self.fingerprint
            )
            if self.filters is None and self_calibration != "off":
                self._start_learning(traffic_samples, traffic_prompts)
            self.kvzap = _surrogate(loaded.model_id, self.fingerprint)
        logger.info("Q-Filters for %s: %s", loaded.model_id, self.source)
        if self.kvzap is not None:
            fidelity = self.kvzap.fidelity.get("spearman_median")
            logger.info(
                "KVzap surrogates for %s: %s (held-out Spearman %s)",
                loaded.model_id,
                self.kvzap.form,
                "n/a" if fidelity is None else f"{fidelity:.2f}",
            )

    @property
    def learning(self) -> bool:
        """Traffic is being pooled into an artifact (call :meth:`learn` between steps)."""
        return self._traffic is not None

    def caches_for(self, config: CacheConfig) -> list[Any]:
        """A request's caches for ``config``, with these filters where its method uses them."""
        from qfserve.engine.kv.factory import make_caches

        if self.ranks > 1 and config.evicts and config.budget_mode != "per_head":
            raise ConfigError(
                "budget_mode",
                f"budget_mode {config.budget_mode!r} shares rows across KV heads, which are split "
                f"over {self.ranks} ranks here (each holds only its own): send "
                "qfilters_budget_mode 'per_head'",
            )
        calibrated = config.method in ("qfilters", "kvzip")
        return make_caches(
            self.loaded.model,
            config,
            filters=self.filters if calibrated else None,
            query_scale=self.query_scale if config.method == "qfilters" else None,
            self_calibrate=self.source == "self",
            surrogate=self.kvzap if config.method == "kvzap" else None,
        )

    def shard(self, rank: int, size: int) -> None:
        """Keep rank ``rank`` of ``size``'s slice of the filters: the contiguous KV heads
        mlx-lm's ``shard`` leaves it (:mod:`qfserve.engine.models.sharding`). Nothing is pooled
        from traffic or prompts: each rank would learn its heads from its own slice of the
        queries, at its own time."""
        from qfserve.engine.models.sharding import ShardingError

        if self.self_calibration == "prompt":
            raise ShardingError(
                "self_calibration 'prompt' is not supported over several ranks: calibrate the "
                "model (qfserve calibrate) or use 'off'"
            )
        if self._traffic is not None:
            self._traffic.stop()
            self._traffic = None
            logger.warning(
                "over %d ranks Q-Filters are not learned from traffic: calibrate "
                "the model (qfserve calibrate) for them",
                size,
            )
        for name in ("filters", "query_scale"):
            full = getattr(self, name)
            if full is not None:
                per = full.shape[1] // size  # (L, H, D) or (L, H): heads on axis 1
                setattr(self, name, full[:, rank * per : (rank + 1) * per])
        self.ranks = size

    def learn(self) -> None:
        """Fold the sampled prompt queries in; once the artifact is written, switch to it.
        A failure is logged and stops the pooling, never the serving."""
        if self._traffic is None:
            return
        try:
            path = self._traffic.flush()
            if path is None:
                return
            from qfserve.engine.filters.artifact import resolve_calibration

            filters, scale, source = resolve_calibration(
                self.loaded.model, self.loaded.model_id, fingerprint=self.fingerprint
            )
        except Exception:  # noqa: BLE001 - learning must never stop serving
            logger.exception("learning Q-Filters from traffic failed; self-calibration goes on")
            self._traffic.stop()
            self._traffic = None
            return
        self._traffic = None
        if filters is not None:
            self.filters, self.query_scale, self.source = filters, scale, source
            logger.info(
                "Q-Filters for %s: calibrated from traffic (%s)", self.loaded.model_id, path
            )

    def _start_learning(self, samples: int | None, prompts: int | None) -> None:
        from qfserve.engine.filters.traffic import TrafficCalibration

        try:
            self._traffic = TrafficCalibration.for_model(
                self.loaded.model,
                model_id=self.loaded.model_id,
                fingerprint=self.fingerprint,
                samples_per_head=samples,
                min_prompts=prompts,
            )
        except ValueError as exc:  # the attention cannot be tapped: the key-SVD fallback
            logger.warning("no self-calibration for %s: %s", self.loaded.model_id, exc)
        else:
            self.source = "self" if self.self_calibration == "prompt" else "fallback"


def _surrogate(model_id: str, fingerprint: str) -> Any:
    """The model's KVzap surrogates from the registry, or ``None`` where it has none.

    Raises:
        qfserve.calibrations.kvzap.surrogate.SurrogateError: a file exists but must not be
            used (another model's weights, damaged): refused at start-up, naming the file.
    """
    from qfserve.calibrations.kvzap.surrogate import read_surrogate
    from qfserve.calibrations.registry import find_surrogate, model_id_for

    path = find_surrogate(model_id_for(model_id))
    return None if path is None else read_surrogate(path, fingerprint=fingerprint)
