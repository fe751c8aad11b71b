"""What the model thread builds before it serves: the model (split over the ranks when it was
launched over several), its filters, the kept caches and the scheduler. The worker calls these
on its own thread, in this order; nothing here runs on the event loop."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from qfserve.engine.filters.model import ModelFilters
from qfserve.engine.models.loading import LoadedModel, served_as
from qfserve.engine.serving.config import EngineConfig

if TYPE_CHECKING:
    from qfserve.engine.kv.config import Method
    from qfserve.engine.serving.lockstep import Lockstep
    from qfserve.engine.serving.scheduler import Scheduler
    from qfserve.engine.serving.turns import Turns

logger = logging.getLogger(__name__)


def load(
    config: EngineConfig,
    loader: Callable[[str | None], LoadedModel],
    max_kv_bytes: int,
    on_lost: Callable[[str], None],
) -> tuple[LoadedModel, ModelFilters, Lockstep | None]:
    """The served model, its filters and, launched over several ranks, its lockstep (the
    model and filters then split over them; ``on_lost`` is told when a rank dies)."""
    from qfserve.engine.kv.attention import set_blocked
    from qfserve.engine.models.quantized import kernel_of, set_decode_activations
    from qfserve.engine.serving.lockstep import Lockstep

    set_blocked(config.attention == "blocked")
    loaded = served_as(loader(config.model), config.alias, config.ctx_size)
    kernel = kernel_of(loaded.model)
    if kernel is not None:  # products on codes (the CPU); Metal keeps MLX's own kernels
        in_effect = set_decode_activations(kernel, config.decode_activations)
        if in_effect != config.decode_activations:
            logger.warning(
                "--decode-activations %s needs AVX-512 VNNI or AVX2, which this CPU lacks: %s",
                config.decode_activations,
                in_effect,
            )
        logger.info("decode steps' products on %s activations", in_effect)
    calibration = ModelFilters(
        loaded,
        self_calibration=config.self_calibration,
        traffic_samples=config.traffic_samples,
        traffic_prompts=config.traffic_prompts,
    )
    lockstep = Lockstep.join(
        loaded, calibration, max_kv_bytes, on_lost=on_lost, settings=decision_settings(config)
    )
    if lockstep is not None:
        try:
            check_split_defaults(config, lockstep.size)
        except Exception:
            if lockstep.watch is not None:  # every rank refuses: none of them is lost
                lockstep.watch.close()
            raise
    return loaded, calibration, lockstep


def pick_method(
    config: EngineConfig, calibration: ModelFilters, lockstep: Lockstep | None
) -> Method:
    """The method of requests that leave it to the server, said in the log: ``--kv-method``,
    or under ``auto`` KVzap where the model has surrogates and runs on one rank (its rows
    are shared across the KV heads that ranks split), else Q-Filters."""
    from qfserve.engine.kv.config import AUTO_METHOD, DEFAULT_METHOD, PICKED_METHOD

    if config.kv_method != AUTO_METHOD:
        return cast("Method", config.kv_method)
    if calibration.kvzap is None:
        why = "the model has no KVzap surrogates"
        picked = DEFAULT_METHOD
    elif lockstep is not None:
        why = f"kvzap shares rows across KV heads, split over {lockstep.size} ranks"
        picked = DEFAULT_METHOD
    else:
        why, picked = "the model has KVzap surrogates", PICKED_METHOD
    logger.info("--kv-method auto: requests that send no kv_method evict with %s (%s)", picked, why)
    return picked


def check_split_defaults(config: EngineConfig, ranks: int) -> None:
    """Refuse, at start-up, server defaults that share rows across KV heads: over several
    ranks each holds only its own heads, so every request that sent nothing would fail."""
    from qfserve.engine.kv.config import fit_budget_mode
    from qfserve.engine.models.sharding import ShardingError

    if config.budget_mode != "per_head":
        raise ShardingError(
            f"--budget-mode {config.budget_mode} shares rows across KV heads, which are split "
            f"over {ranks} ranks: serve with --budget-mode per_head"
        )
    mode = fit_budget_mode(config.budget_mode, config.kv_method)
    if mode != "per_head":  # the default method's own default mode
        raise ShardingError(
            f"--kv-method {config.kv_method} shares rows across layers and heads by default "
            f"(budget mode {mode}), which are split over {ranks} ranks: serve another default "
            f"method (requests may still send {config.kv_method} with budget mode "
            "'per_head')"
        )


# Read by rank 0 alone (the queue, the admin history, slow readers) or agreed on their own
# (the memory limit), or where a rank's files live: they may differ between ranks.
_RANK_LOCAL = ("model", "max_kv_bytes", "prompt_cache_dir", "max_queue", "history", "max_backlog")


def decision_settings(config: EngineConfig) -> str:
    """The engine settings every rank's decisions read, as text to compare between ranks."""
    fields = dataclasses.fields(EngineConfig)
    return repr([(f.name, getattr(config, f.name)) for f in fields if f.name not in _RANK_LOCAL])


def make_scheduler(
    loaded: LoadedModel,
    config: EngineConfig,
    turns: Turns | None,
    lockstep: Lockstep | None,
    max_batch: int,
) -> tuple[Scheduler, int]:
    """The scheduler (handing back turns to keep where ``turns`` keeps them), and the batch
    size it can run (1 where a batch cannot mask its members' padding per head)."""
    from qfserve.engine.serving.scheduler import Scheduler

    if max_batch > 1:
        from qfserve.engine.kv.attention import install_head_masks

        try:
            install_head_masks(loaded.model)
        except ValueError as exc:
            logger.warning("requests run one at a time: %s", exc)
            max_batch = 1
    scheduler = Scheduler(
        loaded,
        keeps=turns is not None,
        # Under lockstep a slow reader is cancelled between steps, on every rank at once.
        max_backlog=None if lockstep is not None else config.max_backlog,
        prefill_chunk=config.prefill_chunk,
    )
    return scheduler, max_batch
