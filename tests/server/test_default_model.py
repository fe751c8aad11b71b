"""``qfserve`` with no ``--model`` serves SmolLM2-135M-Instruct, a real assistant, with its
calibrated Q-Filters, through the official OpenAI SDK."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field

from qfserve.engine.models.gguf.convert import cache_root
from tests.server.conftest import start_server
from tests.server.test_bundled_model import isolated_env

README = Path(__file__).resolve().parents[2] / "README.md"
PASSKEY = "68203"
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
# About 2,000 tokens with the needle a third of the way in.
PASSKEY_PROMPT = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about the pass key.\n"
    + FILLER * 30
    + f"\nThe pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key.\n"
    + FILLER * 60
    + "\nWhat is the pass key? The pass key is"
)


@pytest.fixture(scope="module")
def default_server(smollm2_folder, tmp_path_factory):
    """The model is already fetched and converted (by the fixture) in qfserve's cache; the
    user's calibration folder is a fresh one, so the shipped artifact is what is found."""
    home = tmp_path_factory.mktemp("home")
    env = {**isolated_env(home), "QFSERVE_CACHE": str(cache_root())}
    server = start_server(None, home / "qfserve.log", env=env, console_script=True, timeout=180)
    yield server
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0


@pytest.fixture(scope="module")
def client(default_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_readme_curl_example_runs_verbatim_and_gets_a_real_answer(default_server):
    text = README.read_text()
    section = text[text.index("## Using the server") :]
    command = next(b for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S) if "curl " in b)
    result = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "QFSERVE_PORT": str(default_server.port)},
    )
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["object"] == "chat.completion" and body["model"] == "smollm2-135m-instruct"
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["kv_cache"]["budget"] == 128 and body["kv_cache"]["method"] == "qfilters"


def test_default_model_is_listed_under_its_stable_id(client):
    (model,) = client.models.list().data
    assert model.id == "smollm2-135m-instruct"
    assert model.model_extra["context_length"] == 8192


def test_default_model_answers_with_calibrated_filters(client):
    resp = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
        extra_body={"qfilters_budget": 512},
    )
    kv = resp.model_extra["kv_cache"]
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"  # stopped at <|im_end|>, not max_tokens
    assert kv["method"] == "qfilters" and kv["filter_source"] == "calibrated"


def test_default_model_retrieves_a_pass_key_from_2000_tokens(client):
    resp = client.completions.create(
        model="smollm2-135m-instruct",
        prompt=PASSKEY_PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"kv_method": "full"},
    )
    assert 1800 <= resp.usage.prompt_tokens <= 2300
    assert resp.choices[0].text.strip().startswith(PASSKEY), resp.choices[0].text


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict mode has
    # Bounded fields: a valid answer always fits in max_tokens (an unbounded number or
    # string lets a sampled small model go on until the limit cuts the JSON short).
    name: str = Field(pattern=r"^[A-Za-z .'-]{1,30}$")
    country: str = Field(pattern=r"^[A-Za-z .'-]{1,30}$")
    population: int = Field(ge=0, le=100_000_000)


def test_sdk_parse_returns_a_parsed_object(client):
    completion = client.chat.completions.parse(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name


@pytest.mark.parametrize("stream", [False, True])
def test_sampled_structured_output_always_validates(client, stream):
    """10 sampled requests per mode (20 in all) at temperature 0.8 with a budget of 128."""
    schema = City.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    for seed in range(10):
        kwargs = dict(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": f"Describe a city (number {seed}) as JSON."}],
            response_format=fmt,
            temperature=0.8,
            seed=seed,
            max_tokens=120,
            extra_body={"qfilters_budget": 128, "qfilters_recent": 32},
        )
        if stream:
            chunks = client.chat.completions.create(stream=True, **kwargs)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        assert text.endswith("}"), text
        jsonschema.validate(json.loads(text), schema)


def test_smollm2_calls_tools_through_the_generic_format(client):
    """SmolLM2's template has no tool support: the tools are described in a system message
    and a required call is decoded under the grammar; the SDK parses what comes back."""
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    resp = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The weather in a city",
                    "parameters": parameters,
                },
            }
        ],
        tool_choice="required",
        temperature=0,
        max_tokens=48,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, parameters)
    assert "paris" in arguments["city"].lower()


CITIES = ("Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Rome", "Delhi", "Sydney", "Boston", "Madrid")
USUAL = {  # as most clients send it: no additionalProperties
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": USUAL,
    },
}


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_with_the_usual_schema_close(client, choice):
    """Compiled strictly, the usual schema gives SmolLM2 a call the SDK parses on every prompt
    (before, the grammar let it nest undeclared properties until max_tokens)."""
    for city in CITIES:
        resp = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": f"What is the weather in {city}?"}],
            tools=[WEATHER_TOOL],
            tool_choice=choice,
            temperature=0,
            max_tokens=48,
        )
        message = resp.choices[0].message
        assert resp.choices[0].finish_reason == "tool_calls", (city, message)
        (call,) = message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str), arguments
        assert not message.content


def test_auto_still_answers_in_text(client):
    resp = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        temperature=0,
        max_tokens=32,
    )
    message = resp.choices[0].message
    assert not message.tool_calls and message.content and "<tool_call>" not in message.content
