"""What constrained decoding costs per token: a JSON schema through llguidance vs free text.

One chat prompt, greedy, arms interleaved: ``free``, ``free_again`` (A/A), ``schema`` (as the
server applies ``response_format``) and, when installed, ``schema_outlines``; decode steps
after the first token, and the time inside the schema's processor.
"""

from __future__ import annotations

import json
import time
from typing import Any

from bench.harness import interleave, open_run, parse, parser, ratio_row, summaries, summary
from bench.report import ms, speed_header, table


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, reps=9, tokens=(48, 8, "decode steps per repetition"))
    args = parse(p, argv)
    reps, steps = args.reps, args.tokens
    sm = open_run("structured", args, argv)
    progress = sm.log
    tokenizer = sm.loaded.tokenizer
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "summary": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["title", "summary", "tags"],
    }
    messages = [{"role": "user", "content": "Describe the Python language as JSON."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    inside: dict[str, list[float]] = {}

    def outlines_processor() -> Any:
        import mlx.core as mx
        import numpy as np
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        eos = min(tokenizer.eos_token_ids)
        vocab: dict[str, list[int]] = {}
        for text, i in tokenizer._tokenizer.get_vocab().items():
            if i != eos:
                vocab.setdefault(text, []).append(i)
        index = oc.Index(build_regex_from_schema(json.dumps(schema)), oc.Vocabulary(eos, vocab))
        guide = oc.Guide(index)
        seen = [0]

        def process(tokens: Any, logits: Any) -> Any:
            if seen[0]:
                for token in tokens.tolist()[seen[0] :]:
                    guide.advance(token)
            seen[0] = tokens.size
            allowed = np.zeros(logits.shape[-1], dtype=np.bool_)
            allowed[guide.get_tokens()] = True
            return mx.where(mx.array(allowed), logits, -mx.inf)

        return process

    def run(constrained: bool | str) -> float:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        from qfserve.engine.text.structured import GrammarProcessor, JSONConstraint

        processors: list[Any] = []
        if constrained:
            grammar = (
                outlines_processor()
                if constrained == "outlines"
                else GrammarProcessor(tokenizer, JSONConstraint(json.dumps(schema)))
            )
            spent = [0.0]

            def timed(tokens: Any, logits: Any) -> Any:
                mx.eval(tokens, logits)  # the model's step is not the processor's time
                t = time.perf_counter()
                out = grammar(tokens, logits)
                mx.eval(out)
                spent[0] += time.perf_counter() - t
                return out

            processors.append(timed)
        start = None
        n = 0
        for n, _ in enumerate(
            generate_step(
                mx.array(prompt),
                sm.loaded.model,
                max_tokens=steps,
                sampler=make_sampler(0.0),
                logits_processors=processors,
            ),
            start=1,
        ):
            if n == 1:
                start = time.perf_counter()
                if constrained:
                    spent[0] = 0.0
        assert start is not None and n > 1
        per_token = (time.perf_counter() - start) / (n - 1) * 1000
        if constrained:
            inside.setdefault(str(constrained), []).append(spent[0] / (n - 1) * 1000)
        return per_token

    arms = {
        "free": lambda: run(False),
        "free_again": lambda: run(False),
        "schema": lambda: run(True),
    }
    try:
        import outlines_core  # noqa: F401
    except ImportError:
        pass
    else:
        arms["schema_outlines"] = lambda: run("outlines")
    samples = interleave(arms, reps, progress=progress.rounds("arms"))
    rows = {
        "schema/free": ratio_row(samples, "schema", "free"),
        "free_again/free (A/A)": ratio_row(samples, "free_again", "free"),
    }
    if "schema_outlines" in samples:
        rows["schema_outlines/free"] = ratio_row(samples, "schema_outlines", "free")
    stats = summaries(samples)
    processors_ms = {k: summary(v[-reps:]) for k, v in inside.items()}
    processor = processors_ms["True"]
    return sm.save(
        {
            "steps": steps,
            "reps": reps,
            "schema": schema,
            "ms_per_token": stats,
            "ratios": rows,
            "processor_ms_per_token": processor,
            "processor_ms_per_token_by_library": {
                ("llguidance" if k == "True" else "outlines-core"): v
                for k, v in processors_ms.items()
            },
            "grammar_engine": "llguidance",
        }
    )


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    r, aa = d["ratios"]["schema/free"], d["ratios"]["free_again/free (A/A)"]
    lines = speed_header("Structured output: what a JSON-schema constraint costs per token", d)
    lines += [
        f"Greedy decode, {d['reps']} interleaved repetitions of {d['steps']} tokens, "
        f"served grammar engine {d['grammar_engine']}.",
        "",
        *table(
            ["arm", "ms/token median [q1–q3]"],
            [[arm, ms(s, digits=1)] for arm, s in d["ms_per_token"].items()],
        ),
        "",
        f"llguidance (served) schema/free = **{r['median']:.3f}** [{r['q1']:.3f}–"
        f"{r['q3']:.3f}] (A/A {aa['median']:.3f})"
        + (
            f"; outlines-core schema/free = {d['ratios']['schema_outlines/free']['median']:.3f}"
            if "schema_outlines/free" in d["ratios"]
            else ""
        )
        + ". Time inside the grammar processor per token: "
        + ", ".join(
            f"{lib} {v['median']:.2f} ms"
            for lib, v in d.get("processor_ms_per_token_by_library", {}).items()
        )
        + ".",
        "",
    ]
    return lines
