"""Context-reconstruction scoring (KVzip, Kim et al., arXiv 2505.23416) on the eviction core.

Query-agnostic scorers (Q-Filters, K-norm) guess from a key alone what later queries will
read; a fact stated once in prose is easy to lose that way. KVzip asks the model instead:
after the context is read, the model is teacher-forced on ``"Repeat the previous context
exactly."`` followed by the context itself, and a stored key's score is the most attention
it receives from any reconstruction query of its KV group. A key the model needs to say the
context again is a key a later question can need, whatever that question is, so a cache kept
this way answers questions it was compressed without.

The pass (:class:`Reconstruction`), as kvpress's ``KVzipPress`` runs it: the context's tokens
are cut into chunks of :data:`DEFAULT_CHUNK`; chunk ``i`` is reconstructed on its own after
:data:`REPEAT_FIRST` (later chunks: :data:`REPEAT_NEXT` and the previous chunk's last
:data:`PREV_TAIL` tokens), then the chat template's assistant opening. Each reconstruction
query's softmax runs over the sinks, the stored rows of its chunk and the reconstruction's own
keys (causal); scores are the max over queries and the group's query heads. The pass's own
keys and values live in a per-layer view (:class:`_ReconstructionView`) and are dropped, so
peak memory is the stored rows plus one chunk; RoPE positions continue after the context,
and the kept rows keep the rotation they were stored with.

Where it sits: a :class:`KVzipScorer` makes its :class:`qfserve.engine.kv.cache.EvictionCache` store
prompt blocks whole (:meth:`KVzipScorer.defers`); :func:`compress` (or the scheduler, chunk by chunk)
runs the pass and hands each cache its scores (:meth:`EvictionCache.compress`), which the
shared core turns into ``budget`` rows per head or a layer budget shared across heads.
Generated rows are ranked by the request's Q-Filters (calibrated filters, else K-norm)
mapped below every context row (:func:`generated_tier`), so the decode step keeps its
O(budget) single-row eviction: the rows KVzip chose stay, generated rows beyond the recent
window go first.
"""

from qfserve.calibrations.repeat import PREV_TAIL, REPEAT_FIRST, REPEAT_NEXT, RepeatPrompt
from qfserve.engine.kv.kvzip.reconstruction import Reconstruction, compress, settle
from qfserve.engine.kv.kvzip.scorer import (
    DEFAULT_BLOCK,
    DEFAULT_CHUNK,
    REPEAT_ROWS,
    KVzipScorer,
    beyond_keep,
    generated_tier,
    hold,
    holding,
    needs_pass,
    over_limit,
    set_limit,
)
from qfserve.engine.kv.kvzip.shares import evict, layer_budgets

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_CHUNK",
    "PREV_TAIL",
    "REPEAT_FIRST",
    "REPEAT_NEXT",
    "REPEAT_ROWS",
    "KVzipScorer",
    "Reconstruction",
    "RepeatPrompt",
    "beyond_keep",
    "compress",
    "evict",
    "generated_tier",
    "hold",
    "holding",
    "layer_budgets",
    "needs_pass",
    "over_limit",
    "set_limit",
    "settle",
]
