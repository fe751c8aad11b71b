"""Which layers of a model evict: the cache layout mlx-lm builds for it.

Full-attention layers (mlx-lm's plain ``KVCache``) grow with the sequence and are the ones
eviction bounds; sliding-window layers (``RotatingKVCache``: Gemma 3's five of every six)
keep their last ``window`` rows in mlx-lm's own cache and are never evicted; other caches
(recurrent state) hold no per-token rows. Memory at long context is the full layers', so
admission and statistics count each kind by what it holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

_ATTR = "_qfserve_layout"


@dataclass(frozen=True)
class Layout:
    """Per layer: ``None`` for full attention (evicts), the window for a sliding layer, ``0``
    for a layer that holds no per-token rows."""

    windows: tuple[int | None, ...]

    @property
    def full_layers(self) -> int:
        return sum(w is None for w in self.windows)

    @property
    def window_layers(self) -> int:
        return sum(bool(w) for w in self.windows)

    def window_rows(self, tokens: int) -> int:
        """Rows the sliding layers hold together after ``tokens`` positions."""
        return sum(min(w, tokens) for w in self.windows if w)


def layout(model: Any) -> Layout:
    """The layout of ``model``'s caches (from ``make_cache``, where the model has one; else
    every layer is full attention), remembered on the model."""
    found = getattr(model, _ATTR, None)
    if isinstance(found, Layout):
        return found
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    make = getattr(model, "make_cache", None)
    caches = make() if callable(make) else [KVCache() for _ in getattr(model, "layers", ())]
    windows: list[int | None] = []
    for cache in caches:
        if type(cache) is KVCache:
            windows.append(None)
        elif isinstance(cache, RotatingKVCache):
            windows.append(int(cache.max_size))
        else:
            windows.append(0)
    found = Layout(tuple(windows))
    with contextlib.suppress(AttributeError):  # one that takes none: computed again next time
        object.__setattr__(model, _ATTR, found)
    return found
