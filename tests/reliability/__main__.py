"""``python -m tests.reliability [--full] [pytest args]``: the reliability suite;
``python -m tests.reliability soak [--minutes N]``: the soak (``tests/reliability/soak.py``).

``--full`` runs the issue's sizes (slow: tens of minutes on two cores) and writes the figures
to ``bench/results/reliability.json``; without it, the CI size runs (what ``python3 -m pytest``
runs too) and the figures are printed.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.reliability.harness import ENV_SIZE, REPO


def main(argv: list[str]) -> int:
    if argv[:1] == ["soak"]:  # a long run of mixed traffic (tests/reliability/soak.py)
        from tests.reliability import soak

        return soak.main(argv[1:])
    env = dict(os.environ)
    if "--full" in argv:
        env[ENV_SIZE] = "full"
    args = [a for a in argv if a != "--full"]
    command = [sys.executable, "-m", "pytest", "tests/reliability", "-s", "-q", *args]
    return subprocess.call(command, cwd=REPO, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
