"""The server's default chunk: chunks of 8 for scored methods at budgets of 256 or more,
token by token elsewhere, unless the server's flag or the request says otherwise."""

from __future__ import annotations

import pytest

from qfserve.engine.kv.config import SERVED_CHUNK, ConfigError
from qfserve.server.errors import APIError
from qfserve.server.schemas import CompletionRequest
from qfserve.server.settings import Settings


def config(settings: Settings, **body):
    request = CompletionRequest.model_validate({"model": "m", "prompt": "hi", **body})
    return request.cache_config(settings)[0]


def test_the_served_default_is_8_where_it_was_measured():
    assert SERVED_CHUNK == 8
    assert Settings().cache_defaults().chunk == 8  # qfilters, budget 512
    assert Settings(budget=255).cache_defaults().chunk == 1
    assert Settings(kv_method="knorm", budget=256).cache_defaults().chunk == 8
    for method in ("streaming", "snapkv", "tova", "full"):  # a server started with any method
        assert Settings(kv_method=method).cache_defaults().chunk == 1


def test_a_request_gets_the_default_chunk_where_it_applies_to_its_own_settings():
    s = Settings()
    assert config(s).chunk == 8
    assert config(s, kv_method="knorm", qfilters_budget=300).chunk == 8
    assert config(s, qfilters_budget=64).chunk == 1  # below the measured budgets
    for method in ("streaming", "snapkv", "tova", "full"):  # none is a 400
        assert config(s, kv_method=method).chunk == 1
    assert config(s, qfilters_chunk=1).chunk == 1  # what a request sends wins
    assert config(s, qfilters_budget=64, qfilters_chunk=4).chunk == 4
    with pytest.raises(APIError) as err:  # ...and is still validated
        config(s, kv_method="tova", qfilters_chunk=4)
    assert err.value.status == 400 and err.value.param == "qfilters_chunk"


def test_the_default_follows_the_requests_own_method_and_budget_not_the_servers():
    for server in (
        Settings(kv_method="streaming"),
        Settings(kv_method="tova"),
        Settings(budget=128),
    ):
        assert server.cache_defaults().chunk == 1
        assert config(server, kv_method="qfilters", qfilters_budget=512).chunk == 8


def test_the_servers_flag_sets_the_default_and_an_impossible_one_is_refused():
    assert config(Settings(chunk=1)).chunk == 1
    assert config(Settings(chunk=4)).chunk == 4
    assert config(Settings(chunk=4), kv_method="tova").chunk == 1  # it applies where it can
    # Given outright, the flag applies at any budget above it, as /admin/cache reports it.
    small = Settings(budget=128, chunk=4)
    assert small.cache_defaults().chunk == 4 and config(small).chunk == 4
    assert config(small, qfilters_budget=4, qfilters_n_sink=1).chunk == 1  # must be below it
    with pytest.raises(ConfigError, match="chunk must be 1"):  # asked for outright: refused
        Settings(kv_method="tova", chunk=4)


@pytest.mark.parametrize("method", ["kvzip", "kvzap"])
def test_kvzip_and_kvzap_share_rows_across_layers_unless_told_otherwise(method):
    s = Settings()
    assert config(s, kv_method=method).budget_mode == "global"
    assert config(s, kv_method=method, qfilters_budget_mode="per_head").budget_mode == "per_head"
    if method == "kvzap":  # a threshold bounds each head: per head then
        assert config(s, kv_method=method, kvzap_threshold=-5.0).budget_mode == "per_head"
    assert config(s, kv_method="kvzip").budget_mode == "global"
    assert config(s, kv_method="kvzip", qfilters_budget_mode="per_head").budget_mode == "per_head"
    assert config(s).budget_mode == "per_head"  # the default method is unchanged
    assert Settings(kv_method="kvzip").cache_defaults().budget_mode == "global"
    # A server defaulting to global still serves the other methods per head.
    shared = Settings(budget_mode="global")
    assert config(shared).budget_mode == "per_head"
    assert config(shared, kv_method="kvzip").budget_mode == "global"
    for body, param in (
        ({"kv_method": "kvzip", "qfilters_chunk": 4}, "qfilters_chunk"),
        ({"kv_method": "qfilters", "qfilters_budget_mode": "global"}, "qfilters_budget_mode"),
    ):
        with pytest.raises(APIError) as err:
            config(s, **body)
        assert err.value.status == 400 and err.value.param == param
