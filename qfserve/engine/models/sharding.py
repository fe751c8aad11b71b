"""Tensor parallelism over an ``mx.distributed`` group, through mlx-lm's own ``shard``.

mlx-lm's models split each attention's heads and each MLP's hidden units evenly over the
group (``model.shard(group)``: ``all-to-sharded`` projections in, ``sharded-to-all`` out, so
every rank ends a layer with the whole hidden state). Rank ``r`` of ``N`` then holds the
contiguous KV heads ``[r*H/N, (r+1)*H/N)`` and its eviction caches hold only those; the
calibrated filters are sliced the same way (:meth:`qfserve.engine.filters.model.ModelFilters.shard`).
"""

from __future__ import annotations

from typing import Any

from qfserve.engine.models.loading import LoadedModel


class ShardingError(ValueError):
    """The model cannot be split over the group (a start-up error, never a wrong answer)."""


def _field(loaded: LoadedModel, name: str) -> int | None:
    args = getattr(loaded.model, "args", None)
    value = getattr(args, name, None) if args is not None else None
    if value is None:
        value = loaded.config.get(name)
    return None if value is None else int(value)


def check_shardable(loaded: LoadedModel, size: int) -> None:
    """Raises :class:`ShardingError` unless ``loaded`` splits evenly over ``size`` ranks."""
    if not hasattr(loaded.model, "shard"):
        raise ShardingError(
            f"{loaded.name}: its mlx-lm model class has no shard(group), so it cannot be served "
            f"over {size} ranks (tensor parallelism); serve it on one"
        )
    heads = _field(loaded, "num_attention_heads")
    kv_heads = _field(loaded, "num_key_value_heads") or heads
    hidden = _field(loaded, "intermediate_size")
    for what, n in (("attention heads", heads), ("KV heads", kv_heads), ("MLP units", hidden)):
        if n is not None and n % size:
            raise ShardingError(
                f"{loaded.name} has {n} {what}, which do not split evenly over {size} ranks: "
                f"serve it on a number of ranks that divides {n}"
            )


def shard(loaded: LoadedModel, group: Any) -> None:
    """Split ``loaded.model`` over ``group`` in place (every rank calls this)."""
    import mlx.core as mx

    from qfserve.engine.models.quantized import densify, detach

    check_shardable(loaded, group.size())
    detach(loaded.model)  # sharding rewrites the projections the native layers hold
    densify(loaded.model)  # ranks run MLX's float32 products (the fast ones it has)
    loaded.model.shard(group)
    mx.eval(loaded.model.parameters())
