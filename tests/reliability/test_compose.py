"""docker-compose.dev.yml and its Dockerfile, checked without a Docker engine: the compose file
parses, and everything it and the Dockerfile reference exists in the repository."""

from __future__ import annotations

import fnmatch
import shlex
from pathlib import Path

import yaml

from tests.reliability.harness import REPO

COMPOSE = REPO / "docker-compose.dev.yml"


def service() -> dict:
    doc = yaml.safe_load(COMPOSE.read_text())
    return doc["services"]["qfserve"]


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore excludes ``rel`` (last matching pattern wins, ``!`` re-includes)."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, f"**/{pattern}")
               for p in prefixes):  # fmt: skip
            result = not negate
    return result


def test_compose_builds_the_dockerfile_and_binds_loopback_only():
    svc = service()
    context = (REPO / svc["build"]["context"]).resolve()
    assert context == REPO
    assert (context / svc["build"]["dockerfile"]).is_file()
    assert svc["ports"] == ["127.0.0.1:8000:8000"]  # host side: loopback only
    command = svc["command"]
    assert command[command.index("--host") + 1] == "0.0.0.0"  # container side: explicit
    assert command[command.index("--port") + 1] == "8000"


def test_compose_mounts_calibrations_and_checks_health():
    svc = service()
    mounts = dict(v.split(":", 1) for v in svc["volumes"])
    container = svc["environment"]["QFSERVE_CALIBRATIONS"]
    assert container in mounts.values()
    for host in mounts:
        assert (REPO / host).is_dir(), host
    test = " ".join(svc["healthcheck"]["test"])
    assert "/health" in test and "127.0.0.1:8000" in test
    grace = int(svc["stop_grace_period"].rstrip("s"))
    drain = float(svc["command"][svc["command"].index("--drain-timeout") + 1])
    assert grace > drain  # the drain finishes before Docker kills the container


def test_dockerfile_references_exist_and_survive_dockerignore():
    steps = dockerfile_instructions(REPO / service()["build"]["dockerfile"])
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = [shlex.split(args) for word, args in steps if word == "COPY"]
    assert copies
    for args in copies:
        for source in args[:-1]:
            assert (REPO / source).exists(), source
            assert not ignored(source, patterns), f"{source} is excluded by .dockerignore"
    assert not ignored("models/qfserve-tiny/model.safetensors", patterns)
    assert ignored("tests/tiny.py", patterns) and ignored(".git", patterns)
    runs = " ".join(args for word, args in steps if word == "RUN")
    assert "libopenblas0-pthread" in runs and "pip install -e ." in runs
    cmd = next(args for word, args in steps if word == "CMD")
    assert '"--host", "0.0.0.0"' in cmd
    # mlx[cpu] comes from pyproject's platform marker, not from the Dockerfile.
    assert "mlx[cpu]==" in (REPO / "pyproject.toml").read_text()
