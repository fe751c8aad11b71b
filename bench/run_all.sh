#!/usr/bin/env bash
# Every study on the default model (SmolLM2-135M-Instruct), one after another, then the
# results page. Each study is sized to about an hour or less on a 2-core CPU (the long
# quality studies append to a JSONL and resume where they stopped); results go to
# bench/results/smollm2/. Run one at a time: timings are read as interleaved ratios, but a
# second study on the same cores still adds noise.
# Usage: bench/run_all.sh [quality|speed|refinements|selfcal|all]
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
if [[ "$which" == selfcal || "$which" == all ]]; then
    # Without the artifact: Q-Filters from each prompt's own queries beside the calibrated
    # ones, the key-SVD fallback, the query-aware references, K-norm and streaming.
    out=bench/results/smollm2/selfcal
    run retrieval --calibration registry --lengths 1024 2048 4096 --ratios 2 4 8 16 \
        --per-bin 2 --recent-fracs 0.25 --self-calibrated --out "$out" \
        --only qfilters/r25 self/r25 fallback/r25 knorm/r25 streaming/r0
    # SnapKV and TOVA, which read the model's own queries, beside them on the same documents.
    run retrieval --calibration registry --lengths 1024 2048 4096 --ratios 2 4 8 16 \
        --per-bin 2 --recent-fracs 0.25 --self-calibrated --query-aware \
        --out bench/results/smollm2/query_aware --only qfilters/r25 self/r25 fallback/r25 \
        snapkv/r25 tova/r25 knorm/r25 streaming/r0
    # SnapKV's observation window: its default 32 tokens against the question's last 8.
    run retrieval --calibration registry --lengths 1024 2048 4096 --ratios 2 4 8 16 \
        --per-bin 2 --recent-fracs 0.25 --query-aware --snapkv-windows 8 \
        --out bench/results/smollm2/query_aware/window8 --only snapkv/r25 snapkv/r25/w8
    # The same comparison on 8k-token documents (no direct-way check: a prefill per arm).
    run retrieval --calibration registry --lengths 8192 --ratios 2 4 8 16 \
        --per-bin 2 --recent-fracs 0.25 --self-calibrated --query-aware --snapkv-windows 8 \
        --no-prefill-check --out bench/results/smollm2/query_aware/8k --only qfilters/r25 \
        self/r25 fallback/r25 snapkv/r25 snapkv/r25/w8 tova/r25 knorm/r25 streaming/r0
    # The filters the server learned from traffic without an artifact (its default; the
    # settled traffic study wrote them, bench/ARCHIVE.md), retrieving beside the others.
    t=bench/results/smollm2/traffic
    learned=(--traffic-artifacts
             chat=$t/chat/HuggingFaceTB--SmolLM2-135M-Instruct.safetensors
             passkey=$t/passkey/HuggingFaceTB--SmolLM2-135M-Instruct.safetensors)
    run retrieval --calibration registry --lengths 1024 2048 4096 --ratios 2 4 8 16 \
        --per-bin 2 --recent-fracs 0.25 --self-calibrated --no-prefill-check "${learned[@]}" \
        --only qfilters/r25 traffic/r25/chat traffic/r25/passkey self/r25 fallback/r25 \
        streaming/r0 --out "$t"
    run retrieval --calibration registry --lengths 8192 --ratios 2 4 8 16 \
        --per-bin 2 --recent-fracs 0.25 --self-calibrated --no-prefill-check "${learned[@]}" \
        --only qfilters/r25 traffic/r25/chat traffic/r25/passkey self/r25 fallback/r25 \
        streaming/r0 --out "$t/8k"
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
if [[ "$which" == refinements || "$which" == all ]]; then
    # Chunk-level selection and head-adaptive budgets beside plain Q-Filters, K-norm and
    # streaming: pass key and prose needle at 2k/4k, 2x-16x; perplexity at 256-1,024.
    out=bench/results/smollm2/refinements
    arms=(--chunks 4 8 16 --adaptive --only qfilters/r25 qfilters/r25/c4 qfilters/r25/c8
          qfilters/r25/c16 qfilters/r25/ada qfilters/r25/c8/ada knorm/r25 streaming/r0)
    run retrieval --calibration registry --lengths 2048 4096 --ratios 2 4 8 16 \
        --per-bin 2 --recent-fracs 0.25 --out "$out" "${arms[@]}"
    run retrieval --haystack prose --calibration registry --lengths 2048 4096 --ratios 2 4 8 16 \
        --out "$out" "${arms[@]}"
    run perplexity --calibration registry --out "$out" "${arms[@]}"
fi
python -m bench.report
