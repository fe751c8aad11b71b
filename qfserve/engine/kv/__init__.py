"""The KV cache bounded by eviction: one cache class on mlx-lm's cache protocol, one eviction
core (:mod:`.evict`, :mod:`.slots`, :mod:`.adaptive`), small scorers (:mod:`.scorers`,
:mod:`.selfcal`, :mod:`.query_aware`, :mod:`.kvzip`), the request's cache configuration
(:mod:`.config`), the factory that builds one cache per layer (:mod:`.factory`), what a
request's caches can hold in bytes (:mod:`.memory`), the per-request policy through which a
method asks serving for more than a score (:mod:`.methods`), and a decode batch's caches
(:mod:`.batch`). Serving reaches this room through those last four and :mod:`.config` alone
(an import contract checks it). To add a scorer: implement :class:`.scorers.Scorer`, then
name it in :mod:`.config` and :mod:`.factory`; a method that needs more adds a
:class:`.methods.Policy`.
"""
