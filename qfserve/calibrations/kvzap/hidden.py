"""A tap on each layer's input norm: the hidden state that enters the attention, as the layer
computes it (KVzap's surrogate input, and the norm KVzip+ divides a query's attention by).

mlx-lm's blocks call ``self.self_attn(self.input_layernorm(x), ...)``, and the norm's output is
what a key is written from. The tap changes the norm module's class to a subclass whose call
returns the same result and keeps it (the module keeps its parameters and their names, so
weights, fingerprints and sharding are unchanged); :func:`remove_hidden_taps` puts the class
back. A fused decode block (:mod:`qfserve.engine.models.fused`) computes the norm natively and
calls the tapped module for the kept value.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

HIDDEN_TAP = "_qfserve_hidden_tap"  # the attribute a tapped norm keeps its tap in
_MARK = HIDDEN_TAP
_CLASSES: dict[type, type] = {}


class HiddenTap:
    """The last block of hidden states one layer's input norm computed, for its caches'
    scorers. Like a query tap: a batch narrows it to one member's row (:meth:`narrow`)."""

    def __init__(self) -> None:
        self.batch: mx.array | None = None  # (B, N, hidden): what the norm last returned
        self.hidden: mx.array | None = None  # (1, N, hidden): what a scorer may take

    def __call__(self, hidden: mx.array) -> None:
        self.batch = hidden
        self.hidden = hidden if hidden.shape[0] == 1 else None

    def __deepcopy__(self, memo: dict[int, Any]) -> HiddenTap:
        return self  # belongs to its layer's norm, not to a cache (a kept cache is a copy)

    def narrow(self, row: int) -> None:
        """Offer only row ``row`` of the last batch (the member about to update)."""
        self.hidden = None if self.batch is None else self.batch[row : row + 1]

    def take(self, n: int) -> mx.array | None:
        """The block's hidden states if the last block had ``n`` tokens, then forget them."""
        h, self.hidden = self.hidden, None
        return h if h is not None and h.shape[1] == n else None


def _tapped(base: type) -> type:
    if base not in _CLASSES:

        def __call__(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
            out = base.__call__(self, x, *args, **kwargs)
            getattr(self, _MARK)(out)
            return out

        body = {"__call__": __call__, "__module__": base.__module__, "_qfserve_untapped": base}
        _CLASSES[base] = type(f"Tapped{base.__name__}", (base,), body)
    return _CLASSES[base]


def layers_of(model: nn.Module) -> list[Any]:
    """The model's transformer blocks (``model.layers``, else ``model.model.layers``)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        raise ValueError(f"{type(model).__name__} does not expose its blocks as `layers`")
    return list(layers)


def install_hidden_taps(model: nn.Module) -> list[HiddenTap]:
    """One :class:`HiddenTap` per layer, on its ``input_layernorm`` (idempotent).

    Raises:
        ValueError: a layer has no ``input_layernorm``.
    """
    taps = []
    for i, layer in enumerate(layers_of(model)):
        norm = getattr(layer, "input_layernorm", None)
        if norm is None:
            raise ValueError(f"layer {i}: {type(layer).__name__} has no `input_layernorm`")
        tap = getattr(norm, _MARK, None)
        if tap is None:
            tap = HiddenTap()
            norm.__class__ = _tapped(type(norm))
            object.__setattr__(norm, _MARK, tap)
        taps.append(tap)
    return taps


def hidden_tap(norm: Any) -> HiddenTap | None:
    """The tap on a layer's input norm, if any."""
    tap = getattr(norm, _MARK, None)
    return tap if isinstance(tap, HiddenTap) else None


def remove_hidden_taps(model: nn.Module) -> None:
    """Give every layer's input norm its own class back."""
    for layer in layers_of(model):
        norm = getattr(layer, "input_layernorm", None)
        base = getattr(type(norm), "_qfserve_untapped", None)
        if base is not None:
            norm.__class__ = base
            object.__delattr__(norm, _MARK)
