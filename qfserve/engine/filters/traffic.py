"""Q-Filters learned from traffic: pooled prompt queries become a regular artifact.

For a model without a calibration artifact, the query taps of :mod:`qfserve.engine.kv.selfcal` also
offer every prompt block's post-RoPE queries to one reservoir per layer, across requests:
calibration's own sampler (:class:`qfserve.calibrations.capture.Reservoir`, a uniform sample without
replacement of every query seen, the heads of a layer sharing positions). Once every layer
holds the artifact's default sample count and at least ``min_prompts`` prompts were seen
(calibration's default number of sequences, 20: without it the first long prompt alone would
set the filters, and a prompt's own queries are what lost the pass key in the
self-calibration studies), the filters are computed by
:mod:`qfserve.calibrations.compute`, as ``qfserve calibrate`` computes them, and saved as a regular
artifact in the user calibration folder, naming the model, its weights fingerprint and
"from traffic"; the worker then serves later requests with it (``filter_source``
``calibrated``) and the pooling stops.

The floor counts prompts; it does not bound one prompt's share. The sample stays uniform
over every query seen, as calibration's is, so one very long prompt among short ones still
supplies most of it, and a conversation resent without prompt reuse counts once per request.

What is kept: sampled query vectors (float32, ``samples_per_head x head_dim`` per query head
and layer) and their positions, in memory until the artifact is written; never prompt text
or token ids. ``--self-calibration off`` turns this off.

The reservoirs' candidates are lazy gathers of the sampled rows; :meth:`flush`, called
between scheduler steps, evaluates them (after a prefill chunk, never inside a decode step:
taps see prompt blocks only).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from qfserve.calibrations.artifact import save_calibration
from qfserve.calibrations.capture import DEFAULT_SAMPLES_PER_HEAD, Reservoir, offer_to
from qfserve.calibrations.compute import compute_filters, query_scales
from qfserve.calibrations.corpus import DEFAULT_SEQUENCES
from qfserve.calibrations.registry import artifact_name, default_output_dir
from qfserve.engine.kv.selfcal import QueryTap

logger = logging.getLogger(__name__)

DEFAULT_MIN_PROMPTS = DEFAULT_SEQUENCES  # prompts pooled at least before an artifact is written


class TrafficCalibration:
    """Pools one model's prompt queries until an artifact can be written (see module doc).

    Args:
        taps: The model's query taps, one per layer (:func:`qfserve.engine.kv.selfcal.install_query_taps`).
        n_kv_heads: KV heads per layer (the filters' GQA grouping).
        model_id: The id the artifact is registered under.
        fingerprint: The weights fingerprint it is bound to.
        samples_per_head: Queries per layer before the artifact is written (calibration's
            default).
        min_prompts: Prompts (first blocks seen) before the artifact is written.
        out_dir: Where it goes (default: calibration's output folder, on the search path).
        seed: Seed of the sampling.
    """

    def __init__(
        self,
        taps: list[QueryTap],
        *,
        n_kv_heads: int,
        model_id: str,
        fingerprint: str,
        samples_per_head: int = DEFAULT_SAMPLES_PER_HEAD,
        min_prompts: int = DEFAULT_MIN_PROMPTS,
        out_dir: Path | None = None,
        seed: int = 0,
    ) -> None:
        if samples_per_head < 1 or min_prompts < 1:
            raise ValueError(
                f"samples_per_head and min_prompts must be >= 1, got {samples_per_head}, "
                f"{min_prompts}"
            )
        self.taps = taps
        self.n_kv_heads = n_kv_heads
        self.model_id = model_id
        self.fingerprint = fingerprint
        self.samples_per_head = samples_per_head
        self.min_prompts = min_prompts
        self.out_dir = out_dir
        seeds = np.random.SeedSequence(seed).spawn(len(taps))
        self.reservoirs = [Reservoir(samples_per_head, np.random.default_rng(s)) for s in seeds]
        self.prompts = 0  # prompts whose first block was seen
        self.longest = 0  # tokens of the longest prompt seen
        for i, (tap, reservoir) in enumerate(zip(taps, self.reservoirs, strict=True)):
            tap.offer = self._offer(offer_to(reservoir), count=i == 0)

    def _offer(self, offer: Any, *, count: bool) -> Any:
        def take(queries: mx.array, offset: Any) -> None:
            offer(queries, offset)
            if count:  # once per block, from the first layer
                start = int(offset) if isinstance(offset, int) else int(np.max(np.array(offset)))
                self.prompts += start == 0
                self.longest = max(self.longest, start + queries.shape[2])

        return take

    @classmethod
    def for_model(
        cls,
        model: Any,
        *,
        model_id: str,
        fingerprint: str,
        samples_per_head: int | None = None,
        min_prompts: int | None = None,
    ) -> TrafficCalibration:
        """Tap ``model``'s queries and pool them (``None``: the defaults).

        Raises:
            ValueError: the model's attention has no standard blocks with a rope to tap.
        """
        from qfserve.calibrations.model_info import attention_shape
        from qfserve.engine.kv.selfcal import install_query_taps

        _, n_kv_heads, _ = attention_shape(model)
        return cls(
            install_query_taps(model),
            n_kv_heads=n_kv_heads,
            model_id=model_id,
            fingerprint=fingerprint,
            samples_per_head=(
                DEFAULT_SAMPLES_PER_HEAD if samples_per_head is None else samples_per_head
            ),
            min_prompts=DEFAULT_MIN_PROMPTS if min_prompts is None else min_prompts,
        )

    @property
    def tokens_seen(self) -> int:
        return min(r.tokens_seen for r in self.reservoirs)

    def flush(self) -> Path | None:
        """Fold the pending samples in; once every layer has enough, from enough prompts,
        write the artifact, stop pooling and return its path."""
        pending = [a for r in self.reservoirs for a in r.pending_arrays()]
        if not pending:
            return None
        mx.eval(pending)
        for reservoir in self.reservoirs:
            reservoir.merge()
        if self.tokens_seen < self.samples_per_head or self.prompts < self.min_prompts:
            return None
        return self._write()

    def stop(self) -> None:
        """Stop pooling (the taps keep serving self-calibration)."""
        for tap in self.taps:
            tap.offer = None

    def _write(self) -> Path:
        self.stop()
        queries = [r.queries for r in self.reservoirs]
        assert all(q is not None for q in queries)
        filters, summaries = compute_filters(queries, self.n_kv_heads)  # type: ignore[arg-type]
        out = self.out_dir if self.out_dir is not None else default_output_dir()
        path = save_calibration(
            out / artifact_name(self.model_id),
            filters,
            model_id=self.model_id,
            n_sequences=self.prompts,
            tokens_per_sequence=self.longest,
            samples_per_head=self.samples_per_head,
            text=(
                f"from traffic: post-RoPE queries sampled from {self.prompts} prompts "
                f"({self.tokens_seen} tokens) served by qfserve; no text was kept"
            ),
            anisotropy=summaries,
            weights=self.fingerprint,
            query_scale=query_scales(queries, filters),  # type: ignore[arg-type]
        )
        self.reservoirs = []
        logger.info("Q-Filters for %s learned from traffic: wrote %s", self.model_id, path)
        return path
