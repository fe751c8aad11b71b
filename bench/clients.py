"""How a study talks to a model being served: a streamed chat request over HTTP (SSE),
timed per chunk; a needle document's greedy completion; the engine's in-process worker; a
process's resident memory."""

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


def served_model(client: Any, url: str) -> str:
    """The id of the model the server at ``url`` serves (``client``: httpx or a client)."""
    return str(client.get(url + "/v1/models", timeout=30).json()["data"][0]["id"])


def needle_answer(
    url: str, doc: dict[str, Any], fields: dict[str, Any], timeout: float
) -> tuple[bool, dict[str, Any], float]:
    """A greedy ``/v1/completions`` of a needle document (:func:`bench.data.needle_doc`) with
    the request's eviction ``fields``: whether it answered the needle's number, the response's
    ``kv_cache`` and the seconds from sending the request."""
    import httpx

    from bench.data import first_number_is

    request = {
        "model": served_model(httpx, url),
        "prompt": doc["prompt"],
        "max_tokens": len(doc["answer"]) + 2,
        "temperature": 0,
        **fields,
    }
    began = time.perf_counter()
    resp = httpx.post(f"{url}/v1/completions", json=request, timeout=timeout)
    resp.raise_for_status()
    out = resp.json()
    correct = first_number_is(out["choices"][0]["text"], doc["number"])
    return correct, out["kv_cache"], time.perf_counter() - began


def with_surrogates(run: Run, arms: Any) -> list[str]:
    """``arms`` less the kvzap ones where the model has no KVzap surrogates (a server would
    refuse their requests), saying so."""
    from qfserve.calibrations.registry import find_surrogate, model_id_for

    if find_surrogate(model_id_for(run.loaded.model_id)) is not None:
        return list(arms)
    print("no KVzap surrogates for this model: the kvzap arms do not run")
    return [a for a in arms if not a.startswith("kvzap")]


def needle_records(
    run: Run, arms: Any, lengths: list[int], docs: int, send: Any
) -> list[dict[str, Any]]:
    """Each arm's record on ``docs`` needle documents per length (the needle at half depth;
    the prompt and its answer fit the context), its fields from ``send(arm, doc)``; logged
    as they come, so that a stopped run resumes."""
    from bench.data import needle_doc, stdlib_prose

    paragraphs = list(stdlib_prose())
    room = run.context_length - 16  # the prompt and its answer fit (8k: 8,176 tokens at most)

    def measure(arm: str, n: int, d: int) -> dict[str, Any]:
        doc = needle_doc(run.tokenizer, paragraphs, min(n, room), 0.5, d)
        return {"arm": arm, "length": n, "doc": d, "tokens": doc["tokens"], **send(arm, doc)}

    todo = [(a, n, d) for n in lengths for d in range(docs) for a in arms]
    return run.logged(("arm", "length", "doc"), todo, measure, "answers")


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
