"""The plots every study draws: colours per arm, medians with their interquartile range
against context length or grouped as bars, saved as PNG beside the JSON."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

COLORS = {
    "full": "black",
    "qfilters": "tab:blue",
    "snapkv": "tab:olive",
    "tova": "tab:cyan",
    "kvzip": "darkgoldenrod",
    "kvzap": "teal",
    "fallback": "tab:orange",
    "knorm": "tab:green",
    "streaming": "tab:red",
    "fallback-": "tab:brown",
}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def subplots(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """A figure of ``nrows x ncols`` panels, always as a 2-D array of axes."""
    kwargs.setdefault("figsize", (5.0 * ncols, 3.6 * nrows))
    kwargs.setdefault("squeeze", False)
    return pyplot().subplots(nrows, ncols, **kwargs)


def save_plot(fig: Any, out: Path, name: str, title: str = "") -> str:
    """Save ``fig`` as ``<out>/<name>.png``, close it and return the file's name."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / f"{name}.png", dpi=110)
    pyplot().close(fig)
    return f"{name}.png"


def log2_axis(ax: Any, ticks: Sequence[int], *, logy: bool = False) -> None:
    """Log-2 x axis labelled only at ``ticks`` (no minor-tick clutter); optionally log y."""
    from matplotlib.ticker import NullLocator, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ticks), [str(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    if logy:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())


def errorbars(stats: Sequence[dict[str, float]], scale: float = 1.0) -> tuple[list, list]:
    """Medians and the interquartile range, times ``scale``, as matplotlib's asymmetric
    ``yerr``."""
    med = [s["median"] * scale for s in stats]
    low = [m - s["q1"] * scale for m, s in zip(med, stats, strict=True)]
    return med, [low, [s["q3"] * scale - m for m, s in zip(med, stats, strict=True)]]


def context_plot(
    out: Path,
    name: str,
    x: Sequence[int],
    series: dict[str, list[dict[str, float]]],
    trained: int,
    scale: float = 1.0,
    logy: bool = False,
    **labels: str,
) -> str:
    """Each series' medians (times ``scale``) with their IQR against the context lengths ``x``
    on a log-2 axis, the model's ``trained`` context marked; ``labels``: the axes'."""
    fig, [[ax]] = subplots(figsize=(6.4, 4))
    for label, stats in series.items():
        med, err = errorbars(stats, scale)
        ax.errorbar(x, med, yerr=err, marker="o", capsize=3, label=label)
    ax.axvline(trained, color="grey", ls=":", label=f"trained context {trained}")
    ax.set(**labels)
    log2_axis(ax, x, logy=logy)
    ax.legend()
    return save_plot(fig, out, name)


def grouped_bars(
    ax: Any,
    groups: list[str],
    stats: list[dict[str, Any]],
    title: str,
    scale: float = 1.0,
    style: Callable[[str], dict[str, Any]] | None = None,
) -> None:
    """Per group (an x tick), one bar per key of ``stats[group]``: a :func:`summary`'s median
    (times ``scale``) with its IQR, or a plain value; ``style(key)``: the bar's options."""
    keys = list(stats[0])
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        values = [s[key] for s in stats]
        med, err = errorbars(values, scale) if isinstance(values[0], dict) else (values, None)
        x = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(x, med, width, yerr=err, capsize=3, label=key, **(style(key) if style else {}))
    ax.set_xticks(range(len(groups)), groups)
    ax.set(title=title)
    ax.legend(fontsize=8)


def ratio_panel(
    a: Any,
    series: dict[str, dict[str, float]],
    xs: list[int],
    style: Callable[[str], dict] = lambda name: {"label": name},
    unit: str = "x",
) -> None:
    """Each series' values against ``xs`` (keys ``str(x)``, log-2 axis); one without eviction
    (key ``-``) as a dashed line across."""
    for name, by in series.items():
        kw = {"marker": "o", **style(name)}
        if "-" in by:
            a.axhline(by["-"], color="black", ls="--", label=kw["label"])
        elif shown := [x for x in xs if str(x) in by]:
            a.plot(shown, [by[str(x)] for x in shown], **kw)
    a.set_xscale("log", base=2)
    a.set_xticks(xs, [f"{x}{unit}" for x in xs])


def accuracy_plot(
    series: dict[str, dict[str, float]],
    xs: list[int],
    out: Path,
    name: str,
    title: str,
    style: Callable[[str], dict] = lambda n: {"label": n},
    unit: str = "x",
    xlabel: str = "compression",
) -> str:
    """One panel of :func:`ratio_panel` for accuracies, saved as ``<out>/<name>.png``."""
    fig, ax = subplots()
    ratio_panel(ax[0, 0], series, xs, style, unit)
    ax[0, 0].set(xlabel=xlabel, ylabel="accuracy", ylim=(-0.05, 1.05))
    ax[0, 0].legend(fontsize=7)
    return save_plot(fig, out, name, title)


def lengths_plot(
    results: dict[str, dict[str, Any]],
    lengths: list[int],
    out: Path,
    name: str,
    title: str,
    colours: dict[str, str],
) -> str:
    """Each arm's accuracy (``results[arm][str(length)]["accuracy"]``) against prompt tokens,
    in its colour: :func:`accuracy_plot` of the needle through a server."""
    series = {arm: {n: v["accuracy"] for n, v in by.items()} for arm, by in results.items()}
    style = lambda arm: {"color": colours[arm], "label": arm}  # noqa: E731
    return accuracy_plot(series, lengths, out, name, title, style, "", "prompt tokens")
