"""How many prompt tokens a prefill step reads: a chunk that costs what ``prefill_chunk``
tokens cost at the start of a prompt, however long the prompt has grown.

Decoding streams wait for each chunk of a joining prompt (:mod:`.scheduler`), so a chunk's
time is their longest gap. A chunk's cost is its products, the same for every token, plus its
attention to the rows its caches already hold, which grows with the prompt (by the count
below, a SmolLM2 token at 7,500 rows of context costs about 3.4x one at the start). A chunk
therefore reads fewer tokens the more rows its caches hold::

    n = prefill_chunk * P / (P + sum_l a_l * rows_l)

with ``P`` the multiply-adds of a token's products summed over the layers (the attention's
projections and a gated MLP, from the model's config) and ``a_l = 2 * heads * head_dim`` the
multiply-adds a token spends on each row layer ``l`` holds (its score and its value). A
sliding-window layer holds its window at most and an evicting one its budget, so the chunk
shrinks only where attention does grow. The rule reads nothing but the request's own caches,
so a prompt is cut the same way alone and in a batch, and on every rank of a lockstep group
(the config, not a rank's shard, gives the sizes).

Why a model of the cost and not a clock: a measured time would cut the same prompt
differently from one run to the next, and an eviction cache's kept rows depend on where its
prompt is cut.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# The fewest tokens a chunk reads (or all that are left): below it a chunk's fixed costs
# (dispatch, the eviction step) would outweigh what it saves the decoding streams.
MIN_CHUNK = 64


@dataclass(frozen=True)
class ChunkCost:
    """A model's prefill cost per token, as the multiply-adds of its products (``per_token``)
    and of its attention to each row a layer holds (``per_row``, one entry a layer)."""

    per_token: float
    per_row: tuple[float, ...]

    @classmethod
    def of(cls, loaded: Any) -> ChunkCost:
        """The model's costs from its config; where the config lacks the sizes, no cost a
        row (every chunk then reads ``prefill_chunk`` tokens)."""
        args = getattr(loaded.model, "args", None)

        def size(name: str) -> int | None:
            value = getattr(args, name, None) if args is not None else None
            if value is None:
                value = loaded.config.get(name)
            return None if value is None else int(value)

        hidden, heads = size("hidden_size"), size("num_attention_heads")
        inter, layers = size("intermediate_size"), size("num_hidden_layers")
        if not (hidden and heads and inter and layers):
            return cls(1.0, ())
        kv_heads = size("num_key_value_heads") or heads
        head_dim = size("head_dim") or hidden // heads
        # q and o: heads * head_dim each way; k and v: kv_heads * head_dim; gate, up, down.
        per_layer = hidden * head_dim * 2 * (heads + kv_heads) + 3 * hidden * inter
        return cls(float(per_layer * layers), (2.0 * heads * head_dim,) * layers)

    def weight(self, caches: list[Any]) -> float:
        """A token's cost on ``caches`` as a multiple of its cost on empty ones (>= 1)."""
        held = sum(a * c.size() for a, c in zip(self.per_row, caches, strict=False))
        return 1.0 + held / self.per_token


def chunk_limit(weight: float, left: float, full: int) -> int:
    """The prompt tokens a step may read at ``weight`` (:meth:`ChunkCost.weight`) with
    ``left`` of its ``full`` tokens' cost unspent (a step starts with ``left == full``; the
    first chunk of a step reads at least :data:`MIN_CHUNK`)."""
    limit = int(left / weight)
    return max(limit, min(full, MIN_CHUNK)) if left >= full else limit


def chunks_alone(cost: ChunkCost, caches: list[Any], todo: int, full: int) -> Iterator[int]:
    """The chunks a prompt of ``todo`` tokens (its last one left out: it starts the
    decoding) is read in by the scheduler when it is alone, for code that reads a prompt as
    the server does; the caller reads each chunk into ``caches`` before asking for the next.
    As the scheduler, it leaves no one-token chunk."""
    while todo > 0:
        n = min(chunk_limit(cost.weight(caches), full, full), todo)
        n = todo if todo - n == 1 else n
        yield n
        todo -= n
