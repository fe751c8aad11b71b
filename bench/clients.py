"""How a study talks to a model being served: a streamed chat request over HTTP (SSE),
timed per chunk; the engine's in-process worker; a process's resident memory."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.run import Run


@dataclass(frozen=True)
class StreamTiming:
    """One streamed request, timed on the client: seconds, from sending the request."""

    ttft: float  # first chunk with non-empty text
    total: float  # stream finished
    completion_tokens: int
    prompt_tokens: int
    chunks: int
    kv_cache: dict[str, Any] | None = None
    chunk_times: tuple[float, ...] = ()  # each text chunk's arrival

    @property
    def itl(self) -> float:
        """Mean inter-token latency after the first token (seconds)."""
        return (self.total - self.ttft) / max(1, self.completion_tokens - 1)

    @property
    def decode_tps(self) -> float:
        return 1.0 / self.itl


def chat_events(client: Any, url: str, body: dict, timeout: float = 600) -> Iterator[dict]:
    """The events of a streamed ``/v1/chat/completions`` POST with ``client`` (httpx), usage
    included, up to ``[DONE]``; an HTTP or stream error raises."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            if (data := line[5:].strip()) == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{url}: stream error: {event['error']}")
            yield event


def stream_chat(client: Any, url: str, body: dict[str, Any]) -> StreamTiming:
    """POST a streamed ``/v1/chat/completions`` with ``client`` (httpx) and time its chunks."""
    times: list[float] = []
    usage, kv = {}, None
    tic = time.perf_counter()
    for event in chat_events(client, url, body):
        for choice in event.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                times.append(time.perf_counter() - tic)
        usage = event.get("usage") or usage
        kv = event.get("kv_cache") or kv
    total = time.perf_counter() - tic
    if not times:
        raise RuntimeError(f"{url}: the stream carried no text")
    return StreamTiming(
        times[0],
        total,
        int(usage.get("completion_tokens", len(times))),
        int(usage.get("prompt_tokens", 0)),
        len(times),
        kv,
        tuple(times),
    )


def start_worker(run: Run, **config: Any) -> Any:
    """The engine's in-process ``Worker`` (``EngineConfig(**config)``) on ``run``'s loaded
    model, started and ready."""
    from qfserve.engine.serving.config import EngineConfig
    from qfserve.engine.serving.worker import Worker

    worker = Worker(EngineConfig(**config), loader=lambda _ref: run.loaded)
    worker.start()
    deadline = time.monotonic() + 60
    while not worker.ready:
        if worker.status not in ("loading", "ready") or time.monotonic() > deadline:
            raise RuntimeError(f"in-process worker not ready: {worker.status} {worker.error}")
        time.sleep(0.05)
    return worker


async def worker_events(worker: Any, request: Any) -> AsyncIterator[Any]:
    """The events of ``request`` on ``worker`` up to its ``Finished``; a ``Failed`` raises."""
    from qfserve.engine.text.requests import Failed, Finished

    job = worker.submit(request, asyncio.get_running_loop())
    while True:
        event = await job.next_event()
        if isinstance(event, Failed):
            raise RuntimeError(f"worker: {event.kind}: {event.message}")
        yield event
        if isinstance(event, Finished):
            return


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of process ``pid`` (this one by default)."""
    import psutil

    return int(psutil.Process(pid).memory_info().rss)
