"""Which rank this process is (read from the launcher's environment, before MLX is imported),
and liveness: rank 0 learns within a moment that another rank died, the others that it did.

Liveness does not ride on the collectives: once a peer is gone, the ring backend logs
"Failing pending tasks" but its next collective may wait forever (seen with a follower killed
while rank 0 waited for a tick). So each follower holds a plain TCP connection to rank 0; the
kernel closes a dead process's sockets whatever killed it, and a connection that closes is a
rank that died. Rank 0 then fails its requests and reports 503; a follower exits.

The same connection rings a bell before each tick: a follower sleeps on it, then enters the
collective. A rank waiting inside a ring collective keeps its cores busy (seen: idle followers
at half a core each, which slowed a server sharing the machine several times over).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Set by mlx.launch for the ring and JACCL backends, and by MPI's launchers.
LAUNCH_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launched_rank() -> int | None:
    """This process's rank when a distributed launcher started it, else ``None`` (read from
    the environment, without importing MLX's distributed backends)."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def leader_host() -> str:
    """Where followers reach rank 0: ``QFSERVE_LEADER_HOST``, else the first address of the
    ring backend's host file (``MLX_HOSTFILE``, written by ``mlx.launch``), else loopback."""
    if os.environ.get("QFSERVE_LEADER_HOST"):
        return os.environ["QFSERVE_LEADER_HOST"]
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            return str(json.load(f)[0][0]).rsplit(":", 1)[0]
    except (KeyError, OSError, ValueError, IndexError, TypeError):
        return "127.0.0.1"


class Watch:
    """Rank 0's side: a listening socket the ``followers`` connect to once each.

    Args:
        followers: How many ranks will connect (the group's size less one).
        on_lost: Called once, from the watching thread, with a message naming the rank.
        timeout: Seconds the followers have to connect (after the handshake) before rank 0
            gives up on them.
    """

    def __init__(
        self, followers: int, on_lost: Callable[[str], None], timeout: float = 60.0
    ) -> None:
        self._server = socket.create_server(("", 0))
        self._server.settimeout(timeout)
        self.port = int(self._server.getsockname()[1])
        self._followers = followers
        self._on_lost = on_lost
        self._ranks: dict[socket.socket, int] = {}
        self._closing = False
        self._connected = threading.Event()
        threading.Thread(target=self._watch, name="qfserve-liveness", daemon=True).start()

    def _watch(self) -> None:
        size = self._followers + 1
        try:
            while len(self._ranks) < self._followers:
                conn, _ = self._server.accept()
                conn.settimeout(None)
                self._ranks[conn] = int.from_bytes(conn.recv(4) or b"\0", "big")
        except OSError as exc:  # a timeout: some follower never connected
            self._on_lost(
                f"{self._followers - len(self._ranks)} of {size} ranks never "
                f"connected to rank 0 ({exc})"
            )
            return
        finally:
            self._server.close()
        self._connected.set()
        readable, _, _ = select.select(list(self._ranks), [], [])  # data or EOF: it is gone
        if not self._closing:
            rank = self._ranks[readable[0]]
            self._on_lost(f"rank {rank} of {size} stopped (its connection to rank 0 closed)")

    def ring(self) -> None:
        """Wake every follower for the tick that follows (waits for them to connect; a
        follower gone is the watching thread's to report)."""
        self._connected.wait()
        for conn in list(self._ranks):
            with contextlib.suppress(OSError):
                conn.sendall(b"\1")

    def close(self) -> None:
        """Close every follower's connection (they exit): rank 0 cannot go on."""
        self._closing = True
        for conn in list(self._ranks):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class Link:
    """A follower's side: connected to rank 0, it exits this process when rank 0 goes away
    (unless ``stopping`` is set: rank 0 stopped cleanly and this rank's loop ends by itself),
    and :meth:`wait` sleeps until rank 0 rings for the next tick."""

    def __init__(self, port: int, rank: int, stopping: threading.Event) -> None:
        self._conn = socket.create_connection((leader_host(), port), timeout=30)
        self._conn.settimeout(None)
        self._conn.sendall(rank.to_bytes(4, "big"))
        self._bells = threading.Semaphore(0)
        self._rank, self._stopping = rank, stopping
        threading.Thread(target=self._watch, name="qfserve-liveness", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                data = self._conn.recv(4096)
            except OSError:
                data = b""
            if not data:
                break
            for _ in data:
                self._bells.release()
        if self._stopping.is_set():
            return
        logger.error("rank %d stops: rank 0 went away", self._rank)
        logging.shutdown()
        os._exit(1)  # its model thread may wait on a collective that never completes

    def wait(self) -> None:
        """Sleep until rank 0 rings for its next tick."""
        self._bells.acquire()

    def close(self) -> None:
        self._conn.close()
