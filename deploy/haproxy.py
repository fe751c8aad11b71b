"""Write deploy/haproxy.cfg for any number of qfserve replicas (to stdout).

    python deploy/haproxy.py 127.0.0.1:8001 127.0.0.1:8002 127.0.0.1:8003 > haproxy.cfg
    haproxy -f haproxy.cfg

Each address becomes ``server replica-<i> "${QFSERVE_REPLICA_<i>-<address>}"``: the address
is the default, the environment variable still overrides it. ``--bind`` sets the default
address the balancer listens on (``QFSERVE_BIND`` overrides it).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TEMPLATE = Path(__file__).with_name("haproxy.cfg")
MARKER = "    # replicas\n"


def render(addresses: list[str], bind: str | None = None, template: str | None = None) -> str:
    """The configuration with one ``server`` line per address, in order."""
    if not addresses:
        raise ValueError("addresses must name at least one replica, got none")
    text = TEMPLATE.read_text() if template is None else template
    head, _, tail = text.partition(MARKER)
    if not tail:
        raise ValueError(f"{TEMPLATE} has no {MARKER.strip()!r} line before its servers")
    servers = "".join(
        f'    server replica-{i} "${{QFSERVE_REPLICA_{i}-{address}}}"\n'
        for i, address in enumerate(addresses, 1)
    )
    rest = "".join(line for line in tail.splitlines(True) if not line.startswith("    server "))
    if bind is not None:
        head = re.sub(r'bind "\$\{QFSERVE_BIND-[^}]*\}"', f'bind "${{QFSERVE_BIND-{bind}}}"', head)
    return head + MARKER + servers + rest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("addresses", nargs="+", help="each replica's HOST:PORT")
    parser.add_argument("--bind", help="the balancer's HOST:PORT (default 127.0.0.1:8000)")
    args = parser.parse_args(argv)
    sys.stdout.write(render(args.addresses, args.bind))


if __name__ == "__main__":
    main()
