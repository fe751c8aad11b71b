"""One layer's caches of a decode batch: every request keeps its own cache, stepped together.

:class:`BatchCache` (:mod:`.cache`) is what mlx-lm's ``GenerationBatch`` drives: it lets each
member update and evict exactly as it would alone, or, while every member is a cache whose
decode step it knows, holds their rows in one set of arrays (:class:`PackedBatch`,
:mod:`.packed`) and steps them with the same few operations whatever the batch's size. While
packed, a member's arrays are :class:`Lent` placeholders (:mod:`.lent`). Serving builds a
batch cache around a request's caches and asks it nothing else: the members' fields are
written here and in the cache classes alone.
"""

from qfserve.engine.kv.batch.cache import BatchCache
from qfserve.engine.kv.batch.lent import Lent
from qfserve.engine.kv.batch.packed import PackedBatch, can_pack

__all__ = ["BatchCache", "Lent", "PackedBatch", "can_pack"]
