"""KVzap's surrogates: per layer, the log KVzip+ score of each KV head from a key's hidden state.

Two forms, as kvpress's KVzap training script does: ``linear`` (``x W + b``, fitted by
ridge regression in closed form, kvpress's ``Ridge()`` with ``alpha = 1``) and ``mlp``
(``gelu(x W1 + b1) W2 + b2``, hidden 512, exact GELU; trained by AdamW on the mean squared
error, :func:`train_mlp`). Layers that do not evict (sliding windows) hold zeros and are marked
off in ``layers``.

The artifact is a safetensors file with the stacked weights and metadata (format version,
form, model id, weights fingerprint, fidelity on held-out text); :func:`read_surrogate` refuses
a file that is not one, naming it and the reason.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from qfserve.calibrations.artifact import CalibrationError

FORMAT = "qfserve-kvzap"
VERSION = 1
FORMS = ("linear", "mlp")
MLP_HIDDEN = 512  # kvpress's default
RIDGE_ALPHA = 1.0  # sklearn's Ridge() default, which kvpress uses


class SurrogateError(CalibrationError):
    """A surrogate file that cannot be used; the message names the file (refused at start-up
    as a damaged calibration is)."""

    def __init__(self, path: str | Path, reason: str):
        self.path = Path(path)
        ValueError.__init__(self, f"KVzap surrogate file {self.path}: {reason}")


@dataclass
class Surrogate:
    """The surrogates of every layer of one model.

    Args:
        form: ``linear`` or ``mlp``.
        weights: Stacked over layers: ``w`` ``(L, D, H)`` and ``b`` ``(L, H)`` (linear), or
            ``w1`` ``(L, D, M)``, ``b1`` ``(L, M)``, ``w2`` ``(L, M, H)``, ``b2`` ``(L, H)``.
        layers: Which layers have a surrogate (the ones that evict).
        model_id: The model they were trained on; ``fingerprint`` its weights'.
        fidelity: What training measured on held-out text (reported, stored in the file).
    """

    form: str
    weights: dict[str, np.ndarray]
    layers: list[bool]
    model_id: str = ""
    fingerprint: str = ""
    fidelity: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {self.form!r}")
        names = ("w", "b") if self.form == "linear" else ("w1", "b1", "w2", "b2")
        if set(self.weights) != set(names):
            raise ValueError(f"a {self.form} surrogate holds {names}, got {sorted(self.weights)}")
        n = {len(self.layers)} | {w.shape[0] for w in self.weights.values()}
        if len(n) != 1:
            raise ValueError(f"layers disagree: {sorted(n)}")
        self._mx: dict[str, mx.array] | None = None

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_kv_heads(self) -> int:
        return int(self.weights["b" if self.form == "linear" else "b2"].shape[1])

    @property
    def hidden_size(self) -> int:
        return int(self.weights["w" if self.form == "linear" else "w1"].shape[1])

    @property
    def nbytes(self) -> int:
        return int(sum(w.nbytes for w in self.weights.values()))

    def arrays(self) -> dict[str, mx.array]:
        """The weights as float32 MLX arrays (made once)."""
        if self._mx is None:
            self._mx = {k: mx.array(v, dtype=mx.float32) for k, v in self.weights.items()}
        return self._mx

    def layer(self, i: int) -> tuple[mx.array, ...]:
        """Layer ``i``'s weights, in the order :func:`forward` takes them."""
        a = self.arrays()
        names = ("w", "b") if self.form == "linear" else ("w1", "b1", "w2", "b2")
        return tuple(a[k][i] for k in names)

    def predict(self, i: int, hidden: np.ndarray) -> np.ndarray:
        """Layer ``i``'s predictions ``(N, H)`` for ``hidden`` ``(N, D)``, in numpy."""
        return np.array(forward(mx.array(hidden, dtype=mx.float32), self.layer(i)))


def forward(x: mx.array, weights: Sequence[mx.array]) -> mx.array:
    """``(..., D) -> (..., H)``: a linear surrogate (``w``, ``b``) or an MLP (``w1``, ``b1``,
    ``w2``, ``b2``)."""
    if len(weights) == 2:
        w, b = weights
        return mx.addmm(b, x, w)  # one op: a decode step runs this once a layer
    w1, b1, w2, b2 = weights
    return mx.addmm(b2, nn.gelu(mx.addmm(b1, x, w1)), w2)


class RidgeSums:
    """Sufficient statistics of one layer's ridge regression, accumulated text by text (so no
    text's hidden states need to be kept)."""

    def __init__(self, d: int, h: int) -> None:
        self.n = 0
        self.sx = np.zeros(d)
        self.sy = np.zeros(h)
        self.xx = np.zeros((d, d))
        self.xy = np.zeros((d, h))

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        self.n += len(x64)
        self.sx += x64.sum(axis=0)
        self.sy += y64.sum(axis=0)
        self.xx += x64.T @ x64
        self.xy += x64.T @ y64

    def solve(self, alpha: float = RIDGE_ALPHA) -> tuple[np.ndarray, np.ndarray]:
        """``(w (D, H), b (H,))`` minimising ``|y - x w - b|^2 + alpha |w|^2`` (intercept not
        penalised: the centred problem)."""
        mx_, my = self.sx / self.n, self.sy / self.n
        xx = self.xx - self.n * np.outer(mx_, mx_)
        xy = self.xy - self.n * np.outer(mx_, my)
        w = np.linalg.solve(xx + alpha * np.eye(len(mx_)), xy)
        return w.astype(np.float32), (my - mx_ @ w).astype(np.float32)


def train_mlp(
    x: np.ndarray,
    y: np.ndarray,
    *,
    hidden: int = MLP_HIDDEN,
    epochs: int = 15,
    batch: int = 512,
    lr: float = 5e-3,
    weight_decay: float = 0.01,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Every layer's MLP at once, on rows ``x`` ``(N, L, D)`` and targets ``y`` ``(N, L, H)``:
    mean squared error over layers and heads, AdamW with a cosine schedule over the epochs,
    gradients clipped to norm 1 (kvpress's recipe)."""
    n, L, D = x.shape
    H = y.shape[2]
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    scale1, scale2 = 1 / math.sqrt(D), 1 / math.sqrt(hidden)
    params = {
        "w1": mx.random.uniform(-scale1, scale1, (L, D, hidden)),
        "b1": mx.zeros((L, hidden)),
        "w2": mx.random.uniform(-scale2, scale2, (L, hidden, H)),
        "b2": mx.array(y.mean(axis=0), dtype=mx.float32),
    }
    steps = epochs * max(1, -(-n // batch))
    schedule = optim.cosine_decay(lr, steps)
    opt = optim.AdamW(learning_rate=schedule, weight_decay=weight_decay)

    def loss(p: dict[str, mx.array], xb: mx.array, yb: mx.array) -> mx.array:
        xl = xb.transpose(1, 0, 2)  # (L, B, D)
        h = nn.gelu(xl @ p["w1"] + p["b1"][:, None]) @ p["w2"] + p["b2"][:, None]
        return mx.mean(mx.square(h - yb.transpose(1, 0, 2)))

    grad = mx.value_and_grad(loss)
    for _ in range(epochs):
        order = rng.permutation(n)
        for start in range(0, n, batch):
            idx = order[start : start + batch]
            xb = mx.array(x[idx], dtype=mx.float32)
            yb = mx.array(y[idx], dtype=mx.float32)
            _, g = grad(params, xb, yb)
            g, _ = optim.clip_grad_norm(g, 1.0)
            opt.update(params, g)  # type: ignore[arg-type]  # a dict tree, updated in place
            mx.eval(params, opt.state)
    return {k: np.array(v) for k, v in params.items()}


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two equal-length vectors (ties ranked by order: the
    scores are continuous)."""
    ra = np.empty(len(a))
    rb = np.empty(len(b))
    ra[np.argsort(a, kind="stable")] = np.arange(len(a))
    rb[np.argsort(b, kind="stable")] = np.arange(len(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def save_surrogate(path: str | Path, surrogate: Surrogate) -> Path:
    """Write ``surrogate`` to ``path`` (safetensors, metadata as text)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "form": surrogate.form,
        "model_id": surrogate.model_id,
        "fingerprint": surrogate.fingerprint,
        "layers": json.dumps(surrogate.layers),
        "fidelity": json.dumps(surrogate.fidelity),
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in surrogate.weights.items()}, tmp, meta)
    tmp.replace(path)  # never a half-written file under the real name
    return path


def read_surrogate(path: str | Path, *, fingerprint: str | None = None) -> Surrogate:
    """Read a surrogate file; ``fingerprint``: the served weights' (a mismatch is refused).

    Raises:
        SurrogateError: not a surrogate file, corrupt, or for other weights (names the file).
    """
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    except Exception as exc:  # noqa: BLE001 - any unreadable file is refused the same way
        raise SurrogateError(path, f"not a readable safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise SurrogateError(path, f"not a KVzap surrogate file (format {meta.get('format')!r})")
    if meta.get("version") != str(VERSION):
        raise SurrogateError(path, f"format version {meta.get('version')}, expected {VERSION}")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise SurrogateError(path, "trained for other weights (the fingerprint differs)")
    try:
        layers = [bool(v) for v in json.loads(meta["layers"])]
        fidelity = json.loads(meta.get("fidelity") or "{}")
        surrogate = Surrogate(
            meta["form"],
            weights,
            layers,
            meta.get("model_id", ""),
            meta.get("fingerprint", ""),
            fidelity,
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise SurrogateError(path, f"malformed surrogate ({exc})") from None
    if any(not np.isfinite(w).all() for w in weights.values()):
        raise SurrogateError(path, "weights hold NaN or infinity")
    return surrogate
