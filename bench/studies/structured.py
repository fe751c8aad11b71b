"""What constrained decoding costs per token: a JSON schema through llguidance vs free text
(and through outlines-core where it is installed)."""

from __future__ import annotations

import importlib.util
import json
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from bench.report import ms, section, table
from bench.run import start
from bench.timing import interleave, ratio_row, summaries, summary
from qfserve.engine.text.structured import GrammarProcessor, JSONConstraint

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "summary": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "summary", "tags"],
}
RATIOS = {
    "schema/free": "schema",
    "free_again/free (A/A)": "free_again",
    "schema_outlines/free": "schema_outlines",
}


def outlines_processor(tokenizer: Any) -> Any:
    """:data:`SCHEMA` as an mlx-lm logits processor built on outlines-core's index."""
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    eos = min(tokenizer.eos_token_ids)
    vocab: dict[str, list[int]] = {}
    for text, i in tokenizer._tokenizer.get_vocab().items():
        if i != eos:
            vocab.setdefault(text, []).append(i)
    index = oc.Index(build_regex_from_schema(json.dumps(SCHEMA)), oc.Vocabulary(eos, vocab))
    guide, seen = oc.Guide(index), [0]

    def process(tokens: Any, logits: Any) -> Any:
        for token in tokens.tolist()[seen[0] :] if seen[0] else ():
            guide.advance(token)
        seen[0] = tokens.size
        allowed = np.zeros(logits.shape[-1], dtype=np.bool_)
        allowed[guide.get_tokens()] = True
        return mx.where(mx.array(allowed), logits, -mx.inf)

    return process


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start("structured", argv, __doc__, reps=9, tokens=(48, 8, "decode steps per repetition"))
    args = sm.args
    messages = [{"role": "user", "content": "Describe the Python language as JSON."}]
    prompt = mx.array(sm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    inside: dict[str, list[float]] = {}  # library: ms per token in its processor, each run
    grammars = {
        "llguidance": lambda: GrammarProcessor(sm.tokenizer, JSONConstraint(json.dumps(SCHEMA))),
        "outlines-core": lambda: outlines_processor(sm.tokenizer),
    }

    def run(library: str | None) -> float:
        """ms per decode step after the first token, constrained by ``library``'s processor."""
        grammar, spent = grammars[library]() if library else None, [0.0]

        def timed(tokens: Any, logits: Any) -> Any:
            mx.eval(tokens, logits)  # the model's step is not the processor's time
            t = time.perf_counter()
            out = grammar(tokens, logits)
            mx.eval(out)
            spent[0] += time.perf_counter() - t
            return out

        steps = generate_step(
            prompt,
            sm.model,
            max_tokens=args.tokens,
            sampler=make_sampler(0.0),
            logits_processors=[timed] if grammar else [],
        )
        next(steps)  # the prefill and first token: not a decode step
        tic, spent[0] = time.perf_counter(), 0.0
        n = sum(1 for _ in steps)
        if n < 1:
            raise SystemExit("structured: need --tokens >= 2")
        if library:
            inside.setdefault(library, []).append(spent[0] / n * 1000)
        return (time.perf_counter() - tic) / n * 1000

    arms = {
        "free": lambda: run(None),
        "free_again": lambda: run(None),
        "schema": lambda: run("llguidance"),
    }
    if importlib.util.find_spec("outlines_core") is not None:
        arms["schema_outlines"] = lambda: run("outlines-core")
    samples = interleave(arms, args.reps, progress=sm.log.rounds("arms"))
    ratios = {k: ratio_row(samples, a, "free") for k, a in RATIOS.items() if a in samples}
    by_library = {lib: summary(v[-args.reps :]) for lib, v in inside.items()}  # no warm-up
    return sm.save(
        {
            "steps": args.tokens,
            "reps": args.reps,
            "schema": SCHEMA,
            "ms_per_token": summaries(samples),
            "ratios": ratios,
            "processor_ms_per_token": by_library["llguidance"],
            "processor_ms_per_token_by_library": by_library,
            "grammar_engine": "llguidance",
        }
    )


def render(d: dict[str, Any]) -> list[str]:
    r, aa = d["ratios"]["schema/free"], d["ratios"]["free_again/free (A/A)"]
    outlines = d["ratios"].get("schema_outlines/free")  # where outlines-core was installed
    inside = d["processor_ms_per_token_by_library"].items()
    arms = [[arm, ms(s, digits=1)] for arm, s in d["ms_per_token"].items()]
    intro = (
        f"Greedy decode, {d['reps']} interleaved repetitions of {d['steps']} tokens, "
        f"served grammar engine {d['grammar_engine']}."
    )
    cost = (
        f"llguidance (served) schema/free = **{r['median']:.3f}** [{r['q1']:.3f}–"
        f"{r['q3']:.3f}] (A/A {aa['median']:.3f})"
        + ("" if outlines is None else f"; outlines-core schema/free = {outlines['median']:.3f}")
        + ". Time inside the grammar processor per token: "
        + ", ".join(f"{lib} {v['median']:.2f} ms" for lib, v in inside)
        + "."
    )
    title = "Structured output: what a JSON-schema constraint costs per token"
    return [*section(title, d, intro, table(["arm", "ms/token median [q1–q3]"], arms), cost), ""]
