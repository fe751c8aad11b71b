"""llama-server's spellings (``-m``, ``-c``, ``-a``, ``-np``) mean what they mean there, every
flag has its ``QFSERVE_*`` variable, and a served GGUF file is listed under its file name."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from qfserve.engine.serving.config import EngineConfig
from qfserve.server.settings import EnvDefaults, Settings, make_parser, settings_from_args
from tests.gguf_files import write_tiny_gguf
from tests.server.conftest import start_server, stop_server


def parse(*argv: str, env=None) -> Settings:
    return settings_from_args(make_parser(env).parse_args(list(argv)))


def test_llama_server_spellings_set_the_same_fields():
    short = parse("-m", "x.gguf", "-c", "1024", "-a", "mine", "-np", "3")
    long = parse("--model", "x.gguf", "--ctx-size", "1024", "--alias", "mine", "--parallel", "3")
    assert (
        short
        == long
        == parse("--model", "x.gguf", "--ctx-size", "1024", "--alias", "mine", "--max-batch", "3")
    )
    assert (short.model, short.ctx_size, short.alias, short.max_batch) == (
        "x.gguf",
        1024,
        "mine",
        3,
    )


def test_every_flag_is_a_field_and_has_an_environment_variable(monkeypatch):
    parser = make_parser()
    fields = {f.name for f in dataclasses.fields(Settings)}
    dests = {a.dest for a in parser._actions if a.option_strings} - {"help", "version"}
    assert dests <= fields  # a flag cannot exist without the setting it sets
    assert dests == set(EnvDefaults.model_fields)
    for name, value, expected in (
        ("QFSERVE_BUDGET", "auto", "auto"),
        ("QFSERVE_BUDGET", "256", 256),
        ("QFSERVE_CTX_SIZE", "512", 512),
        ("QFSERVE_MAX_BATCH", "2", 2),
        ("QFSERVE_ALIAS", "named", "named"),
    ):
        monkeypatch.setenv(name, value)
        field = name.removeprefix("QFSERVE_").lower()
        assert getattr(parse(env=EnvDefaults()), field) == expected
    assert parse("--budget", "128", env=EnvDefaults()).budget == 128  # the flag wins


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "lots"], "budget must be 'auto' or an integer"),
        (["-c", "0"], "ctx_size must be >= 1"),
        (["-np", "0"], "max_batch must be >= 1"),
        (["--budget", "4", "--n-sink", "4"], "n_sink + recent must be < budget"),
    ],
)
def test_bad_values_are_refused_naming_the_setting(argv, message):
    with pytest.raises((ValueError, SystemExit)) as exc:
        parse(*argv)
    if exc.type is not SystemExit:
        assert message in str(exc.value)


def test_ctx_size_beyond_the_model_is_refused():
    from qfserve.engine.models.loading import load_model, served_as

    loaded = load_model("qfserve-tiny")
    assert served_as(loaded, None, 512).context_length == 512
    assert served_as(loaded, "x", None).name == "x"
    with pytest.raises(ValueError, match="--ctx-size 4096 exceeds"):
        served_as(loaded, None, 4096)
    assert EngineConfig(ctx_size=None).ctx_size is None


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(model := folder / "MySmol.Q4_1.gguf")
    server = start_server(model, folder / "server.log", "-c", "256", "-np", "2")
    yield server
    stop_server(server)


def test_a_gguf_file_is_served_under_its_name_with_the_context_asked(gguf_server):
    (card,) = httpx.get(f"{gguf_server.url}/v1/models").json()["data"]
    assert card["id"] == "MySmol.Q4_1" and card["context_length"] == 256
    body = {"model": "MySmol.Q4_1", "prompt": "hello " * 300, "max_tokens": 1}
    resp = httpx.post(f"{gguf_server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and "context is 256 tokens" in resp.json()["error"]["message"]
    admin = httpx.get(f"{gguf_server.url}/admin/cache").json()
    assert admin["totals"]["max_batch"] == 2
    # --kv-method auto on a model without KVzap surrogates: Q-Filters, as both routes say.
    status = httpx.get(f"{gguf_server.url}/v1/status").json()
    assert status["defaults"]["kv_method"] == admin["defaults"]["method"] == "qfilters"


def _vnni() -> bool:
    from qfserve.engine.models.gguf.convert import cache_root
    from qfserve.kernels import native

    kernel = native.load(cache_root() / "native")
    return kernel is not None and bool(kernel.integer_activations)


def test_decode_activations_are_reported_as_in_effect(gguf_server, tmp_path):
    """The default (31-bit integers on a CPU with VNNI or AVX2, else float32) and int8 on request, as
    /v1/status and /admin/cache report them; a name outside the choices is refused."""
    status = httpx.get(f"{gguf_server.url}/v1/status").json()
    assert status["decode_activations"] == ("int32" if _vnni() else "float32")
    write_tiny_gguf(model := tmp_path / "file.gguf")
    server = start_server(model, tmp_path / "server.log", "--decode-activations", "int8")
    try:
        expected = "int8" if _vnni() else "float32"
        assert httpx.get(f"{server.url}/v1/status").json()["decode_activations"] == expected
        admin = httpx.get(f"{server.url}/admin/cache").json()
        assert admin["totals"]["decode_activations"] == expected
        body = {"model": "file", "prompt": "hi", "max_tokens": 3}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        stop_server(server)
    with pytest.raises(SystemExit):
        parse("--decode-activations", "int4")
    with pytest.raises(ValueError, match="decode_activations must be one of int32, int16"):
        EngineConfig(decode_activations="int4")


def test_alias_names_the_served_model(tmp_path):
    write_tiny_gguf(model := tmp_path / "file.gguf")
    server = start_server(model, tmp_path / "server.log", "--alias", "house-model")
    try:
        (card,) = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert card["id"] == "house-model"
        body = {"model": "house-model", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        stop_server(server)
