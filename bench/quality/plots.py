"""Matplotlib on the Agg backend (no display needed), and one way to save a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "full": "black",
    "qfilters": "tab:blue",
    "self": "tab:purple",
    "traffic": "tab:pink",
    "traffic/passkey": "tab:gray",
    "snapkv": "tab:olive",
    "tova": "tab:cyan",
    "kvzip": "darkgoldenrod",
    "fallback": "tab:orange",
    "knorm": "tab:green",
    "streaming": "tab:red",
    "recency": "tab:red",
    "fallback+": "tab:orange",
    "fallback-": "tab:brown",
}


def color(method: str, variant: str = "") -> str:
    """An arm's colour: its variant's (``traffic/passkey``) where it has one, else its
    method's."""
    return COLORS.get(f"{method}/{variant}", COLORS[method])


def subplots(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    kwargs.setdefault("figsize", (5.0 * ncols, 3.6 * nrows))
    kwargs.setdefault("squeeze", False)
    return plt.subplots(nrows, ncols, **kwargs)


def save(fig: Any, out_dir: Path, name: str, title: str = "") -> Path:
    """Save ``fig`` as ``<out_dir>/<name>.png`` and close it."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
