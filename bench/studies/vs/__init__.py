"""vs: our server against llama.cpp's serving the same model, one module per ``--against``:
``llama-cpp`` (speed) and ``llama-cpp-memory`` (``memory.py``, resident memory)."""
