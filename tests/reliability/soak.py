"""``python -m tests.reliability soak [--minutes N] [--clients C] [--out FILE]``: a long run
of mixed traffic against one server on the default model, watched for creep.

Clients loop over requests drawn from everything a user may send: every eviction method at
several budgets, streamed and not, forced tool calls and ``response_format`` schemas,
streams dropped mid-answer, two-turn conversations reused through ``prompt_cache_key`` with
``--prompt-cache-dir`` on disk, and enough of them at once against a small ``--max-kv-bytes``
and ``--max-queue`` that admission has to wait and refuse. Every few seconds a sampler
records the server's RSS, open files, threads, KV bytes in use and kept, and MLX memory;
each response's status and latency is kept. The run passes when every status is 200, 400 or
503, RSS grows at most 5% from the first sixth of the run (after warm-up: minute 10 of 60)
to its end, open files and threads end where they were after warm-up, and once idle no
request holds KV bytes. Figures and a plot go to ``--out`` (JSON) beside a PNG.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from qfserve import testing
from tests.reliability.harness import REPO, Server, percentiles, sse_events, stop_server
from tests.reliability.test_load import WORDS

METHODS = ("qfilters", "kvzip", "kvzap", "knorm", "streaming", "snapkv", "tova", "full")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
ANSWER = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"word": {"type": "string", "maxLength": 12}},
            "required": ["word"],
        },
    },
}
OK_STATUSES = (200, 400, 503)


def request_body(rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    """A kind of request and its body."""
    method = rng.choice(METHODS)
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.choice((4, 40, 400))))}
        ],
        "max_tokens": rng.choice((8, 24, 48)),
        "temperature": rng.choice((0.0, 0.8)),
        "kv_method": method,
    }
    if method != "full":
        body["qfilters_budget"] = rng.choice((64, 128, 512))
    roll = rng.random()
    if roll < 0.1:
        body |= {"tools": [WEATHER], "tool_choice": "required"}
        kind = "tool"
    elif roll < 0.2:
        body["response_format"] = ANSWER
        kind = "json"
    elif roll < 0.3:
        body["qfilters_budget"] = -5  # a 400
        kind = "bad"
    else:
        kind = "chat"
    body["stream"] = rng.random() < 0.6
    return kind, body


class Soak:
    def __init__(self, url: str, model: str, seconds: float, clients: int, seed: int) -> None:
        self.url, self.model, self.seconds, self.clients = url, model, seconds, clients
        self.statuses: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.latencies: list[tuple[float, float, float]] = []  # (when, ttft, total)
        self.lock = threading.Lock()
        self.seed = seed
        self.t0 = time.monotonic()

    def run(self) -> None:
        threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True)
            for i in range(self.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        with httpx.Client(timeout=300) as client:
            while time.monotonic() - self.t0 < self.seconds:
                roll = rng.random()
                try:
                    if roll < 0.1:
                        self._disconnect(client, rng)
                    elif roll < 0.25:
                        self._conversation(client, rng, i)
                    else:
                        kind, body = request_body(rng, self.model)
                        self._send(client, kind, body)
                except httpx.HTTPError as exc:  # the server stopped answering: a failure
                    self._count("transport", f"error:{type(exc).__name__}")

    def _count(self, kind: str, status: str) -> None:
        with self.lock:
            self.kinds[kind] += 1
            self.statuses[status] += 1

    def _send(self, client: httpx.Client, kind: str, body: dict[str, Any]) -> dict | None:
        tic = time.monotonic()
        ttft, final = None, None
        if body.get("stream"):
            with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                status = r.status_code
                if status == 200:
                    for data in sse_events(r.iter_lines()):
                        if ttft is None:
                            ttft = time.monotonic() - tic
                        if data != "[DONE]":
                            final = json.loads(data)
                else:
                    r.read()
        else:
            r = client.post(f"{self.url}/v1/chat/completions", json=body)
            status, final = r.status_code, r.json() if r.status_code == 200 else None
        total = time.monotonic() - tic
        self._count(kind, str(status))
        if status == 503:  # a full queue: wait as the server asks, as a client should
            time.sleep(float(r.headers.get("retry-after", 1)))
        if status == 200:
            with self.lock:
                self.latencies.append((tic - self.t0, ttft if ttft is not None else total, total))
        return final

    def _disconnect(self, client: httpx.Client, rng: random.Random) -> None:
        """A stream the client drops after a few events."""
        _, body = request_body(rng, self.model)
        for plain in ("tools", "tool_choice", "response_format"):
            body.pop(plain, None)
        body |= {"stream": True, "max_tokens": 48, "qfilters_budget": 128}
        body["kv_method"] = rng.choice(METHODS[:3])
        with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
            self._count("disconnect", str(r.status_code))
            if r.status_code == 200:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= rng.randint(1, 6):
                        break

    def _conversation(self, client: httpx.Client, rng: random.Random, i: int) -> None:
        """Two turns under one ``prompt_cache_key``: the second continues the first's cache."""
        key = f"soak-{i}-{rng.randrange(4)}"
        method = rng.choice(("qfilters", "kvzip", "full"))
        messages = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=200))}]
        for _ in range(2):
            body = {
                "model": self.model,
                "messages": messages,
                "max_tokens": 16,
                "temperature": 0,
                "kv_method": method,
                "prompt_cache_key": key,
            }
            if method != "full":
                body["qfilters_budget"] = 128
            final = self._send(client, "reuse", body)
            if final is None:
                return
            answer = final["choices"][0]["message"]["content"] or ""
            messages = [*messages, {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": "and then?"})


def sample(server: Any, t0: float, out: list[dict[str, Any]], stop: threading.Event) -> None:
    process = psutil.Process(server.pid)
    while not stop.is_set():
        try:
            snap = httpx.get(f"{server.url}/admin/cache", timeout=10).json()
            totals, kept = snap["totals"], snap.get("prompt_cache") or {}
            out.append(
                {
                    "t_s": round(time.monotonic() - t0, 1),
                    "rss_bytes": process.memory_info().rss,
                    "open_files": process.num_fds(),
                    "threads": process.num_threads(),
                    "kv_used_bytes": totals["kv_used_bytes"],
                    "kept_bytes": kept.get("bytes", 0),
                    "active": totals["active"],
                    "mlx_active_bytes": totals["mlx_active_bytes"],
                }
            )
        except (httpx.HTTPError, psutil.Error, KeyError):
            pass
        stop.wait(5)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.reliability soak", description=__doc__)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak.json")
    args = p.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="qfserve-soak-"))
    flags = ("--max-kv-bytes", str(96 << 20), "--max-queue", "4", "--prompt-cache-dir")
    kept = str(scratch / "kept")
    log = scratch / "server.log"
    launched = testing.launch("qfserve", None, *flags, kept, log=log, log_level="warning")
    server = Server(**vars(launched))  # the default model: no folder of its own to name
    testing.wait_ready(server, 300)
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    t0 = time.monotonic()
    sampler = threading.Thread(target=sample, args=(server, t0, samples, stop), daemon=True)
    sampler.start()
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        soak = Soak(server.url, model, args.minutes * 60, args.clients, args.seed)
        soak.t0 = t0
        soak.run()
        idle = server.wait_idle(120)
        time.sleep(6)  # one more sample, idle
    finally:
        stop.set()
        sampler.join(10)
        status = stop_server(server)
    result = summarise(args, soak, samples, idle, status)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(samples, soak, args.out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=1))
    return 0 if result["summary"]["passed"] else 1


def memory_figures(samples: list[dict], load_end: float) -> dict[str, Any]:
    """RSS, open files and threads in the minute after warm-up (the first sixth of the load:
    minute 10 of 60) against the load's last minute, medians for RSS and highs for the
    counts; and the last sample, taken idle after the load."""

    def window(lo: float, hi: float) -> list[dict]:
        return [x for x in samples if lo <= x["t_s"] < hi]

    warm, last = window(load_end / 6, load_end / 6 + 60), window(load_end - 60, load_end)
    if not warm or not last:
        return {}
    rss = [statistics.median(x["rss_bytes"] for x in w) for w in (warm, last)]
    idle = samples[-1]
    return {
        "rss_mib_after_warmup_and_at_end": [round(r / 2**20, 1) for r in rss],
        "rss_growth": round(rss[1] / rss[0] - 1, 4),
        "open_files_after_warmup_and_at_end": [
            max(x["open_files"] for x in w) for w in (warm, last)
        ],
        "threads_after_warmup_and_at_end": [max(x["threads"] for x in w) for w in (warm, last)],
        "kept_mib_after_warmup_and_at_end": [
            round(max(x["kept_bytes"] for x in w) / 2**20, 1) for w in (warm, last)
        ],
        "idle_rss_mib": round(idle["rss_bytes"] / 2**20, 1),
        "idle_open_files": idle["open_files"],
        "idle_kv_used_bytes": idle["kv_used_bytes"],
        "idle_kept_bytes": idle["kept_bytes"],
    }


def summarise(args: Any, soak: Soak, samples: list[dict], idle: float | None, status: int) -> dict:
    bad = {k: v for k, v in soak.statuses.items() if not (k.isdigit() and int(k) in OK_STATUSES)}
    minutes: dict[int, list[tuple[float, float, float]]] = {}
    for when, ttft, total in soak.latencies:
        minutes.setdefault(int(when // 60), []).append((when, ttft, total))
    per_minute = {
        m: {
            "responses": len(v),
            "ttft": percentiles([x[1] for x in v], (50, 95)),
            "total": percentiles([x[2] for x in v], (50, 95)),
        }
        for m, v in sorted(minutes.items())
    }
    memory = memory_figures(samples, args.minutes * 60)
    summary = {
        "minutes": args.minutes,
        "clients": args.clients,
        "requests": sum(soak.statuses.values()),
        "statuses": dict(soak.statuses),
        "kinds": dict(soak.kinds),
        "unexpected_statuses": bad,
        **memory,
        "idle_after_s": idle,
        "exit_status": status,
    }
    summary["passed"] = verdict(summary)
    return {"summary": summary, "per_minute": per_minute, "samples": samples}


def verdict(summary: dict[str, Any]) -> bool:
    """Only 200, 400 and 503; RSS within 5% and open files and threads no higher at the
    load's end than after warm-up; idle afterwards, holding no request's KV; a clean exit."""
    files = summary.get("open_files_after_warmup_and_at_end", [0, 10**9])
    threads = summary.get("threads_after_warmup_and_at_end", [0, 10**9])
    return bool(
        not summary["unexpected_statuses"]
        and summary.get("rss_growth", 1.0) <= 0.05
        and files[1] <= files[0] + 2
        and threads[1] <= threads[0] + 2
        and summary["idle_after_s"] is not None
        and summary.get("idle_kv_used_bytes") == 0
        and summary["exit_status"] == 0
    )


def plot(samples: list[dict], soak: Soak, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    t = [s["t_s"] / 60 for s in samples]
    axes[0].plot(t, [s["rss_bytes"] / 2**20 for s in samples], label="RSS")
    axes[0].plot(t, [s["mlx_active_bytes"] / 2**20 for s in samples], label="MLX active")
    axes[0].plot(t, [s["kept_bytes"] / 2**20 for s in samples], label="kept caches")
    axes[0].set(title="memory (MiB)", xlabel="minutes")
    axes[0].legend(fontsize=8)
    axes[1].plot(t, [s["open_files"] for s in samples], label="open files")
    axes[1].plot(t, [s["threads"] for s in samples], label="threads")
    axes[1].set(title="open files and threads", xlabel="minutes")
    axes[1].legend(fontsize=8)
    when = [w / 60 for w, _, _ in soak.latencies]
    axes[2].scatter(when, [x for _, _, x in soak.latencies], s=2, label="end to end")
    axes[2].scatter(when, [x for _, x, _ in soak.latencies], s=2, label="first event")
    axes[2].set(title="latency (s)", xlabel="minutes", yscale="log")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
