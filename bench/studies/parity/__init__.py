"""parity: the same inputs through a reference implementation, one module per ``--against``:
``llama-cpp`` (``llama_parity.py``) and ``kvpress`` (``kvzip_parity.py``)."""
