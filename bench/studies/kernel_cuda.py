"""The fused eviction kernel on an NVIDIA GPU without MLX: parity, then timing against top-k.

MLX's CUDA text compiled by CuPy on PyTorch tensors, checked bit for bit against a numpy
stable argsort and timed against ``torch.topk`` + sort + gather."""

from __future__ import annotations

import json
import platform
import statistics
import sys
from functools import partial

import numpy as np

from bench.cli import parse, parser
from bench.run import write_results
from bench.timing import interleave, summaries
from qfserve.kernels import sources
from qfserve.kernels.cpu_model import fused_evict_model

GROUPS, BUDGET, HEAD_DIM, N_SINK, RECENT = 32, 512, 128, 4, 64
ROWS = (4096, 16384)
KERNELS = [(sources.SCORE, "float16", "float16"), (sources.APPLY, "float16", "float16")]


def argsort_keep(scores: np.ndarray, budget: int, n_sink: int, recent: int) -> np.ndarray:
    """``(G, budget)`` ascending rows kept per group of ``(G, L)`` float32 ``scores``: stable
    argsort of the ranked scores, ties to the lower row."""
    L = scores.shape[-1]
    rows = np.arange(L)
    ranked = np.where(np.isnan(scores), -np.inf, scores.astype(np.float64))
    ranked = np.where((rows < n_sink) | (rows >= L - recent), np.inf, ranked)
    return np.sort(np.argsort(-ranked, axis=-1, kind="stable")[:, :budget], axis=-1)


def cpu_self_check() -> None:
    """The reference path, the kernel model and the CUDA text, all on the CPU."""
    rng = np.random.default_rng(0)
    for kind in ("random", "ties"):
        G, L, D = 4, 300, 8
        scores = rng.standard_normal((G, L)).astype(np.float32)
        if kind == "ties":
            scores = np.round(scores)
        keys = rng.standard_normal((G, L, D)).astype(np.float16)
        k, _, s = fused_evict_model(keys, keys, scores, budget=64, n_sink=N_SINK, recent=RECENT)
        want = argsort_keep(scores, 64, N_SINK, RECENT)
        take = np.arange(G)[:, None]
        if not (np.array_equal(k, keys[take, want]) and np.array_equal(s, scores[take, want])):
            sys.exit(f"self-check failed: kernel model != argsort reference ({kind} scores)")
    source = sources.cuda_module_source(KERNELS)
    print(f"CPU self-check passed: model == reference; CUDA module text {len(source)} chars")


def require_cuda():
    """torch and cupy with a visible GPU, or exit with the reason."""
    try:
        import torch
    except ImportError:
        sys.exit("kernel_cuda: PyTorch is not installed; it is needed for tensors and the baseline")
    if not torch.cuda.is_available():
        sys.exit("kernel_cuda: CUDA is not available here (torch.cuda.is_available() is False)")
    try:
        import cupy
    except ImportError:
        sys.exit("kernel_cuda: CuPy is not installed; pip install cupy-cuda12x (match the driver)")
    return torch, cupy


def ranked_torch(torch, scores, n_sink: int, recent: int):
    L = scores.shape[-1]
    rows = torch.arange(L, device=scores.device)
    ranked = torch.where(torch.isnan(scores), -torch.inf, scores)
    return torch.where((rows < n_sink) | (rows >= L - recent), torch.inf, ranked)


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__, reps=50)
    p.add_argument("--cpu-reference-only", action="store_true", help="no GPU: self-check")
    args = parse(p, argv)
    cpu_self_check()
    if args.cpu_reference_only:
        return {"cpu_reference_only": "passed"}
    torch, cupy = require_cuda()
    dev = torch.device("cuda")
    module = cupy.RawModule(code=sources.cuda_module_source(KERNELS), options=("--std=c++17",))
    apply_fn = module.get_function(sources.cuda_kernel_name(sources.APPLY, "float16", "float16"))
    score_fn = module.get_function(sources.cuda_kernel_name(sources.SCORE, "float16"))

    def kernel_apply(keys, values, scores, thresh, L):
        out_k = torch.empty((GROUPS, BUDGET, HEAD_DIM), dtype=keys.dtype, device=dev)
        out_v = torch.empty_like(out_k)
        out_s = torch.empty((GROUPS, BUDGET), dtype=torch.float32, device=dev)
        params = torch.tensor(
            [L, HEAD_DIM, HEAD_DIM, BUDGET, N_SINK, RECENT], dtype=torch.int32, device=dev
        )
        bufs = [keys, values, scores, thresh, params, out_k, out_v, out_s]
        apply_fn((GROUPS,), (sources.DEFAULT_THREADS,), tuple(cupy.asarray(b) for b in bufs))
        return out_k, out_v, out_s

    def threshold(scores, L):
        ranked = ranked_torch(torch, scores, N_SINK, RECENT)
        return torch.kthvalue(ranked, L - BUDGET + 1, dim=-1).values.contiguous()

    def kernel_path(keys, values, scores, L):  # as in MLX: a selection primitive, then apply
        return kernel_apply(keys, values, scores, threshold(scores, L), L)

    def topk_path(keys, values, scores, L):
        ranked = ranked_torch(torch, scores, N_SINK, RECENT)
        idx = torch.topk(ranked, BUDGET, dim=-1, sorted=False).indices.sort(dim=-1).values
        gather = idx[..., None].expand(-1, -1, HEAD_DIM)
        return keys.gather(1, gather), values.gather(1, gather), scores.gather(1, idx)

    def timed(fn, *a):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*a)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3  # microseconds

    results = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for L in ROWS:
        keys = torch.randn((GROUPS, L, HEAD_DIM), generator=gen, device=dev).half()
        values = torch.randn((GROUPS, L, HEAD_DIM), generator=gen, device=dev).half()
        filters = torch.randn((GROUPS, HEAD_DIM), generator=gen, device=dev)
        scores = torch.empty((GROUPS, L), dtype=torch.float32, device=dev)
        params = torch.tensor([L, HEAD_DIM, 0, 0, GROUPS], dtype=torch.int32, device=dev)
        score_threads = sources.SCORE_ROWS_PER_GROUP * sources.SIMD_WIDTH
        score_fn(
            (-(-GROUPS * L * sources.SIMD_WIDTH // score_threads),),
            (score_threads,),
            tuple(cupy.asarray(b) for b in (keys, filters, params, scores)),
        )
        torch.cuda.synchronize()
        want_scores = (keys.float() @ filters[..., None]).squeeze(-1)
        scores_close = bool(torch.allclose(scores, want_scores, rtol=1e-4, atol=1e-2))

        parity = {}
        for kind, s in (("random", scores), ("ties", torch.round(scores / 8))):
            got = kernel_path(keys, values, s, L)
            torch.cuda.synchronize()
            s_np = s.cpu().numpy()
            kept = np.arange(GROUPS)[:, None], argsort_keep(s_np, BUDGET, N_SINK, RECENT)
            # Bit for bit: keys and values as float16 bits, scores as float32 bits.
            expected = [
                (keys.cpu().numpy()[kept], np.uint16),
                (values.cpu().numpy()[kept], np.uint16),
                (s_np[kept], np.uint32),
            ]
            parity[kind] = all(
                np.array_equal(g.cpu().numpy().view(bits), w.view(bits))
                for g, (w, bits) in zip(got, expected, strict=True)
            )

        thresh = threshold(scores, L)
        arms = {
            "topk_sort_gather": partial(timed, topk_path, keys, values, scores, L),
            "kernel_threshold_and_apply": partial(timed, kernel_path, keys, values, scores, L),
            "kernel_apply_only": partial(timed, kernel_apply, keys, values, scores, thresh, L),
            "topk_sort_gather_again": partial(timed, topk_path, keys, values, scores, L),
        }
        samples = interleave(arms, reps=args.reps, warmup=5)
        base = samples["topk_sort_gather"]
        results.append(
            {
                "rows": L,
                "parity_bitwise": parity,
                "score_kernel_allclose": scores_close,
                "microseconds": summaries(samples),
                "speedup_vs_topk_median": {
                    name: statistics.median(b / a for a, b in zip(v, base, strict=True))
                    for name, v in samples.items()
                },
            }
        )
        print(json.dumps(results[-1]["microseconds"], indent=1))
        print(f"L={L} parity={parity} scores_close={scores_close}")

    payload = {
        "machine": {
            "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cupy": cupy.__version__,
        },
        "config": {
            "groups": GROUPS,
            "budget": BUDGET,
            "head_dim": HEAD_DIM,
            "n_sink": N_SINK,
            "recent": RECENT,
            "dtype": "float16",
            "threads": sources.DEFAULT_THREADS,
            "max_budget": sources.MAX_BUDGET,
            "reps": args.reps,
            "timing": "CUDA events around each call, arms interleaved; A/A pair = topk twice",
        },
        "results": results,
    }
    payload = write_results("kernel_cuda", args, argv, payload)
    if not all(all(r["parity_bitwise"].values()) for r in results):
        sys.exit("kernel_cuda: parity FAILED (see the JSON)")
    return payload
