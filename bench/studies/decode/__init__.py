"""decode: the decode step, one module per ``--mode``: ``step`` (``decode.py``), ``batch``,
``refine``, ``profile``, ``bandwidth`` and ``activations``."""
