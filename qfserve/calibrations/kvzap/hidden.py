"""A tap on each layer's input norm: the hidden state that enters the attention, as the layer
computes it (KVzap's surrogate input, and the norm KVzip+ divides a query's attention by).

mlx-lm's blocks call ``self.self_attn(self.input_layernorm(x), ...)``, and the norm's output is
what a key is written from. The tap changes the norm module's class to a subclass whose call
returns the same result and keeps it (the module keeps its parameters and their names, so
weights, fingerprints and sharding are unchanged); :func:`remove_hidden_taps` puts the class
back. A fused decode block (:mod:`qfserve.engine.models.fused`) computes the norm natively and
gives the tap its input and the norm's weight (:meth:`HiddenTap.defer`).
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
    scorers. Like a query tap: a batch narrows it to one member's row (:meth:`narrow`).

    A fused decode block keeps its input before the norm (:meth:`defer`): the norm is then
    computed where a scorer takes the row (:meth:`take`), or by the eviction step itself from
    the raw row (:meth:`peek_raw`), one MLX op fewer a layer."""

    def __init__(self) -> None:
        self.batch: mx.array | None = None  # (B, N, hidden): what the norm last returned
        self.hidden: mx.array | None = None  # (1, N, hidden): what a scorer may take
        self.norm: tuple[mx.array, float] | None = None  # deferred: the norm's weight, eps

    def __call__(self, hidden: mx.array) -> None:
        self.batch, self.norm = hidden, None
        self.hidden = hidden if hidden.shape[0] == 1 else None

    def defer(self, x: mx.array, weight: mx.array, eps: float) -> None:
        """Keep ``x``, the block's input, and the norm (``weight``, ``eps``: RMS) that maps
        it to the hidden states, computed only where they are taken."""
        self.batch, self.norm = x, (weight, eps)
        self.hidden = x if x.shape[0] == 1 else None

    def __deepcopy__(self, memo: dict[int, Any]) -> HiddenTap:
        return self  # belongs to its layer's norm, not to a cache (a kept cache is a copy)

    def narrow(self, row: int) -> None:
        """Offer only row ``row`` of the last batch (the member about to update)."""
        self.hidden = None if self.batch is None else self.batch[row : row + 1]

    def take(self, n: int) -> mx.array | None:
        """The block's hidden states if the last block had ``n`` tokens, then forget them."""
        h, self.hidden = self.hidden, None
        if h is None or h.shape[1] != n:
            return None
        return h if self.norm is None else mx.fast.rms_norm(h, *self.norm)

    def peek_raw(self) -> tuple[mx.array, mx.array, float] | None:
        """A deferred decode row ``(x (1, 1, hidden), weight, eps)``, where the last block
        kept one; it stays offered until the next block replaces it."""
        h = self.hidden
        if h is None or self.norm is None or h.shape[1] != 1:
            return None
        return h, *self.norm


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
