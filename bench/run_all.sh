#!/usr/bin/env bash
# Every study at full size on the bundled model, one after another, then the results page.
# Usage: bench/run_all.sh [quality|speed|all]   (about 1 hour for all on a 2-core CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
which="${1:-all}"
run() { echo "== python -m $*"; python -m "$@"; }
if [[ "$which" == quality || "$which" == all ]]; then
    run bench.quality.geometry
    run bench.quality.attention
    run bench.quality.perplexity
    run bench.quality.retrieval
    run bench.quality.stability
fi
if [[ "$which" == speed || "$which" == all ]]; then
    run bench.speed.decode
    run bench.speed.ttft --reps 7
    run bench.speed.server_overhead --reps 11
    run bench.speed.vs_mlx_lm --reps 15
    run bench.speed.bandwidth --reps 11
fi
run bench.report
