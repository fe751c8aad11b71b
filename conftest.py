"""Repository-level pytest hook: run the suite with OpenBLAS under MLX where available."""

from engine.blas import reexec_with_openblas

reexec_with_openblas()
