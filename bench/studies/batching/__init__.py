"""batching: many users at once, one module per ``--load``: ``burst`` (``batching.py``: streams
sent together, 1-16 at a time) and ``open`` (``open_load.py``: requests arriving by a Poisson
process at several rates)."""
