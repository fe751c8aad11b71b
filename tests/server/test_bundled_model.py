"""The bundled tiny model: ``qfserve --model qfserve-tiny`` serves models/qfserve-tiny offline
with its calibrated filters, and the shipped artifact belongs to exactly these weights."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.caches import fresh_cache
from tests.server.conftest import REPO, start_server

BUNDLED = REPO / "models" / "qfserve-tiny"
ARTIFACTS = REPO / "qfserve" / "calibrations" / "artifacts"


def test_shipped_artifact_is_for_the_shipped_weights():
    import mlx_lm

    from qfserve.calibrations.artifact import read_calibration
    from qfserve.calibrations.model_info import attention_shape, weights_fingerprint
    from qfserve.calibrations.registry import artifact_name, model_id_for

    model_id = model_id_for(BUNDLED)
    assert model_id == "qfserve/qfserve-tiny"
    calibration = read_calibration(ARTIFACTS / artifact_name(model_id))
    model, _ = mlx_lm.load(str(BUNDLED))
    assert calibration.model_id == model_id
    assert calibration.filters.shape == attention_shape(model)
    assert calibration.metadata["weights"] == weights_fingerprint(model)


def isolated_env(home: Path) -> dict[str, str]:
    """This environment minus calibration folders, with a fresh user cache under ``home``."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("QFSERVE_CALIBRATIONS", "QFSERVE_CACHE")
    }
    env["XDG_CACHE_HOME"] = str(fresh_cache(home))
    return env


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """`qfserve --model qfserve-tiny --port N` from the repository root, no calibration folder."""
    home = tmp_path_factory.mktemp("home")
    server = start_server(
        "qfserve-tiny",
        home / "qfserve.log",
        env=isolated_env(home),
        console_script=True,
        timeout=120,
    )
    yield server.url
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0


PASSKEY = "40817"
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
PASSKEY_PROMPT = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about the pass key.\n"
    + FILLER * 8
    + f"\nThe pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key.\n"
    + FILLER * 8
    + "\nWhat is the pass key? The pass key is"
)


def test_qfserve_tiny_answers_with_calibrated_filters(default_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = client.models.list().data
    assert model.id == "qfserve-tiny"
    resp = client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": "Hello!"}],
        temperature=0,
        extra_body={"qfilters_budget": 512},
    )
    kv = resp.model_extra["kv_cache"]
    assert resp.choices[0].message.content.strip()
    assert kv["method"] == "qfilters" and kv["filter_source"] == "calibrated"


def test_adaptive_budgets_run_on_calibrated_filters_and_share_the_layer(default_server):
    """The bundled calibration records query scales (format version 2), so adaptive budgets
    run; statistics say what ran and the layer kept budget x heads rows."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=60)
    resp = client.completions.create(
        model="qfserve-tiny",
        prompt=PASSKEY_PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={
            "qfilters_budget": 64,
            "qfilters_budget_mode": "adaptive",
            "qfilters_floor": 0.5,
        },
    )
    kv = resp.model_extra["kv_cache"]
    assert (kv["budget_mode"], kv["floor"], kv["filter_source"]) == ("adaptive", 0.5, "calibrated")
    assert kv["tokens_kept"] == 64 and kv["evictions"] > 0
    assert kv["tokens_seen"] == resp.usage.prompt_tokens + 4  # one step ahead, as mlx-lm


def test_a_kvzap_threshold_evicts_below_the_budget_and_says_so(default_server):
    """The shipped surrogates score every row; a threshold above most scores keeps fewer rows
    than the budget, and ``kv_cache`` echoes the threshold and the compression reached."""
    from openai import OpenAI

    from qfserve.engine.kv.kvzap import decode_room

    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=60)
    kept = {}
    for threshold in (None, 0.0):
        resp = client.completions.create(
            model="qfserve-tiny",
            prompt=PASSKEY_PROMPT,
            max_tokens=4,
            temperature=0,
            extra_body={"kv_method": "kvzap", "qfilters_budget": 256, "kvzap_threshold": threshold},
        )
        kv = resp.model_extra["kv_cache"]
        assert (kv["method"], kv["threshold"], kv["budget"]) == ("kvzap", threshold, 256)
        kept[threshold] = (kv["tokens_kept"], kv["compression_ratio"])
    # The budget alone (the prompt is longer), the rows shared across layers by default: and
    # the decode rows stored beside the shares since the last share.
    assert 256 <= kept[None][0] <= 256 + decode_room(256)
    assert kept[0.0][0] < 256 and kept[0.0][1] > kept[None][1] > 1


def test_the_server_evicts_with_kvzap_where_the_model_has_surrogates(default_server):
    """``--kv-method auto`` (the default) on the bundled model, which ships KVzap
    surrogates: the routes report kvzap as the method of requests that send none."""
    status = httpx.get(f"{default_server}/v1/status").json()
    admin = httpx.get(f"{default_server}/admin/cache").json()
    assert status["defaults"]["kv_method"] == admin["defaults"]["method"] == "kvzap"


def test_kvzap_shares_rows_across_layers_through_the_server(default_server):
    """``qfilters_budget_mode: global`` with kvzap: the layers share the request's rows by
    the shipped surrogates' scores (one layer keeps more than the budget, another fewer, their
    mean within it), and a budget above the prompt answers as the full cache."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=60)

    def ask(**fields):
        resp = client.completions.create(
            model="qfserve-tiny",
            prompt=PASSKEY_PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body=fields,
        )
        return resp.choices[0].text, resp.model_extra["kv_cache"]

    full, _ = ask(kv_method="full")
    text, kv = ask(kv_method="kvzap", qfilters_budget=1024, qfilters_budget_mode="global")
    assert text == full and kv["budget_mode"] == "global"
    _, kv = ask(kv_method="kvzap", qfilters_budget=64, qfilters_budget_mode="global")
    assert (kv["method"], kv["budget_mode"], kv["budget"]) == ("kvzap", "global", 64)
    assert 0 < kv["tokens_kept"] <= 64 + 8  # the mean over layers, and the decoded rows


@pytest.mark.parametrize("method", ["full", "qfilters"])
def test_the_served_model_retrieves_a_pass_key(default_server, method):
    """About 450 prompt tokens under the default budget of 512: nothing is evicted, so both
    caches hold the whole prompt and the model's own retrieval is what is tested."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=60)
    resp = client.completions.create(
        model="qfserve-tiny",
        prompt=PASSKEY_PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"kv_method": method},
    )
    assert resp.usage.prompt_tokens < 512
    assert resp.choices[0].text.strip().startswith(PASSKEY), resp.choices[0].text


def test_a_second_chat_turn_continues_the_first_turns_cache(default_server):
    """Multi-turn reuse through the OpenAI SDK (its own parser reads
    ``usage.prompt_tokens_details.cached_tokens``), with eviction running."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=60)
    budget = {"qfilters_budget": 64, "qfilters_recent": 16}
    first = [{"role": "user", "content": PASSKEY_PROMPT}]
    one = client.chat.completions.create(
        model="qfserve-tiny", messages=first, temperature=0, extra_body=budget
    )
    assert one.choices[0].finish_reason == "stop"  # EOS: the answer ends as the template ends it
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    second = [
        *first,
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "What is the pass key again?"},
    ]

    def turn(**extra):
        return client.chat.completions.create(
            model="qfserve-tiny", messages=second, max_tokens=4, temperature=0,
            extra_body={**budget, **extra},
        )  # fmt: skip

    assert turn(qfilters_reuse=False).usage.prompt_tokens_details.cached_tokens == 0
    reused = turn()
    # Turn one's prompt and answer (its EOS included), as the template renders them again.
    cached = reused.usage.prompt_tokens_details.cached_tokens
    assert cached == one.usage.prompt_tokens + one.usage.completion_tokens
    assert cached < reused.usage.prompt_tokens
    assert reused.model_extra["kv_cache"]["tokens_kept"] <= 64
    admin = httpx.get(f"{default_server}/admin/cache").json()["prompt_cache"]
    assert admin["enabled"] and admin["hits"] >= 1
    assert any(e["settings"]["budget"] == 64 for e in admin["entries"])
    other = client.chat.completions.create(  # other settings never continue that cache
        model="qfserve-tiny", messages=second, max_tokens=4, temperature=0,
        extra_body={"qfilters_budget": 96},
    )  # fmt: skip
    assert other.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("stream", [False, True])
def test_kvzip_compresses_a_prompt_over_its_budget_and_says_so(default_server, stream):
    """kv_method kvzip through the SDK. Without reuse the prompt (about 450 tokens) is
    reconstructed and evicted to 64 rows per head on average, its rows shared across layers
    by default; with reuse (the default) the turn answers on its full cache, as the full
    cache does, and is compressed only when kept."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=60)

    def ask(**extra):
        kwargs = dict(model="qfserve-tiny", prompt=PASSKEY_PROMPT, max_tokens=6, temperature=0)
        if not stream:
            resp = client.completions.create(**kwargs, extra_body=extra)
            return resp.choices[0].text, resp.model_extra["kv_cache"]
        chunks = list(client.completions.create(**kwargs, extra_body=extra, stream=True))
        return "".join(c.choices[0].text for c in chunks if c.choices), None

    settings = {"kv_method": "kvzip", "qfilters_budget": 64, "qfilters_recent": 8}
    _, kv = ask(**settings, qfilters_reuse=False)
    if kv is not None:
        assert (kv["method"], kv["budget_mode"]) == ("kvzip", "global")
        assert kv["evictions"] > 0 and kv["tokens_kept"] <= 64 < kv["tokens_seen"]
    held, kv = ask(**settings)
    if kv is not None:
        assert kv["evictions"] == 0 and kv["tokens_kept"] == kv["tokens_seen"]
    roomy, _ = ask(kv_method="kvzip", qfilters_budget=1024, qfilters_reuse=False)
    full, _ = ask(kv_method="full")
    assert roomy == full == held
