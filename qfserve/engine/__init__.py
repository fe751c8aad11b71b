"""Generation on MLX with bounded KV caches.

Rooms (each imports only rooms below it): :mod:`.serving` owns the model thread and every
running request; :mod:`.text`, :mod:`.reuse` and :mod:`.filters` serve it; :mod:`.models`
loads what runs; :mod:`.kv` holds the caches, scorers and the eviction core.
"""
