"""Calibration faults: a truncated, a NaN, a wrong-shape and another model's artifact in one
registry folder (``QFSERVE_CALIBRATIONS``). A server serves one model, so each fault is a
server for that model that refuses to start (exit 2, one line naming the file), while a server for
another model with the same registry folder starts, uses its own artifact and serves."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from qfserve.calibrations.artifact import save_calibration
from qfserve.calibrations.registry import artifact_name, model_id_for
from tests.caches import fresh_cache
from tests.reliability.harness import start_server, stop_server
from tests.tiny import save_tiny_model

FAULTS = ("truncated", "nan", "wrong_shape", "other_model")


def shape_of(model: Path) -> tuple[int, int, int]:
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"], c.get("num_key_value_heads", c["num_attention_heads"]), head_dim


def write_artifact(registry: Path, model_id: str, shape, *, stored_id: str | None = None) -> Path:
    filters = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return save_calibration(
        registry / artifact_name(model_id), filters, model_id=stored_id or model_id,
        n_sequences=1, tokens_per_sequence=16, samples_per_head=16, text="reliability test",
        query_scale=np.ones(shape[:2], dtype=np.float32),
    )  # fmt: skip


def make_fault(registry: Path, fault: str, model_id: str, shape) -> Path:
    if fault == "wrong_shape":
        return write_artifact(registry, model_id, (shape[0] + 1, shape[1], shape[2]))
    if fault == "other_model":
        return write_artifact(registry, model_id, shape, stored_id="someone/else")
    path = write_artifact(registry, model_id, shape)
    if fault == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:  # NaN filters under valid metadata
        with safe_open(str(path), framework="numpy") as f:
            meta, filters = f.metadata(), f.get_tensor("filters")
        filters[0, 0, 0] = np.nan
        save_file({"filters": filters}, str(path), metadata=meta)
    return path


@pytest.fixture(scope="module")
def registry(model, tmp_path_factory) -> dict:
    """One folder holding four bad artifacts (for four tiny models) and the bundled
    model's good one."""
    root = tmp_path_factory.mktemp("calib")
    folder = root / "registry"
    bad = {}
    for fault in FAULTS:
        model_id = f"test/{fault.replace('_', '-')}"
        tiny = save_tiny_model(root / fault, model_id=model_id)
        bad[fault] = (tiny, make_fault(folder, fault, model_id, shape_of(tiny)))
    good = write_artifact(folder, model_id_for(str(model)), shape_of(model))
    env = {"QFSERVE_CALIBRATIONS": str(folder), "XDG_CACHE_HOME": str(fresh_cache(root / "cache"))}
    return {"bad": bad, "good": good, "env": env, "logs": root}


def test_bad_artifacts_refuse_to_start_naming_the_file(registry, report):
    servers = {
        fault: start_server(tiny, registry["logs"] / f"{fault}.log", env=registry["env"],
                            wait=False)
        for fault, (tiny, _) in registry["bad"].items()
    }  # fmt: skip
    results = {}
    for fault, srv in servers.items():
        t0 = time.monotonic()
        try:
            code = srv.process.wait(120)
        finally:
            stop_server(srv)
        path = str(registry["bad"][fault][1])
        log = srv.logs()
        results[fault] = {
            "exit_code": code,
            "names_file": path in log,
            "seconds": round(time.monotonic() - t0, 1),
            "message": next((line for line in log.splitlines() if path in line), "")[-300:],
            "refusals": sum(line.startswith("qfserve: error:") for line in log.splitlines()),
            "traceback": "Traceback" in log,
        }
    report.add("calibration_faults", results)
    for fault, r in results.items():
        assert r["exit_code"] == 2 and r["names_file"], (fault, r)
        assert r["refusals"] == 1 and not r["traceback"], (fault, r)


def test_another_model_with_the_same_registry_starts_and_serves(model, registry, report, tmp_path):
    server = start_server(model, tmp_path / "good.log", env=registry["env"])
    try:
        resp = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={
                "model": server.model.name,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8,
                "logit_bias": server.no_bias,
                "kv_method": "qfilters",
                "qfilters_budget": 16,
            },
            timeout=60,
        )
    finally:
        code = stop_server(server)
    kv = resp.json()["kv_cache"]
    report.add(
        "calibration_good_model",
        {"status": resp.status_code, "filter_source": kv["filter_source"], "exit_code": code},
    )
    assert resp.status_code == 200 and kv["filter_source"] == "calibrated"
    assert code == 0
