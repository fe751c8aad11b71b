"""prefill-cost: what a prefill costs beyond a plain one, one module per ``--mode``: ``ttft``
(eviction), ``selfcal`` (self-calibration) and ``kvzip`` (the reconstruction pass)."""
