"""Q-Filters learned from traffic against ``qfserve calibrate``'s pipeline on the same text.

The reference is calibration's own capture and computation over the same prompts
(different random samples of them: the tolerance is sampling's). The model has a planted
query drift (``drifted`` in ``conftest.py``), so each head has a clear filter to find.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from qfserve.calibrations import registry
from qfserve.calibrations.artifact import read_calibration
from qfserve.calibrations.capture import capture_queries
from qfserve.calibrations.compute import compute_filters, query_scales
from qfserve.engine.filters.traffic import TrafficCalibration
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.selfcal import install_query_taps
from qfserve.engine.models.loading import default_model_path, load_model
from qfserve.engine.text.requests import Finished, GenerationRequest, SamplingParams
from tests.workers import complete, serving, worker_for


def prompts(tokenizer, n: int, words: int) -> list[list[int]]:
    return [
        tokenizer.encode(" ".join(f"item{(i * 7 + k) % 53} costs {k}" for k in range(words)))
        for i in range(n)
    ]


def cosines(a, b):
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_pooled_prompts_write_the_artifact_calibrate_would(drifted, tmp_path):
    model, _ = drifted
    loaded = load_model(str(default_model_path()))  # only its tokenizer
    seqs = prompts(loaded.tokenizer, 3, 60)
    # Enough is reached at the last prompt's last block, so the pool saw every prompt query
    # (and samples nearly all of them, as the reference does).
    samples = sum(map(len, seqs)) - (len(seqs[-1]) % 128 or 128) + 1
    n_kv = model.layers[0].self_attn.n_kv_heads
    reference = capture_queries(model, seqs, samples_per_head=samples, chunk_size=128, seed=7)
    ref_queries = [s.queries for s in reference]
    ref_filters, _ = compute_filters(ref_queries, n_kv)
    ref_scale = query_scales(ref_queries, ref_filters)
    # Sampling's tolerance: calibrate again on the same text with another seed.
    again = capture_queries(model, seqs, samples_per_head=samples, chunk_size=128, seed=8)
    tolerance = cosines(compute_filters([s.queries for s in again], n_kv)[0], ref_filters)

    taps = install_query_taps(model)
    pool = TrafficCalibration(
        taps, n_kv_heads=n_kv, model_id="test/traffic", fingerprint="fp-1",
        samples_per_head=samples, min_prompts=len(seqs), out_dir=tmp_path,
    )  # fmt: skip
    written = []
    for seq in seqs:  # served as prompts are: chunked prefill, then a few decode steps
        caches = make_caches(model, CacheConfig(method="full"))
        for start in range(0, len(seq), 128):
            model(mx.array(seq[start : start + 128])[None], cache=caches)
            mx.eval([c.state for c in caches])
            written.append(pool.flush())
        for _ in range(3):
            mx.eval(model(mx.array([[seq[-1]]]), cache=caches))
            assert pool.flush() is None  # decode steps offer nothing
    paths = [p for p in written if p is not None]
    assert len(paths) == 1 and written[-1] == paths[0]  # once, at the last block
    assert all(t.offer is None for t in taps)
    got = read_calibration(paths[0])
    assert got.model_id == "test/traffic" and got.metadata["weights"] == "fp-1"
    assert "from traffic" in got.metadata["text"] and got.metadata["samples_per_head"] == samples
    assert got.metadata["n_sequences"] == len(seqs)
    cos = cosines(got.filters, ref_filters)
    # The same filters, signs included, as close as calibration is to itself.
    assert cos.min() > 0.95 and cos.min() >= tolerance.min() - 0.02, (cos, tolerance)
    np.testing.assert_allclose(got.query_scale, ref_scale, rtol=0.1)


def test_one_long_prompt_does_not_set_the_filters(drifted, tmp_path):
    model, _ = drifted
    loaded = load_model(str(default_model_path()))  # only its tokenizer
    n_kv = model.layers[0].self_attn.n_kv_heads

    def serve(pool, seq):
        caches = make_caches(model, CacheConfig(method="full"))
        out = []
        for start in range(0, len(seq), 128):
            model(mx.array(seq[start : start + 128])[None], cache=caches)
            mx.eval([c.state for c in caches])
            out.append(pool.flush())
        return out

    long, *short = prompts(loaded.tokenizer, 4, 60)
    samples = len(long) // 2  # the first prompt alone holds twice the samples needed
    default = TrafficCalibration(
        install_query_taps(model), n_kv_heads=n_kv, model_id="test/one-prompt",
        fingerprint="fp-1", samples_per_head=samples, out_dir=tmp_path,
    )  # fmt: skip
    assert default.min_prompts == 20  # calibration's default number of sequences
    assert serve(default, long) == [None] * -(-len(long) // 128)
    assert default.tokens_seen >= samples and default.prompts == 1
    default.stop()

    pool = TrafficCalibration(
        install_query_taps(model), n_kv_heads=n_kv, model_id="test/one-prompt",
        fingerprint="fp-1", samples_per_head=samples, min_prompts=3, out_dir=tmp_path,
    )  # fmt: skip
    written = [p for seq in (long, *short) for p in serve(pool, seq)]
    paths = [p for p in written if p is not None]
    # Nothing until the third prompt's first block, though the samples were there long before.
    first_of_third = -(-len(long) // 128) + -(-len(short[0]) // 128)
    assert len(paths) == 1 and written.index(paths[0]) == first_of_third
    assert read_calibration(paths[0]).metadata["n_sequences"] == 3
    assert len(list(tmp_path.glob("*.safetensors"))) == 1


@pytest.mark.parametrize("mode, before", [("traffic", "fallback"), ("prompt", "self")])
def test_the_server_switches_to_the_filters_it_learned(mode, before, tmp_path, monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, str(tmp_path))
    loaded = load_model(str(default_model_path()))
    loaded = dataclasses.replace(loaded, model_id="test/learns-from-traffic")

    def run(worker, prompt):
        req = GenerationRequest(
            kind="completion",
            prompt=tuple(prompt),
            sampling=SamplingParams(max_tokens=3, temperature=0.0),
            cache=CacheConfig(method="qfilters", budget=48, recent=8),
        )
        final = complete(worker, req)
        assert isinstance(final, Finished), final
        return final.kv_cache["filter_source"]

    with serving(worker_for(loaded, self_calibration=mode, traffic_samples=500,
                                traffic_prompts=2)) as worker:  # fmt: skip
        first, second, third = prompts(loaded.tokenizer, 3, 40)
        assert len(first) + len(second) - 2 > 500 > len(first)  # the last token decodes
        # Until the artifact exists: the key-SVD fallback, or (prompt) the prompt's own filters.
        assert [run(worker, first), run(worker, second)] == [before, before]
        assert run(worker, third) == "calibrated"
        assert worker.filter_source == "calibrated"
    (path,) = tmp_path.glob("*.safetensors")
    assert "from traffic" in read_calibration(path).metadata["text"]
