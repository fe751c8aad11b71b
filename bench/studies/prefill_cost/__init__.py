"""prefill-cost: what a prefill costs beyond a plain one, one module per ``--mode``: ``ttft``
(eviction), ``kvzip`` (the reconstruction pass) and ``kvzap`` (every row scored by the
surrogate, and its decode step)."""
