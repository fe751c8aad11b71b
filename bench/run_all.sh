#!/usr/bin/env bash
# Every study on the default model (SmolLM2-135M-Instruct), one after another, then the
# results page. Each study is sized to about an hour or less on a 2-core CPU (the long
# quality studies append to a JSONL and resume where they stopped); results go to
# bench/results/smollm2/. Run one at a time: timings are read as interleaved ratios, but a
# second study on the same cores still adds noise.
# Usage: bench/run_all.sh [quality|speed|all]
set -euo pipefail
cd "$(dirname "$0")/.."
which="${1:-all}"
run() { echo "== python -m bench $*"; python -m bench "$@"; }
if [[ "$which" == quality || "$which" == all ]]; then
    run retrieval --calibration registry --lengths 1024 4096 8192 \
        --ratios 2 4 8 16 32 --per-bin 2 --recent-fracs 0.25
    run retrieval --haystack prose --calibration registry
    run perplexity --calibration registry
    run multiturn-recall
fi
if [[ "$which" == speed || "$which" == all ]]; then
    run decode
    run prefill-cost --mode ttft
    run vs --against llama-cpp --prompts 256 2048 4096 8096 || echo "vs --against llama-cpp needs llama-cpp-python[server]"
    run batching
    # After the packed step's in-place joins and leaves: 256-token prompts, two rounds a row.
    run batching --prompts 256 --streams 1 8 16 --reps 2 \
        --out bench/results/smollm2/batching_16
    run decode --mode batch
fi
python -m bench.report
