"""Resident memory against llama.cpp's server, same GGUF file, same context, 2 threads.

Each file is served by qfserve (``-c`` the context; default settings: a request keeps its
full cache while it fits) and by llama.cpp's ``llama-server`` (``-c`` the same, ``-np 1``:
one slot, the memory a single user's server needs), started together. The resident set
(RSS, from ``/proc``) of each process is read once it is ready, after a ~2k-token request
and after a request that fills the context; qfserve's own accounting (``/admin/cache``:
the weights as held, the KV the request kept) is recorded beside it. Goals: ours at most
1.6x theirs after the 2k request, and at most the file + the KV held + 350 MB.

What holding only codes costs is measured beside it, in this process: a product on
SmolLM2's shapes at each bit width, for a decode step's rows and a prompt's, through the
native kernel (in registers for few rows, dequantized tiles into the BLAS for many) against
the float32 product it replaced (the BLAS, the float32 weight held) and MLX's own CPU
quantized product (the codes, no native kernel); interleaved, with an A/A row.

``--files`` takes GGUF files; by default the default model's file and, where llama.cpp's
``llama-quantize`` is built (``bench/reference/llama_cpp_tools.sh``), its Q4_K_M made from
it with ``--allow-requantize`` (the format most users download).
"""

from __future__ import annotations

import itertools
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import clients, timing
from bench.data import chat_content
from bench.report import by_arm, ms, ratio_cell, section, table
from bench.run import start
from bench.timing import timed
from qfserve import testing as servers

MIB = 2**20
GOAL_RATIO, GOAL_OVERHEAD = 1.6, 350 * 10**6
HEADERS = [
    "file",
    "when",
    "ours RSS MiB",
    "theirs RSS MiB",
    "ratio",
    "ours weights MiB",
    "ours KV MiB",
    "file + KV + 350 MB",
    "goals",
]
LOAD_HEADERS = ["file", "file MB", "conversion s (once)", "ours ready s", "theirs ready s"]


def requantized(source: Path, out: Path, kind: str) -> Path | None:
    """``source`` requantized to ``kind`` (``Q4_K_M``, ``F32`` ...) by llama.cpp's own
    ``llama-quantize`` (kept in ``out``), or ``None`` where the tool is not built."""
    tool = servers.llama_tool("llama-quantize")
    target = out / f"{source.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if target.is_file() or tool is None:
        return target if target.is_file() else None
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [str(tool), "--allow-requantize", str(source), str(target), kind],
        check=True,
        capture_output=True,
    )
    return target


def ask(client: httpx.Client, url: str, run: Any, tokens: int, model: str) -> None:
    body = {
        "model": model,
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": chat_content(run, tokens, "")}],
    }
    r = client.post(url + "/v1/chat/completions", json=body, timeout=900)
    r.raise_for_status()


def measure(
    run: Any, file: Path, context: int, lengths: list[int], ours: list[str]
) -> list[dict[str, Any]]:
    """Time to ready of each server alone (qfserve's conversion of the file done before, once,
    and timed), then RSS of both when ready and after each request length."""
    from qfserve.engine.models.gguf.convert import converted_folder

    tic = time.perf_counter()
    converted_folder(file)  # what a first start does once; later starts find the folder
    conversion_s = time.perf_counter() - tic
    flags = {
        "qfserve": ["-c", str(context), *ours],
        "llama_server": ["-c", str(context), "-np", "1"],
    }
    rows, started, ready_s = [], [], {}
    logs = Path(tempfile.mkdtemp(prefix="memory-"))  # the servers' logs: read on failure only
    try:
        for kind in ("qfserve", "llama_server"):
            tic = time.perf_counter()
            started.append(
                servers.start(
                    kind,
                    file,
                    *flags[kind],
                    log=logs / f"{kind}.log",
                    timeout=600,
                    log_level="warning" if kind == "qfserve" else None,
                )
            )
            ready_s[kind] = time.perf_counter() - tic
        (ours, theirs), pids = [p.url for p in started], [p.pid for p in started]
        with httpx.Client() as client:
            name = clients.served_model(client, ours)
            for when in ["ready", *lengths]:
                if when != "ready":
                    run.log(f"{file.name}: {when}-token request to each")
                    ask(client, ours, run, int(when), name)
                    ask(client, theirs, run, int(when), str(file))
                rows.append(row(client, ours, file, when, pids, conversion_s, ready_s))
                run.log(
                    f"{file.name} {when}: ours {rows[-1]['ours_rss'] / MIB:.0f} MiB, "
                    f"theirs {rows[-1]['theirs_rss'] / MIB:.0f} MiB"
                )
    finally:
        servers.stop_all(started, 10)
    return rows


def row(
    client: httpx.Client,
    ours: str,
    file: Path,
    when: Any,
    pids: list[int],
    conversion_s: float,
    ready_s: dict[str, float],
) -> dict[str, Any]:
    """Both servers' RSS now, and qfserve's own accounting of its weights and last KV."""
    admin = client.get(ours + "/admin/cache").json()
    totals, last = admin["totals"], (admin["history"] or [{}])[0]
    kv = int(last.get("kept_bytes", 0)) if when != "ready" else 0
    ours_rss, theirs_rss = clients.rss_bytes(pids[0]), clients.rss_bytes(pids[1])
    bound = file.stat().st_size + kv + GOAL_OVERHEAD
    return {
        "file": file.name,
        "file_bytes": file.stat().st_size,
        "when": when,
        "ours_rss": ours_rss,
        "theirs_rss": theirs_rss,
        "ratio": ours_rss / theirs_rss,
        "weights_bytes": totals["weights_bytes"],
        "kv_bytes": kv,
        "bound": bound,
        "meets_ratio": ours_rss <= GOAL_RATIO * theirs_rss,
        "meets_bound": ours_rss <= bound,
        "conversion_s": conversion_s,
        "ours_ready_s": ready_s["qfserve"],
        "theirs_ready_s": ready_s["llama_server"],
    }


PRODUCT_SHAPES = ((576, 576), (1536, 576), (576, 1536))  # SmolLM2's (out, in) products
PRODUCT_HEADERS = [
    "(out, in)",
    "bits",
    "rows",
    "float32 ms",
    "codes ms",
    "MLX quantized ms",
    "codes / float32",
    "MLX / float32",
    "A/A",
]


def product_arms(kernel: Any, x: Any, codes: tuple, dense: Any, bits: int) -> dict[str, Any]:
    """``x @ W.T`` three ways: float32 (twice, the A/A pair), the kernel on the codes, MLX's
    own quantized product on them."""
    import mlx.core as mx

    f32 = timed(lambda: x @ dense.T)
    return {
        "float32_a": f32,
        "codes": timed(lambda: kernel.quantized_matmul(x, *codes, bits)),
        "mlx_quantized": timed(
            lambda: mx.quantized_matmul(x, *codes, transpose=True, group_size=32, bits=bits)
        ),
        "float32_b": f32,
    }


def products(run: Any, rows: list[int]) -> list[dict[str, Any]]:
    """Time ``x @ W.T`` three ways on random weights of each shape and bit width."""
    import mlx.core as mx

    from qfserve.engine.models.gguf.convert import cache_root
    from qfserve.kernels import native

    kernel = native.load(cache_root() / "native")
    if kernel is None:
        return []
    out = []
    for (n, k), bits, m in itertools.product(PRODUCT_SHAPES, (4, 5, 6, 8), rows):
        w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=32, bits=bits)
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        dense = mx.dequantize(w, scales, biases, group_size=32, bits=bits)
        x = mx.random.normal((m, k))
        mx.eval(w, scales, biases, dense, x)
        arms = product_arms(kernel, x, (w, scales, biases), dense, bits)
        _, stats, ratio = timing.compare_arms(run, arms, f"{n}x{k} {bits}b {m}", "float32_a")
        out.append(
            {
                "shape": [n, k],
                "bits": bits,
                "rows": m,
                "ms": stats,
                "ratios": by_arm(ratio),
            }
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start(
        "memory",
        argv,
        __doc__ or "",
        context=(8192, 2048, "context (-c)"),
        lengths=([2048, 8000], [512], "request tokens"),
        reps=7,
        product_rows=([1, 8, 512], [1, 64], "rows of the timed products"),
        flags={
            "--files": {
                "nargs": "+",
                "type": Path,
                "default": None,
                "help": "GGUF files (default: see above)",
            },
            "--qfserve-flags": {"default": "", "help": "more flags for qfserve (one string)"},
        },
    )
    args = run.args
    files = args.files
    if not files:
        default = servers.gguf_of(args.model)
        derived = None if args.quick else requantized(default, args.out / "derived", "Q4_K_M")
        files = [default] + ([derived] if derived else [])
    result = {"products": products(run, args.product_rows)}
    ours = args.qfserve_flags.split() if args.qfserve_flags else []
    rows = [r for f in files for r in measure(run, Path(f), args.context, args.lengths, ours)]
    result |= {
        "settings": {
            "context": args.context,
            "lengths": args.lengths,
            "files": [str(f) for f in files],
            "host": servers.HOST,
            "theirs": "llama-server -c <context> -np 1 -t <cores>",
            "ours": f"qfserve -c <context> {' '.join(ours)}".strip(),
        },
        "rows": rows,
    }
    return run.save(result)


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"RSS of each server process (`/proc/<pid>/status`), same GGUF file and context "
        f"({s['context']}); theirs: `{s['theirs']}`; ours: `{s['ours']}`. Goals: ours <= "
        f"{GOAL_RATIO}x theirs after the 2k request, and <= the file + the KV held + 350 MB."
    )
    rows = [
        [
            r["file"],
            r["when"],
            f"{r['ours_rss'] / MIB:,.0f}",
            f"{r['theirs_rss'] / MIB:,.0f}",
            f"{r['ratio']:.2f}x",
            f"{r['weights_bytes'] / MIB:,.0f}",
            f"{r['kv_bytes'] / MIB:,.0f}",
            f"{r['bound'] / MIB:,.0f}",
            ("ratio met" if r["meets_ratio"] else "ratio NOT met")
            + ", "
            + ("bound met" if r["meets_bound"] else "bound NOT met"),
        ]
        for r in d["rows"]
    ]
    files = {r["file"]: r for r in d["rows"]}
    load = [
        [
            f,
            f"{r['file_bytes'] / 1e6:,.0f}",
            f"{r['conversion_s']:.1f}",
            f"{r['ours_ready_s']:.1f}",
            f"{r['theirs_ready_s']:.1f}",
        ]
        for f, r in files.items()
    ]
    cost = [
        [
            f"({p['shape'][0]}, {p['shape'][1]})",
            p["bits"],
            p["rows"],
            ms(p["ms"]["float32_a"], 1e3, 3),
            ms(p["ms"]["codes"], 1e3, 3),
            ms(p["ms"]["mlx_quantized"], 1e3, 3),
            ratio_cell(p["ratios"]["codes"]),
            ratio_cell(p["ratios"]["mlx_quantized"]),
            ratio_cell(p["ratios"]["float32_b"]),
        ]
        for p in d.get("products", [])
    ]
    return section(
        "Resident memory against llama.cpp's server",
        d,
        intro,
        table(HEADERS, rows),
        "Start-up, each server alone (ours finds the converted folder):",
        table(LOAD_HEADERS, load),
        "What holding codes costs, per product (this process; medians [IQR] of "
        "interleaved rounds, ratios to the float32 product it replaced):",
        table(PRODUCT_HEADERS, cost),
    )
