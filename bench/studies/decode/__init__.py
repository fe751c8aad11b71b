"""decode: the decode step, one module per ``--mode``: ``step`` (``decode.py``), ``batch``
and ``profile``."""
