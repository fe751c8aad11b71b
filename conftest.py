"""Repository-level pytest hook: run the suite with OpenBLAS under MLX where available."""

from qfserve.engine.models.blas import reexec_with_openblas, wants_reexec


def pytest_configure(config):
    # The loader reads LD_PRELOAD only at start-up, so re-execute once; hand the terminal
    # back from pytest's output capture first so the new process writes to it.
    if not wants_reexec():
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()
    reexec_with_openblas()
