"""parity: the same inputs through a reference implementation, one module per ``--against``:
``llama-cpp`` (``llama_parity.py``), ``kvpress`` (KVzip, ``kvzip_parity.py``) and
``kvpress-kvzap`` (KVzap, ``kvzap_parity.py``, the same comparison with ``method="kvzap"``)."""
