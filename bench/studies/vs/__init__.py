"""vs: our server against another way of serving the same model, one module per ``--against``:
``mlx-lm``, ``llama-cpp``, ``llama-cpp-memory`` (``memory.py``), ``in-process`` (``server_overhead.py``)."""
