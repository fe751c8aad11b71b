"""The bundled default: ``qfserve`` with no model argument serves models/qfserve-tiny with its
calibrated filters, and the shipped artifact belongs to exactly these weights."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import REPO, free_port

BUNDLED = REPO / "models" / "qfserve-tiny"
ARTIFACTS = REPO / "calibrations" / "artifacts"


def test_shipped_artifact_is_for_the_shipped_weights():
    import mlx_lm

    from calibrations.artifact import read_calibration
    from calibrations.model_info import attention_shape, weights_fingerprint
    from calibrations.registry import artifact_name, model_id_for

    model_id = model_id_for(BUNDLED)
    assert model_id == "qfserve/qfserve-tiny"
    calibration = read_calibration(ARTIFACTS / artifact_name(model_id))
    model, _ = mlx_lm.load(str(BUNDLED))
    assert calibration.model_id == model_id
    assert calibration.filters.shape == attention_shape(model)
    assert calibration.metadata["weights"] == weights_fingerprint(model)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """`qfserve --port N` from the repository root: no model, no calibration folder given."""
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if k != "QFSERVE_CALIBRATIONS"}
    env.update(XDG_CACHE_HOME=str(home), PYTHONUNBUFFERED="1")
    script = shutil.which("qfserve", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "server.cli"]
    port = free_port()
    log = home / "qfserve.log"
    process = subprocess.Popen(
        [*command, "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        process.kill()
        pytest.fail(f"qfserve did not start:\n{log.read_text(errors='replace')}")
    yield url
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0


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


def test_qfserve_without_arguments_answers_with_calibrated_filters(default_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = client.models.list().data
    assert model.id == "qfserve-tiny"
    resp = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "Hello!"}], temperature=0
    )
    kv = resp.model_extra["kv_cache"]
    assert resp.choices[0].message.content.strip()
    assert kv["method"] == "qfilters" and kv["filter_source"] == "calibrated"


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
