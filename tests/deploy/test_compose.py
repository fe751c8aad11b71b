"""docker-compose.yml's `replicas` profile, checked without a Docker engine: two qfserve
replicas built from the Dockerfile and reached only through HAProxy, which runs
deploy/haproxy.cfg with one address per replica (tests/deploy/test_replicas.py runs that
file on loopback)."""

from __future__ import annotations

import re

import yaml

from qfserve.testing import REPO

COMPOSE = REPO / "docker-compose.yml"
CONFIG = REPO / "deploy" / "haproxy.cfg"
HAPROXY_CONFIG = "/usr/local/etc/haproxy/haproxy.cfg"  # where the haproxy image reads it


def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def replicas() -> dict:
    return {name: svc for name, svc in services().items() if name.startswith("replica-")}


def test_every_service_is_in_the_replicas_profile():
    assert set(services()) == {"balancer", *replicas()} and len(replicas()) == 2
    for svc in services().values():
        assert svc["profiles"] == ["replicas"]


def test_replicas_build_the_image_and_are_reached_through_the_balancer_only():
    dev = yaml.safe_load((REPO / "docker-compose.dev.yml").read_text())["services"]["qfserve"]
    for svc in replicas().values():
        assert (REPO / svc["build"]["context"]).resolve() == REPO
        assert svc["build"] == dev["build"] and svc["image"] == dev["image"]
        assert "ports" not in svc  # nothing published on the host
        command = svc["command"]
        assert command[command.index("--host") + 1] == "0.0.0.0"
        assert command[command.index("--port") + 1] == "8000"
        test = " ".join(svc["healthcheck"]["test"])
        assert "/health" in test and "127.0.0.1:8000" in test
        grace = int(svc["stop_grace_period"].rstrip("s"))
        assert grace > float(command[command.index("--drain-timeout") + 1])
        for mount in svc["volumes"]:
            assert (REPO / mount.split(":")[0]).is_dir(), mount


def test_the_balancer_runs_the_shipped_config_with_one_address_per_replica():
    balancer = services()["balancer"]
    image, _, tag = balancer["image"].partition(":")
    assert image == "haproxy" and tuple(map(int, tag.split(".")[:2])) >= (2, 6)
    assert balancer["ports"] == ["127.0.0.1:8000:8000"]  # host side: loopback only
    assert balancer["environment"]["QFSERVE_BIND"] == "0.0.0.0:8000"
    host, container, *_ = balancer["volumes"][0].split(":")
    assert (REPO / host).resolve() == CONFIG and container == HAPROXY_CONFIG
    # One server line per replica, each address from QFSERVE_REPLICA_<i>: that replica's port.
    servers = re.findall(r'^    server \S+ "\$\{(QFSERVE_REPLICA_\d+)-', CONFIG.read_text(), re.M)
    addresses = {balancer["environment"][var] for var in servers}
    assert addresses == {f"{name}:8000" for name in replicas()}
    assert balancer["depends_on"] == {name: {"condition": "service_healthy"} for name in replicas()}
