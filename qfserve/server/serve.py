"""Running the app under uvicorn: the port check before loading, a send buffer bound per
connection, and the drain on SIGTERM (new requests 503, in-flight ones finish up to
``--drain-timeout``, then end with an error; a second signal stops at once)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from typing import NoReturn

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger("qfserve")


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (out of range, in use, no such address), or
    None."""
    if not 0 <= port <= 65535:
        return "the port must be in 0-65535"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve the host ({exc})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


# After the drain, streams still open get this long to send their last event.
_CLOSE_GRACE = 5
# Kernel send buffer per connection. Linux grows it to megabytes by default, which hides a
# client that stopped reading for minutes; this small one makes the stream's write block
# (and the write timeout fire) within seconds. Plenty for token streams.
SEND_BUFFER_BYTES = 64 * 1024


class BoundedSendProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol with a fixed, small kernel send buffer."""

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        super().connection_made(transport)


def serve(settings, log_level: str) -> NoReturn:
    from qfserve.server.app import build_app

    app = build_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=_CLOSE_GRACE,
        http=BoundedSendProtocol,
    )
    worker = app.state.worker
    server = DrainingServer(config, worker=worker, drain_timeout=settings.drain_timeout)
    server.run()
    if worker.alive():
        logger.warning("generation worker still busy at exit; exiting without cleanup")
    # Leave without interpreter teardown, always: MLX's static destructors can run while one
    # of its threads is still joinable (a queued async step, a thread-pool worker) and abort
    # with "terminate called without an active exception" (SIGABRT, seen intermittently on a
    # clean SIGTERM here). Everything worth keeping is flushed first; nothing else is held.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(server.exit_code)


def follow(settings) -> NoReturn:
    """A rank other than 0 under ``mlx.launch``: the model thread's loop, no HTTP, until rank 0
    stops (exit 0) or the group is lost or the model fails to load (exit 1)."""
    from qfserve.engine.serving.worker import Worker

    worker = Worker(settings)
    worker.start()
    while worker.alive():
        time.sleep(0.2)
    if worker.refused is not None:
        refuse(worker.refused)
    elif worker.status != "stopped":
        logger.error("rank %s stops: %s", os.environ.get("MLX_RANK", "?"), worker.error)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    code = 0 if worker.status == "stopped" else 2 if worker.refused is not None else 1
    os._exit(code)  # no teardown, as serve()


def refuse(reason: str) -> None:
    """The one line a refused file gets, as the command line words a model it cannot read."""
    print(f"qfserve: error: {reason}", file=sys.stderr, flush=True)


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain phase before its own shutdown, and an exit status.

    uvicorn closes its listening socket as soon as it is told to exit, so a signal only
    starts the drain here: the socket stays open (new requests get 503) until the worker
    is idle or the deadline passes; only then is uvicorn told to exit. Signals are not
    re-raised afterwards, so a drained server exits 0.
    """

    def __init__(self, config, *, worker, drain_timeout: float) -> None:
        super().__init__(config)
        self.worker = worker
        self.drain_timeout = drain_timeout
        self.deadline: float | None = None
        self.aborted = False
        self.exit_code = 0
        self.signal_name: str | None = None
        self.announced = False

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        # Runs as a signal handler: set flags only; on_tick logs and acts.
        if self.deadline is None:
            self.worker.drain()  # new requests get 503 while in-flight ones finish
            self.deadline = time.monotonic() + self.drain_timeout
            self.signal_name = signal.Signals(sig).name
        else:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            self.exit_code = 1

    async def on_tick(self, counter: int) -> bool:
        if not self.announced and self.worker.ready and self.started:
            loaded = self.worker.loaded
            logger.info(
                "ready: serving %s on http://%s:%d",
                loaded.name if loaded else "?",
                self.config.host,
                self.config.port,
            )
            self.announced = True
        if self.worker.status == "failed":
            if self.worker.refused is not None:  # a file it must not use, as for a model file
                refuse(self.worker.refused)
                self.exit_code = 2
            else:
                logger.error("qfserve cannot start: %s", self.worker.error)
                self.exit_code = 1
            return True
        if self.signal_name is not None:
            logger.info("%s: draining for up to %.0f s", self.signal_name, self.drain_timeout)
            self.signal_name = None
        if self.deadline is not None and not self.should_exit:
            if self.worker.idle():
                logger.info("drained; shutting down")
                self.should_exit = True
            elif time.monotonic() >= self.deadline and not self.aborted:
                n = self.worker.abort_all("the server is shutting down; retry elsewhere")
                logger.warning("drain deadline: aborted %d request(s)", n)
                self.aborted = True  # they stop within one step; then idle() holds
        return await super().on_tick(counter)
