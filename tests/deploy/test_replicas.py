"""Replicas behind HAProxy with conversation affinity (deploy/haproxy.cfg, as shipped): two
qfserve servers on the bundled model and the balancer in front, all on loopback. Every later
turn of a conversation reaches the replica that served its first turn and continues the cache
kept there (``cached_tokens > 0``, and the replicas' own hit counts agree), while distinct
``prompt_cache_key``\\ s spread over both replicas; ``user`` is the fallback, then round robin.
The balancer names the replica that answered in ``X-Replica``."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress

import httpx
import pytest
import yaml

from qfserve import testing
from qfserve.testing import HOST, REPO, free_port

CONFIG = REPO / "deploy" / "haproxy.cfg"
MODEL = "qfserve-tiny"  # the bundled model: its answers re-tokenise as it generated them
HAPROXY = shutil.which("haproxy")
CONVERSATIONS, TURNS = 6, 3
QUESTIONS = ["What is the pass key?", "Say it again.", "And once more?"]


def haproxy_version() -> tuple[int, int]:
    out = subprocess.run([HAPROXY or "haproxy", "-v"], capture_output=True, text=True).stdout
    found = re.search(r"version (\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else (0, 0)


pytestmark = pytest.mark.skipif(
    HAPROXY is None or haproxy_version() < (2, 6),
    reason="needs HAProxy >= 2.6 on PATH (`balance hash`, `json_query`): apt-get install haproxy",
)


def haproxy_check(path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("where", ["loopback", "compose"])
def test_the_shipped_config_is_valid(where):
    """As shipped, and with docker-compose.yml's addresses (names that do not resolve here:
    those servers start disabled and are resolved again at run time)."""
    env = None
    if where == "compose":
        balancer = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
        env = {**os.environ, **balancer["balancer"]["environment"]}
    check = subprocess.run(
        [HAPROXY, "-c", "-f", str(CONFIG)], capture_output=True, text=True, env=env
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_config_is_written_for_any_number_of_replicas(tmp_path):
    def write(*args: str) -> str:
        script = [sys.executable, str(REPO / "deploy" / "haproxy.py"), *args]
        return subprocess.run(script, capture_output=True, text=True, check=True).stdout

    addresses = [f"{HOST}:{9001 + i}" for i in range(3)]
    text = write(*addresses, "--bind", f"{HOST}:9000")
    servers = re.findall(
        r'^    server (replica-\d) "\$\{QFSERVE_REPLICA_\d-([^}]+)\}"$', text, re.M
    )
    assert servers == [(f"replica-{i}", a) for i, a in enumerate(addresses, 1)]
    assert f'bind "${{QFSERVE_BIND-{HOST}:9000}}"' in text
    # The shipped file is the script's output for two replicas on the default ports.
    assert write(f"{HOST}:8001", f"{HOST}:8002") == CONFIG.read_text()
    (tmp_path / "three.cfg").write_text(text)
    check = haproxy_check(tmp_path / "three.cfg")
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[tuple[str, dict[str, testing.ServerProcess]]]:
    """(the balancer's URL, replica name -> that replica's server)."""
    logs = tmp_path_factory.mktemp("replicas")
    replicas = [
        testing.launch("qfserve", MODEL, "--drain-timeout", "2", log=logs / f"replica-{i}.log")
        for i in (1, 2)
    ]
    balancer = None
    try:
        for server in replicas:
            testing.wait_ready(server, 120)
        port = free_port()
        env = {
            "QFSERVE_BIND": f"{HOST}:{port}",
            **{f"QFSERVE_REPLICA_{i}": f"{HOST}:{s.port}" for i, s in enumerate(replicas, 1)},
        }
        with (logs / "haproxy.log").open("wb") as out:
            balancer = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(CONFIG)], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        url = f"http://{HOST}:{port}"
        deadline = time.monotonic() + 20
        while balancer.poll() is None and time.monotonic() < deadline:
            with suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        else:
            pytest.fail(f"haproxy did not answer:\n{(logs / 'haproxy.log').read_text()}")
        yield url, {f"replica-{i}": s for i, s in enumerate(replicas, 1)}
    finally:
        if balancer is not None:
            balancer.terminate()
            balancer.wait(10)
        testing.stop_all(replicas, 15)


def chat(url: str, messages: list[dict], **extra) -> tuple[str, str, int]:
    """One chat turn through the balancer: (answer, replica, cached_tokens)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=extra
    )
    resp = raw.parse()
    details = resp.usage.prompt_tokens_details
    return resp.choices[0].message.content or "", raw.headers["x-replica"], details.cached_tokens


def hits(replicas: dict[str, testing.ServerProcess]) -> dict[str, int]:
    """Each replica's own count of requests that continued a kept cache."""
    return {
        name: httpx.get(f"{s.url}/admin/cache", timeout=10).json()["prompt_cache"]["hits"]
        for name, s in replicas.items()
    }


def test_each_conversation_stays_on_its_replica_and_reuses_its_cache(deployment):
    url, replicas = deployment
    before = hits(replicas)
    served: dict[str, list[str]] = {}
    conversations = {
        f"conversation-{c}": [{"role": "user", "content": f"The pass key is {4000 + 17 * c}."}]
        for c in range(CONVERSATIONS)
    }
    for turn in range(TURNS):  # turn by turn, the conversations interleaved
        for key, messages in conversations.items():
            messages.append({"role": "user", "content": QUESTIONS[turn]})
            answer, replica, cached = chat(url, messages, prompt_cache_key=key)
            messages.append({"role": "assistant", "content": answer})
            served.setdefault(key, []).append(replica)
            assert (cached > 0) == (turn > 0), (key, turn, cached)
    for key, names in served.items():
        assert names == [names[0]] * TURNS, (key, names)
    first = [names[0] for names in served.values()]
    assert set(first) == set(replicas), served  # the keys spread over both replicas
    # Each replica continued exactly the later turns of the conversations it kept.
    after = hits(replicas)
    assert {n: after[n] - before[n] for n in replicas} == {
        n: (TURNS - 1) * first.count(n) for n in replicas
    }


def test_user_is_the_fallback_and_no_key_is_round_robin(deployment):
    url, replicas = deployment
    ask = [{"role": "user", "content": "Hello there."}]
    assert len({chat(url, ask, user="someone")[1] for _ in range(4)}) == 1
    # prompt_cache_key wins over user.
    keyed = {chat(url, ask, prompt_cache_key="conversation-0", user=f"u{i}")[1] for i in range(4)}
    assert len(keyed) == 1
    # Neither (an empty key counts as none): round robin.
    anonymous = [chat(url, ask, **extra)[1] for extra in ({}, {"prompt_cache_key": ""}, {}, {})]
    assert set(anonymous) == set(replicas), anonymous


def test_a_replica_that_stops_hands_its_conversations_to_the_other(deployment):
    """Last in this file: it stops a replica. Its conversations' next turns are answered by
    the other (a fresh prefill there), at once: a draining replica's 503 or a refused
    connection is retried on the other before the health checks notice; the other
    replica's own conversations still continue their caches."""
    url, replicas = deployment
    conversations = {
        f"failover-{c}": [{"role": "user", "content": f"Keep the number {7000 + c}."}]
        for c in range(CONVERSATIONS)
    }
    first = {}
    for key, messages in conversations.items():
        answer, first[key], _ = chat(url, messages, prompt_cache_key=key)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Again?"},
        ]
    assert set(first.values()) == set(replicas), first
    stopped = first["failover-0"]
    replicas[stopped].process.send_signal(signal.SIGTERM)  # drains, then exits
    for key, messages in conversations.items():
        _, replica, cached = chat(url, messages, prompt_cache_key=key)
        assert replica != stopped, key
        assert (cached > 0) == (first[key] == replica), (key, first[key], cached)
    assert replicas[stopped].process.wait(15) == 0
