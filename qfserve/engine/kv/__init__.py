"""The KV cache bounded by eviction: one cache class on mlx-lm's cache protocol, one eviction
core (:mod:`.evict`, :mod:`.slots`, :mod:`.adaptive`), small scorers (:mod:`.scorers`,
:mod:`.selfcal`, :mod:`.query_aware`, :mod:`.kvzip`), the request's cache configuration
(:mod:`.config`) and the factory that builds one cache per layer (:mod:`.factory`).
To add a scorer: implement :class:`.scorers.Scorer`, then name it in :mod:`.config` and
:mod:`.factory`.
"""
