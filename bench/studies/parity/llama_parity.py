"""Greedy text and log-probabilities against llama.cpp on the same GGUF file.

For each prompt: llama.cpp's greedy continuation (llama-cpp-python on llama.cpp's own
``libllama``, ``bench/reference/llama_cpp_tools.sh``) against the served model's, in
process; the mean |Δ log-probability| of llama.cpp's chosen tokens under both. Two
references: the file itself, whose quantized products llama.cpp computes on activations
rounded to 8 bits, and a float32 copy of it (``llama-quantize F32``: the same weights,
float32 products), whose gap to the file is llama.cpp's own rounding, the floor any other
implementation meets. Then through the server: every method's greedy text with a budget
above the prompt against the full cache's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.report import section, table
from bench.run import start
from bench.studies.vs.memory import requantized
from qfserve import testing

STUDY = "llama_parity"
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "In 1969, the first humans",
    "Water boils at",
    "The best way to learn a new language is",
    "Photosynthesis is the process by which",
    "Here is a list of prime numbers: 2, 3, 5,",
    "The meaning of life is",
)
METHODS = ("qfilters", "kvzip", "streaming", "knorm", "snapkv", "tova")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def llama_greedy(reference: Any, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy ``n`` tokens after ``ids`` and its log-probabilities of them."""
    reference.reset()
    reference.eval(ids)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(reference.scores[reference.n_tokens - 1])))
        reference.eval([out[-1]])
    logits = np.array(reference.scores[len(ids) - 1 : len(ids) + n - 1], dtype=np.float64)
    return out, _log_softmax(logits)[np.arange(n), out]


def llama_forced(reference: Any, ids: list[int], tokens: list[int]) -> np.ndarray:
    """llama.cpp's log-probabilities of ``tokens`` after ``ids`` (teacher-forced)."""
    reference.reset()
    reference.eval(ids + tokens[:-1])
    n = len(tokens)
    logits = np.array(reference.scores[len(ids) - 1 : len(ids) + n - 1], dtype=np.float64)
    return _log_softmax(logits)[np.arange(n), tokens]


def ours_greedy(model: Any, ids: list[int], n: int, theirs: list[int]) -> tuple[list[int], Any]:
    """Our greedy ``n`` tokens, and our log-probabilities of ``theirs`` (teacher-forced)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)
    out: list[int] = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    forced = model(mx.array([ids + theirs[:-1]]))[0, len(ids) - 1 :].astype(mx.float32)
    lp = _log_softmax(np.array(forced, dtype=np.float64))
    return out, lp[np.arange(n), theirs]


def compare(a: list[int], b: list[int], lp_a: np.ndarray, lp_b: np.ndarray) -> dict[str, Any]:
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    return {
        "identical": a == b,
        "first_difference": first,
        "mean_abs_dlogprob": float(np.abs(lp_a - lp_b).mean()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start(
        STUDY,
        argv,
        __doc__,
        tokens=(64, 8, "greedy tokens per prompt"),
        prompts=(len(PROMPTS), 2, "prompts"),
    )
    args = run.args
    llama_cpp = testing.llama_cpp_python()
    file = testing.gguf_of(args.model)
    if llama_cpp is None:
        raise SystemExit("needs llama-cpp-python (bench/reference/llama_cpp_tools.sh)")
    f32 = requantized(file, args.out / "derived", "F32")
    files = {"file": file, **({"f32 copy": f32} if f32 is not None else {})}
    n = args.tokens
    refs = {
        k: llama_cpp.Llama(str(p), n_ctx=512, logits_all=True, verbose=False)
        for k, p in files.items()
    }
    rows: list[dict[str, Any]] = []
    for prompt in PROMPTS[: args.prompts]:
        ids = refs["file"].tokenize(prompt.encode(), add_bos=True)
        if ids != run.tokenizer.encode(prompt):
            raise SystemExit(f"tokens differ from llama.cpp's on {prompt!r}")
        theirs = {k: llama_greedy(r, ids, n) for k, r in refs.items()}
        for ref, (tokens, lp) in theirs.items():
            mine, my_lp = ours_greedy(run.model, ids, n, tokens)
            rows.append(
                {
                    "prompt": prompt,
                    "pair": f"qfserve vs llama.cpp ({ref})",
                    **compare(mine, tokens, my_lp, lp),
                }
            )
        if "f32 copy" in theirs:  # llama.cpp against itself: the floor
            (a, lp_a), (b, _) = theirs["file"], theirs["f32 copy"]
            lp_b = llama_forced(refs["f32 copy"], ids, a)  # of the file's tokens, as ours
            rows.append(
                {
                    "prompt": prompt,
                    "pair": "llama.cpp (file) vs llama.cpp (f32 copy)",
                    **compare(a, b, lp_a, lp_b),
                }
            )
    pairs = {}
    for pair in dict.fromkeys(r["pair"] for r in rows):
        mine = [r for r in rows if r["pair"] == pair]
        pairs[pair] = {
            "identical": sum(r["identical"] for r in mine),
            "of": len(mine),
            "mean_abs_dlogprob": float(np.mean([r["mean_abs_dlogprob"] for r in mine])),
        }
    methods = methods_match(run, args.prompts, n)
    return run.save(
        {
            "tokens": n,
            "files": {k: str(p) for k, p in files.items()},
            "pairs": pairs,
            "rows": rows,
            "methods": methods,
        }
    )


def methods_match(run: Any, prompts: int, n: int) -> dict[str, int]:
    """Per method: prompts whose greedy text through the server, at a budget above the
    prompt, equals the full cache's."""
    log = Path(tempfile.mkdtemp(prefix="llama-parity-")) / "server.log"
    server = testing.start("qfserve", run.folder, log=log, timeout=600)
    try:
        (card,) = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]

        def text(prompt: str, fields: dict[str, Any]) -> str:
            body = {
                "model": card["id"],
                "prompt": prompt,
                "max_tokens": n,
                "temperature": 0,
                "qfilters_reuse": False,
                **fields,
            }
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=900)
            r.raise_for_status()
            return str(r.json()["choices"][0]["text"])

        full = {p: text(p, {"kv_method": "full"}) for p in PROMPTS[:prompts]}
        return {
            m: sum(text(p, {"kv_method": m, "qfilters_budget": 4096}) == full[p] for p in full)
            for m in METHODS
        }
    finally:
        testing.stop_all([server], 15)


def render(d: dict[str, Any]) -> list[str]:
    intro = (
        f"{d['tokens']} greedy tokens per prompt; mean |Δ log-prob| of llama.cpp's chosen "
        "tokens. The file's own arithmetic in llama.cpp rounds activations to 8 bits "
        "before quantized products; the f32 copy does not (the floor row compares "
        "llama.cpp with itself)."
    )
    rows = [
        [pair, f"{v['identical']}/{v['of']}", f"{v['mean_abs_dlogprob']:.4f}"]
        for pair, v in d["pairs"].items()
    ]
    n = len({r["prompt"] for r in d["rows"]})
    methods = [[m, f"{k}/{n}"] for m, k in d["methods"].items()]
    return section(
        "Greedy text against llama.cpp on the same file",
        d,
        intro,
        table(["pair", "identical continuations", "mean |Δ log-prob|"], rows),
        "Through the server, a budget above the prompt: greedy text equal to the full cache's",
        table(["method", "prompts"], methods),
    )
