"""Lockstep's host side, on one process: deferred cancellation, the tick rank 0 builds (a
handler's cancel, a reader that fell behind) and what a follower does with it, the tick's
round trip through the collectives (a one-rank group), where followers find rank 0, what
the ranks compare at start-up, and the liveness connections."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import mlx.core as mx
import pytest

from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.serving.jobs import Job
from qfserve.engine.serving.liveness import Link, Watch, launched_rank, leader_host
from qfserve.engine.serving.lockstep import Lockstep, Tick
from qfserve.engine.serving.records import RequestRecord
from qfserve.engine.text.requests import Failed, GenerationRequest, SamplingParams
from qfserve.engine.text.structured import JSONConstraint


def request() -> GenerationRequest:
    return GenerationRequest(
        kind="chat",
        sampling=SamplingParams(max_tokens=4, temperature=0.0),
        cache=CacheConfig(method="qfilters", budget=16, recent=4),
        messages=({"role": "user", "content": "hi"},),
        constraint=JSONConstraint(json.dumps({"type": "object"})),
    )


def job(job_id: str, *, deferred: bool = True, loop=None) -> Job:
    record = RequestRecord.opened(job_id, "m", "chat", request().cache.method)
    return Job(request(), record, loop, deferred=deferred)


class Group:
    """Stands for an ``mx.distributed`` group where no collective is called."""

    def __init__(self, rank: int, size: int = 2) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_a_deferred_cancel_takes_effect_only_when_applied():
    plain, deferred = job("a", deferred=False), job("b")
    plain.cancel()
    deferred.cancel(Failed("unavailable", "shutting down"))
    assert plain.cancelled and plain.cancel_asked
    assert deferred.cancel_asked and not deferred.cancelled
    deferred.apply_cancel(Failed("cancelled", "later"))  # the first failure stands
    assert deferred.cancelled and deferred.failure.message == "shutting down"


def test_rank_0_hands_out_asked_and_backlogged_cancels_and_followers_apply_them():
    leader, follower = Lockstep(Group(0)), Lockstep(Group(1))
    loop = asyncio.new_event_loop()
    try:
        mine = [job("r1", loop=loop), job("r2", loop=loop), job("r3", loop=loop)]
        leader.apply(Tick(), mine)
        mine[0].cancel()  # the client went away
        for _ in range(5):  # r2's client stopped reading
            mine[1].emit(Failed("internal", "x"))
        loop.run_until_complete(asyncio.sleep(0))
        due = leader.cancels_due(max_backlog=3)
    finally:
        loop.close()
    assert [d[0] for d in due] == ["r1", "r2"]
    assert due[0][1] is None and "stopped reading" in due[1][1].message
    assert mine[0].cancelled and mine[1].cancelled and not mine[2].cancelled
    assert leader.take() is mine[0]  # arrivals queue for admission in order

    copies = [job(j.id) for j in mine]
    follower.apply(Tick(tuple((j.id, j.request) for j in mine)), copies)
    follower.apply(Tick(cancels=due), [])
    assert [c.cancelled for c in copies] == [True, True, False]
    assert copies[1].failure == due[1][1]
    copies[0].record.finished = 1.0  # closed by the worker: forgotten at the next tick
    follower.apply(Tick(), [])
    assert set(follower.known) == {"r2", "r3"}


def test_a_tick_round_trips_through_the_collectives():
    lockstep = Lockstep(mx.distributed.init())  # one rank: the collectives are identities
    assert lockstep.size == 1 and lockstep.leader
    tick = Tick((("r1", request()),), (("r0", Failed("cancelled", "gone")),))
    assert lockstep.tick(tick, (5, 7)) == tick
    assert lockstep.rank_bytes == [(5, 7)]
    assert lockstep.tick(Tick(), (1, 2)) == Tick()  # an empty tick sends no payload
    assert lockstep.view()["total"] == {"running_kv_bytes": 1, "kept_kv_bytes": 2}


def test_followers_find_rank_0_from_the_ring_host_file(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["10.0.0.7:5000", "10.0.0.7:5001"], ["10.0.0.8:5000"]]))
    monkeypatch.delenv("QFSERVE_LEADER_HOST", raising=False)
    monkeypatch.setenv("MLX_HOSTFILE", str(hosts))
    assert leader_host() == "10.0.0.7"
    monkeypatch.setenv("QFSERVE_LEADER_HOST", "rank0.local")
    assert leader_host() == "rank0.local"


@pytest.mark.parametrize(("env", "rank"), [({}, None), ({"MLX_RANK": "1"}, 1),
                                           ({"OMPI_COMM_WORLD_RANK": "0"}, 0)])  # fmt: skip
def test_the_rank_comes_from_the_launchers_environment(monkeypatch, env, rank):
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launched_rank() == rank


def test_the_settings_compared_between_ranks_leave_out_rank_local_ones():
    from qfserve.engine.serving.config import EngineConfig
    from qfserve.engine.serving.startup import decision_settings

    base = decision_settings(EngineConfig(model="a", max_queue=4, history=10))
    assert base == decision_settings(EngineConfig(model="b", max_queue=9, history=3,
                                                  max_kv_bytes=1 << 20))  # fmt: skip
    assert base != decision_settings(EngineConfig(model="a", max_batch=3))
    assert base != decision_settings(EngineConfig(model="a", prefill_chunk=64))


def test_a_lone_rank_agrees_with_itself():
    lockstep = Lockstep(mx.distributed.init())
    lockstep.handshake("m", {"weights": "w", "settings": "s"}, 12345)
    assert lockstep.max_kv_bytes == 12345
    assert lockstep.same_everywhere("anything")


def _connect(port: int, rank: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(rank.to_bytes(4, "big"))
    return conn


def test_rank_0_hears_of_a_follower_whose_connection_closes():
    lost: list[str] = []
    watch = Watch(2, lost.append)
    one, two = _connect(watch.port, 1), _connect(watch.port, 2)
    watch.ring()  # the bell before a tick: one byte to each follower
    assert one.recv(1) == two.recv(1) == b"\1"
    time.sleep(0.2)
    assert lost == []
    two.close()  # what the kernel does for a killed process
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lost == ["rank 2 of 3 stopped (its connection to rank 0 closed)"]
    one.close()


def test_a_follower_that_never_connects_is_reported_and_close_is_quiet():
    lost: list[str] = []
    Watch(1, lost.append, timeout=0.3)
    time.sleep(1.0)
    assert lost and "never connected" in lost[0]
    quiet: list[str] = []
    watch = Watch(1, quiet.append)
    conn = _connect(watch.port, 1)
    time.sleep(0.2)
    watch.close()  # rank 0 gives up: its followers see the end, rank 0 is not told
    assert conn.recv(1) == b""
    time.sleep(0.2)
    assert quiet == []


def test_a_follower_told_to_stop_does_not_exit_when_rank_0_goes():
    server = socket.create_server(("127.0.0.1", 0))
    stopping = threading.Event()
    stopping.set()
    link = Link(server.getsockname()[1], 1, stopping)
    conn, _ = server.accept()
    conn.sendall(b"\1\1")  # two bells: two ticks may follow
    link.wait()
    link.wait()
    conn.close()  # rank 0 exits after its stop tick; os._exit(1) here would end the tests
    time.sleep(0.3)
    link.close()
    server.close()
