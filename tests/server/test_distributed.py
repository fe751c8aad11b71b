"""The bundled model split over two ranks (tensor parallelism over ``mx.distributed``'s ring
backend on loopback, started with the environment ``mlx.launch`` sets) answers as one process:
the same greedy text and, within float summation order, the same logprobs, for every arm,
streamed and not, alone and in a mixed batch. A follower that dies makes rank 0 fail its
requests and ``/health`` 503 within seconds; a model whose heads do not split is refused at
start-up, naming the counts."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Iterator

import httpx
import pytest

from qfserve import testing

MODEL = "qfserve-tiny"  # 4 query / 2 KV heads, 640 MLP units: splits over 2 ranks
PROMPTS = [
    "Tell me about the pass key in the story of the red fox and the old mill.",
    "Write three short sentences about Python lists and dictionaries.",
]
ARMS = {
    "full": {"kv_method": "full"},
    "qfilters": {"kv_method": "qfilters", "qfilters_budget": 16},
    "knorm": {"kv_method": "knorm", "qfilters_budget": 16},
    "kvzip": {"kv_method": "kvzip", "qfilters_budget": 16, "qfilters_budget_mode": "per_head"},
}
FLAGS = ("--max-batch", "4")


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[tuple[str, str, list[testing.ServerProcess]]]:
    """(one process's URL, rank 0's URL, the ranks)."""
    logs = tmp_path_factory.mktemp("distributed")
    threads = {"OPENBLAS_NUM_THREADS": str(testing.rank_threads(2)), **os.environ}
    single = testing.launch("qfserve", MODEL, *FLAGS, log=logs / "single.log", env=threads)
    ranks = testing.launch_ranks(2, MODEL, *FLAGS, logs=logs)
    try:
        for server in (single, *ranks[:1]):
            testing.wait_ready(server)
        yield single.url, ranks[0].url, ranks
    finally:
        testing.stop_all([single, *ranks], 20)


def chat(url: str, prompt: str, arm: str, **extra) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],  # extra["messages"] replaces it
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        **ARMS[arm],
        **extra,
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def assert_same(one: dict, two: dict) -> None:
    a, b = one["choices"][0], two["choices"][0]
    assert b["message"]["content"] == a["message"]["content"]
    la, lb = a["logprobs"]["content"], b["logprobs"]["content"]
    assert [t["token"] for t in lb] == [t["token"] for t in la]
    for x, y in zip(la, lb, strict=True):  # the sharded sums add in another order
        assert y["logprob"] == pytest.approx(x["logprob"], abs=2e-3)
    assert two["kv_cache"]["tokens_kept"] == one["kv_cache"]["tokens_kept"]


@pytest.mark.parametrize("arm", list(ARMS))
def test_two_ranks_answer_as_one_process(servers, arm):
    single, split, _ = servers
    for prompt in PROMPTS:
        assert_same(chat(single, prompt, arm), chat(split, prompt, arm))


def test_streamed_text_is_the_same(servers):
    single, split, _ = servers

    def streamed(url: str) -> str:
        from openai import OpenAI  # the SDK is the reference parser

        sdk = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body=ARMS["qfilters"],
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert streamed(split) == streamed(single)
    assert streamed(split)  # not empty


def test_a_mixed_batch_answers_each_as_alone(servers):
    single, split, _ = servers
    jobs = [(p, arm) for p in PROMPTS for arm in ("full", "qfilters", "knorm")]
    alone = [chat(single, p, arm) for p, arm in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: chat(split, *job), jobs))
    for one, two in zip(alone, together, strict=True):
        assert_same(one, two)


def test_kv_bytes_are_shown_per_rank_and_in_total(servers):
    _, split, _ = servers
    chat(split, PROMPTS[1], "full", max_tokens=4)
    view = httpx.get(split + "/admin/cache", timeout=10).json()["distributed"]
    assert view["ranks"] == 2 and [r["rank"] for r in view["per_rank"]] == [0, 1]
    kept = [r["kept_kv_bytes"] for r in view["per_rank"]]
    assert kept[0] == kept[1] > 0  # each rank keeps its own half of the heads
    assert view["total"]["kept_kv_bytes"] == sum(kept)


@pytest.mark.parametrize(("method", "mode"), [("qfilters", "adaptive"), ("kvzip", "global"),
                                             ("kvzip", None)])  # fmt: skip
def test_rows_shared_across_heads_are_refused(servers, method, mode):
    """Adaptive budgets, and KVzip's default of rows shared across layers and heads."""
    _, split, _ = servers
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "kv_method": method, "qfilters_budget": 8}  # fmt: skip
    if mode is not None:
        body["qfilters_budget_mode"] = mode
    response = httpx.post(split + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "qfilters_budget_mode" and "2 ranks" in error["message"]
    assert httpx.get(split + "/health", timeout=10).status_code == 200


def test_a_dead_follower_fails_requests_and_health_within_seconds(tmp_path):
    ranks = testing.launch_ranks(2, MODEL, logs=tmp_path)
    try:
        testing.wait_ready(ranks[0])
        url = ranks[0].url
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}],
                "max_tokens": 1500, "stream": True, "temperature": 0}  # fmt: skip
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert any(line.startswith("data: {") for line in lines)  # it is generating
            killed = time.monotonic()
            ranks[1].process.kill()
            rest = [line for line in lines if line]
        assert time.monotonic() - killed < 10
        errors = [line for line in rest if '"error"' in line]
        assert errors and "rank 1 of 2 stopped" in errors[0]
        assert rest[-1] == "data: [DONE]"
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and "rank 1 of 2" in health.json()["error"]["message"]
        again = httpx.post(url + "/v1/chat/completions", timeout=10,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert again.status_code == 503
    finally:
        testing.stop_all(ranks, 10)


def test_heads_that_do_not_split_are_refused_at_start(tmp_path):
    ranks = testing.launch_ranks(3, MODEL, logs=tmp_path)
    try:
        codes = [r.process.wait(120) for r in ranks]
    finally:
        testing.stop_all(ranks, 5)
    assert codes[0] == 1
    assert "4 attention heads, which do not split evenly over 3 ranks" in ranks[0].logs()


def test_structured_output_and_reuse_work_as_on_one_process(servers):
    """A JSON-schema answer, then a conversation's second turn continuing the first's kept
    caches (``cached_tokens > 0``) on every rank."""
    single, split, _ = servers
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    ask = {"response_format": fmt, "max_tokens": 48}
    one = chat(single, "Give me a number as JSON.", "qfilters", **ask)
    two = chat(split, "Give me a number as JSON.", "qfilters", **ask)
    assert_same(one, two)
    assert isinstance(json.loads(two["choices"][0]["message"]["content"])["n"], int)

    assert_same_conversations(conversation(single, "qfilters"), conversation(split, "qfilters"))


def conversation(url: str, arm: str, **extra) -> list[dict]:
    """Three turns of one conversation, each continuing the previous turn's kept caches."""
    messages = [{"role": "user", "content": PROMPTS[0]}]
    turns = []
    key = f"{url}/{arm}/{sorted(extra.items())}"
    for question in ("And the mill?", "Say it again.", ""):
        turns.append(chat(url, "", arm, messages=messages, prompt_cache_key=key, **extra))
        reply = turns[-1]["choices"][0]["message"]["content"]
        messages = [*messages, {"role": "assistant", "content": reply},
                    {"role": "user", "content": question or PROMPTS[1]}]  # fmt: skip
    return turns


def assert_same_conversations(alone: list[dict], together: list[dict]) -> None:
    for one, two in zip(alone, together, strict=True):
        assert_same(one, two)
    cached = [t["usage"]["prompt_tokens_details"]["cached_tokens"] for t in together]
    assert all(c > 0 for c in cached[1:])
    assert cached == [t["usage"]["prompt_tokens_details"]["cached_tokens"] for t in alone]


@pytest.mark.parametrize("extra", [{}, {"qfilters_n_sink": 0}], ids=["sinks", "no-sinks"])
def test_a_kvzip_conversation_answers_as_one_process(servers, extra):
    """KVzip per head over kept turns: each turn's new rows (the previous answer's, evicted
    head by head while it was generated, and the new prompt's) are scored by a reconstruction
    pass that starts at the first row no pass has scored; every rank must start it at the same
    position, though each holds other heads' rows, or the ranks feed different tokens."""
    single, split, _ = servers
    alone, together = conversation(single, "kvzip", **extra), conversation(split, "kvzip", **extra)
    assert_same_conversations(alone, together)
    assert together[-1]["kv_cache"]["evictions"] > 0


def test_ranks_with_other_settings_refuse_to_start_together(tmp_path):
    """Every decision must come out the same on every rank: a follower started with another
    batch size (here through its environment) stops the whole group at start-up."""
    ranks = testing.launch_ranks(2, MODEL, logs=tmp_path, rank_env={1: {"QFSERVE_MAX_BATCH": "3"}})
    try:
        codes = [r.process.wait(120) for r in ranks]
    finally:
        testing.stop_all(ranks, 5)
    assert codes == [1, 1]
    assert "rank 1 differs from rank 0 in: settings" in ranks[1].logs()
    assert "rank(s) 1 loaded another model, other filters or other settings" in ranks[0].logs()


@pytest.mark.parametrize(("flags", "says"), [
    (("--budget-mode", "adaptive"), "--budget-mode adaptive shares rows across KV heads"),
    (("--kv-method", "kvzip"), "--kv-method kvzip shares rows across layers and heads"),
])  # fmt: skip
def test_server_defaults_that_share_rows_across_heads_are_refused_at_start(tmp_path, flags, says):
    ranks = testing.launch_ranks(2, MODEL, *flags, logs=tmp_path)
    try:
        codes = [r.process.wait(120) for r in ranks]
    finally:
        testing.stop_all(ranks, 5)
    assert codes[0] == 1 and says in ranks[0].logs()
