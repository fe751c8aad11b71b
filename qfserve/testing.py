"""Server subprocesses on loopback: qfserve, ``mlx_lm.server`` or llama.cpp's server
(``llama_cpp.server``, an optional extra) on an ephemeral port.

One way to start, wait for and stop a server, shared by the test suites and the benchmarks
(``bench/``, which imports this; nothing in ``qfserve`` imports ``bench``):
:func:`launch` starts one (no waiting), :func:`wait_ready` polls its health route,
:func:`start` does both and :func:`serve` runs several together for the length of a ``with``.
Nothing here talks to any address but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from qfserve.engine.models.blas import find_blas, preload_env

if TYPE_CHECKING:
    from openai import OpenAI

# The source checkout (this file is qfserve/testing.py): servers run from it, on its path.
REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only, always
HEALTH = {
    "qfserve": "/health",
    "mlx_lm": "/v1/models",
    "llama_cpp": "/v1/models",
    "llama_server": "/health",
}
# llama-cpp-python may live in another environment (it compiles llama.cpp from source).
LLAMA_PYTHON = os.environ.get("QFSERVE_LLAMA_PYTHON") or sys.executable
# llama.cpp's own llama-server binary: $QFSERVE_LLAMA_SERVER, else where the project's
# `llama-cpp-tools` script builds it from the sources llama-cpp-python's sdist vendors.
LLAMA_TOOLS = Path(os.environ.get("QFSERVE_LLAMA_TOOLS", "~/.cache/llama-cpp-tools/build/bin"))


def llama_tool(name: str) -> Path | None:
    """A llama.cpp tool (``llama-server``, ``llama-quantize``) where built, else ``None``."""
    override = os.environ.get("QFSERVE_LLAMA_SERVER") if name == "llama-server" else None
    path = Path(override) if override else LLAMA_TOOLS.expanduser() / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def llama_cpp_python() -> Any:
    """The ``llama_cpp`` module (llama-cpp-python, the optional reference for tokens and
    logits) or ``None``. Where llama.cpp's tools are built (:func:`llama_tool`), it runs on
    their ``libllama``, so the package installs without compiling llama.cpp again:
    ``CMAKE_ARGS=-DLLAMA_BUILD=OFF pip install llama-cpp-python`` (bench/reference/llama_cpp_tools.sh)."""
    lib = LLAMA_TOOLS.expanduser()
    if "LLAMA_CPP_LIB_PATH" not in os.environ and (lib / "libllama.so").is_file():
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib)
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError, FileNotFoundError):
        return None
    return llama_cpp


def gguf_of(ref: str | Path | None) -> Path:
    """The GGUF file a ``--model`` value names: the file itself or a catalog model's."""
    from qfserve.engine.models.catalog import CATALOG, DEFAULT_MODEL, gguf_path

    if ref is not None and str(ref).endswith(".gguf"):
        return Path(ref)
    name = DEFAULT_MODEL if ref is None else str(ref)
    if name not in CATALOG:
        raise ValueError(f"llama.cpp serves GGUF files: {name!r} is neither one nor in the catalog")
    return gguf_path(CATALOG[name])


def free_port() -> int:
    """A TCP port on :data:`HOST` that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def server_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a server runs in: ``env`` (default: this process's) plus OpenBLAS in
    ``LD_PRELOAD``, the repository on ``PYTHONPATH`` and ``PYTHONUNBUFFERED=1``.

    ``env`` replaces ``os.environ`` rather than adding to it.
    """
    out = dict(os.environ if env is None else env)
    # qfserve re-executes itself with OpenBLAS; mlx_lm.server would otherwise run float32
    # matmul on MLX's reference BLAS (~30x slower). QFSERVE_BLAS=off opts out, as there.
    off = out.get("QFSERVE_NO_OPENBLAS") == "1" or out.get("QFSERVE_BLAS") == "off"
    blas = None if off else find_blas(out.get("QFSERVE_BLAS"))
    if blas is not None:
        out = preload_env(blas, out)
    out["PYTHONPATH"] = ":".join(p for p in (str(REPO), out.get("PYTHONPATH", "")) if p)
    out["PYTHONUNBUFFERED"] = "1"
    return out


@dataclass
class ServerProcess:
    """A server subprocess: its kind (``qfserve`` or ``mlx_lm``), port, log file and model
    (``None``: started without ``--model``)."""

    kind: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    model: Path | str | None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def logs(self) -> str:
        """Everything the server has written to stdout and stderr so far."""
        return self.log.read_text(errors="replace")

    def openai(self, **kwargs: Any) -> OpenAI:
        """An OpenAI client for ``/v1``; keyword arguments override ``api_key``,
        ``max_retries`` (0) and ``timeout`` (60 s)."""
        from openai import OpenAI

        kwargs = {"api_key": "unused", "max_retries": 0, "timeout": 60, **kwargs}
        return OpenAI(base_url=f"{self.url}/v1", **kwargs)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait up to ``timeout`` seconds, then kill; returns the exit status."""
        return stop_all([self], timeout)[0]


def stop_all(servers: Sequence[ServerProcess], timeout: float = 30.0) -> list[int]:
    """SIGTERM every server at once, then wait for each (killing it after ``timeout``)."""
    for server in servers:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
    for server in servers:
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return [server.process.returncode for server in servers]


def _command(kind: str, console_script: bool, log_level: str | None) -> list[str]:
    threads = str(os.cpu_count() or 1)
    if kind == "llama_cpp":  # its own defaults but the threads: every core, as ours
        return [
            LLAMA_PYTHON,
            "-m",
            "llama_cpp.server",
            "--n_ctx",
            "0",
            "--n_threads",
            threads,
            "--n_threads_batch",
            threads,
        ]
    if kind == "llama_server":  # flags (-c, -np) follow; every core, as ours
        binary = llama_tool("llama-server")
        if binary is None:
            raise ValueError(
                "llama-server is not built: run bench/reference/llama_cpp_tools.sh or set "
                "QFSERVE_LLAMA_SERVER"
            )
        return [str(binary), "-t", threads, "-tb", threads]
    if kind == "mlx_lm":
        if console_script:
            raise ValueError("console_script is for kind 'qfserve' only, got kind 'mlx_lm'")
        level = (log_level or "warning").upper()
        return [sys.executable, "-m", "mlx_lm.server", "--log-level", level]
    script = shutil.which("qfserve", path=str(Path(sys.executable).parent))
    command = (
        [script] if console_script and script else [sys.executable, "-m", "qfserve.server.cli"]
    )
    return command + ([] if log_level is None else ["--log-level", log_level])


def launch(
    kind: str,
    model: Path | str | None,
    *flags: str,
    log: Path,
    env: Mapping[str, str] | None = None,
    log_level: str | None = None,
    console_script: bool = False,
) -> ServerProcess:
    """Start a server on :data:`HOST` and a free port without waiting for it.

    Args:
        kind: ``"qfserve"``, ``"mlx_lm"``, ``"llama_cpp"`` (llama-cpp-python's server) or
            ``"llama_server"`` (llama.cpp's own binary, :func:`llama_tool`).
        model: ``--model`` (``None``: no ``--model``, the server's default model).
        flags: Further command-line flags, after the ones set here.
        log: File that receives the server's stdout and stderr (overwritten).
        env: Replaces ``os.environ`` (see :func:`server_env`).
        log_level: ``--log-level`` (default: qfserve's own; ``mlx_lm`` always gets one,
            ``WARNING`` unless given).
        console_script: Run the installed ``qfserve`` script next to ``sys.executable``
            rather than ``python -m qfserve.server.cli`` (which it falls back to if missing).
    """
    if kind not in HEALTH:
        raise ValueError(f"kind must be one of {', '.join(HEALTH)}, got {kind!r}")
    port = free_port()
    model_flags = [] if model is None else ["--model", str(model)]
    command = _command(kind, console_script, log_level)
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            [*command, *model_flags, "--host", HOST, "--port", str(port), *flags],
            cwd=REPO,
            env=server_env(env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return ServerProcess(kind, process, port, log, model)


def rank_threads(size: int) -> int:
    """OpenBLAS threads each of ``size`` ranks on this machine gets from :func:`launch_ranks`.

    A process compared with the ranks should run with as many: another thread count blocks
    the float sums differently, and a last-bit difference can flip a near-tie between two
    rows' eviction scores, which is not a difference the split made.
    """
    return max(1, (os.cpu_count() or 1) // size)


def launch_ranks(
    size: int,
    model: Path | str | None,
    *flags: str,
    logs: Path,
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
) -> list[ServerProcess]:
    """Start ``size`` qfserve ranks on loopback as ``mlx.launch --backend ring`` would (the
    same environment: ``MLX_RANK`` and a ring host file), without waiting for them.

    Rank 0 (the first returned) serves HTTP; the others follow it. Logs go to
    ``logs/rank<r>.log``; the host file is written there too. ``rank_env`` adds variables
    to some ranks' environments. Each rank gets its share of this machine's cores for
    OpenBLAS's threads (unless ``OPENBLAS_NUM_THREADS`` is set): ranks sharing a machine
    with a thread per core each would spin against each other.
    """
    hostfile = logs / "hosts.json"
    hostfile.write_text(json.dumps([[f"{HOST}:{free_port()}"] for _ in range(size)]))
    base = dict(os.environ if env is None else env)
    base.setdefault("OPENBLAS_NUM_THREADS", str(rank_threads(size)))
    return [
        launch(
            "qfserve",
            model,
            *flags,
            log=logs / f"rank{rank}.log",
            env={
                **base,
                **(rank_env or {}).get(rank, {}),
                "MLX_RANK": str(rank),
                "MLX_HOSTFILE": str(hostfile),
            },
        )
        for rank in range(size)
    ]


def wait_ready(server: ServerProcess, timeout: float = 120.0) -> None:
    """Poll the health route (``/health``; ``/v1/models`` for ``mlx_lm``) until it answers 200.

    Checks at least once even when ``timeout`` is spent. If the process exits or ``timeout``
    seconds pass, stops it and raises ``RuntimeError`` carrying the end of its log.
    """
    deadline = time.monotonic() + timeout
    while True:
        if server.process.poll() is not None:
            problem = f"exited with {server.process.returncode}"
            break
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + HEALTH[server.kind], timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            problem = f"not ready after {max(timeout, 0):.3g} s"
            break
        time.sleep(0.2)
    server.stop(10)
    raise RuntimeError(f"{server.kind} {problem}:\n{server.logs()[-4000:]}")


def start(
    kind: str,
    model: Path | str | None,
    *flags: str,
    log: Path,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    log_level: str | None = None,
    console_script: bool = False,
) -> ServerProcess:
    """:func:`launch`, then :func:`wait_ready` with ``timeout`` seconds."""
    server = launch(
        kind, model, *flags, log=log, env=env, log_level=log_level, console_script=console_script
    )
    wait_ready(server, timeout)
    return server


@contextlib.contextmanager
def serving(
    *kinds: str,
    model: Path,
    timeout: float = 120.0,
    flags: Mapping[str, Sequence[str]] | None = None,
) -> Iterator[list[ServerProcess]]:
    """Start servers of ``kinds`` on ephemeral loopback ports, together, each with its
    ``flags`` (by kind).

    Yields them, in the order of ``kinds``, once every one answers its health route within
    ``timeout`` seconds of them all being started; stops them all on exit and removes their
    temporary logs.
    """
    servers: list[ServerProcess] = []
    logs: list[Path] = []
    try:
        for kind in kinds:
            fd, name = tempfile.mkstemp(prefix=f"{kind}-", suffix=".log")
            os.close(fd)
            logs.append(Path(name))
            extra = (flags or {}).get(kind, ())
            servers.append(launch(kind, model, *extra, log=logs[-1], log_level="warning"))
        deadline = time.monotonic() + timeout
        for server in servers:
            wait_ready(server, deadline - time.monotonic())
        yield servers
    finally:
        stop_all(servers, 10)
        for log in logs:
            log.unlink(missing_ok=True)


@contextlib.contextmanager
def serve(
    *kinds: str,
    model: Path,
    timeout: float = 120.0,
    flags: Mapping[str, Sequence[str]] | None = None,
) -> Iterator[list[str]]:
    """:func:`serving`, yielding the servers' base URLs."""
    with serving(*kinds, model=model, timeout=timeout, flags=flags) as started:
        yield [server.url for server in started]
