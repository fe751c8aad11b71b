"""KVzap against NVIDIA kvpress's ``KVzapPress`` holding our surrogates, on the same model and
the same token ids: :mod:`bench.studies.parity.kvzip_parity` with ``method="kvzap"``."""

from __future__ import annotations

from typing import Any

from bench.studies.parity.kvzip_parity import main as _main
from bench.studies.parity.kvzip_parity import render

STUDY = "kvzap_parity"
__all__ = ["main", "render"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return _main(argv, method="kvzap", doc=__doc__)
