"""``python -m bench <study> [options]`` runs one registered study; ``--list`` names them all.

MLX's CPU matmul needs OpenBLAS preloaded (~30x faster here), so the process re-executes once
with it before any study imports MLX; quality studies pin numpy's OpenBLAS to one thread."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from bench.studies import STUDIES, study


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("--list", "-h", "--help"):
        width = max(map(len, STUDIES))
        print("python -m bench <study> [--quick] [--model M] [--out DIR] [options]\n")
        for s in STUDIES.values():
            needs = f" (needs {s.needs})" if s.needs else ""
            print(f"  {s.name:<{width}}  {s.section:<7}  {s.question}{needs}")
            if s.modes:
                print(f"  {'':<{width}}           {s.option} {'|'.join(m for m, _ in s.modes)}")
        return 0 if argv else 2
    try:
        chosen = study(argv[0])
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if chosen.section == "quality":
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from qfserve.engine.models.blas import reexec_with_openblas

    reexec_with_openblas()
    chosen.main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
