"""Markdown building blocks of the results page: arm labels and order, number formats and
tables, shared by the study renderers (:mod:`bench.quality.report`) and the section's
headlines (:mod:`bench.quality.headlines`). Imports neither MLX nor the studies."""

from __future__ import annotations

from typing import Any

CHUNKS = (4, 8, 16)  # chunk sizes the studies may run (bench.quality.arms.Arm.chunk)
ARM_ORDER = (
    "qfilters/r0",
    "qfilters/r25",
    *(f"qfilters/r{r}/c{c}" for r in (0, 25) for c in CHUNKS),
    "qfilters/r0/ada",
    "qfilters/r25/ada",
    "fallback/r0",
    "fallback/r25",
    "fallback-/r0",
    "fallback-/r25",
    "knorm/r0",
    "knorm/r25",
    "streaming/r0",
)
ARM_NAMES = {
    "full": "full cache",
    "qfilters/r0": "Q-Filters calibrated, recent 0",
    "qfilters/r25": "Q-Filters calibrated, recent b/4",
    "fallback/r0": "key-SVD fallback, recent 0",
    "fallback/r25": "key-SVD fallback, recent b/4",
    "fallback-/r0": "key-SVD fallback sign-flipped (ablation), recent 0",
    "fallback-/r25": "key-SVD fallback sign-flipped (ablation), recent b/4",
    "knorm/r0": "K-norm, recent 0",
    "knorm/r25": "K-norm, recent b/4",
    "streaming/r0": "streaming (sinks + latest)",
    **{
        f"qfilters/r{r}/c{c}": f"Q-Filters calibrated, recent {'b/4' if r else 0}, chunks of {c}"
        for r in (0, 25)
        for c in CHUNKS
    },
    "qfilters/r0/ada": "Q-Filters calibrated, recent 0, adaptive budgets",
    "qfilters/r25/ada": "Q-Filters calibrated, recent b/4, adaptive budgets",
}
METHOD_NAMES = {  # the other arms' methods (bench.quality.arms.Arm.name's first part)
    "qfilters": "Q-Filters calibrated",
    "self": "Q-Filters self-calibrated (the prompt's own queries)",
    "traffic": "Q-Filters learned from traffic",
    "snapkv": "SnapKV",
    "tova": "TOVA",
    "fallback": "key-SVD fallback",
    "fallback-": "key-SVD fallback sign-flipped (ablation)",
    "knorm": "K-norm",
    "streaming": "streaming (sinks + latest)",
}


def arm_label(name: str) -> str:
    """A row label for any arm name ``method/rNN[/cN][/ada][/wN][/<traffic>]``."""
    if name in ARM_NAMES:
        return ARM_NAMES[name]
    method, _, rest = name.partition("/")
    parts = rest.split("/") if rest else []
    label = METHOD_NAMES.get(method, method)
    for part in parts:
        if part.startswith("r") and part[1:].isdigit():
            share = int(part[1:])
            label += ", recent " + (
                "b/4" if share == 25 else "0" if share == 0 else f"{share}% of b"
            )
        elif part.startswith("c") and part[1:].isdigit():
            label += f", chunks of {part[1:]}"
        elif part == "ada":
            label += ", adaptive budgets"
        elif part.startswith("w") and part[1:].isdigit():
            label += f", {part[1:]}-token window"
        elif method == "traffic":
            label = label.replace("from traffic", f"from {part} traffic")
        else:
            label += f", {part}"
    return label


def arm_order(present: Any) -> list[str]:
    """``present`` arm names in reading order: the full cache, the standard arms, then the
    rest as they came."""
    present = list(dict.fromkeys(present))
    known = [n for n in ("full", *ARM_ORDER) if n in present]
    return known + [n for n in present if n not in known]


def fmt(x: Any, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out
