"""Markdown for the serving studies: continuous batching, multi-turn reuse, one batch step,
self-calibration's prefill cost, and the decode step of chunked and adaptive caches."""

from __future__ import annotations

from typing import Any

from bench.speed.markdown import MiB, _header, _plots, _table


def batching(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    lines = _header("12. Continuous batching: concurrent streams", d)
    lines.append(
        f"Streamed chat requests of one prompt length sent at once, greedy, {s['max_tokens']} "
        f"tokens (EOS banned); ours mix methods and budgets. Arms: {s['serial']} (serial), "
        f"{s['batched']} (batched_a, and batched_b as the A/A copy), {s['theirs']} (theirs). "
        "Decode tokens/s is aggregate: tokens after each stream's first, over the span from "
        "the first first token to the last stream's end; steady tokens/s counts only the "
        "span in which every stream is decoding (from the last first token to the first end)."
    )
    lines.append("")
    rows = []
    for r in d["rows"]:
        for a in r["tokens_per_s"]:
            rows.append(
                [
                    r["prompt_tokens"],
                    r["streams"],
                    a,
                    f"{r['tokens_per_s'][a]['median']:.2f}",
                    _steady(r, a),
                    f"{r['e2e_tokens_per_s'][a]['median']:.2f}",
                    f"{r['ttft_p50_s'][a]['median']:.2f}",
                    f"{r['ttft_p99_s'][a]['median']:.2f}",
                ]
            )
    headers = [
        "prompt",
        "streams",
        "arm",
        "decode tok/s",
        "steady tok/s",
        "e2e tok/s",
        "TTFT p50 s",
    ]
    lines += _table([*headers, "TTFT p99 s"], rows)
    for key, what in (
        ("speedup_over_one_stream", "decode"),
        ("steady_speedup_over_one_stream", "steady decode"),
    ):
        for n, sp in (d.get(key) or {}).items():
            if sp:
                lines += ["", f"Prompt {n}: batched {what} tokens/s over one stream: " + ", ".join(
                    f"{c} streams {v:.2f}×" for c, v in sp.items())]  # fmt: skip
    return lines + _plots(d)


def _steady(row: dict[str, Any], arm: str) -> str:
    cell = (row.get("steady_tokens_per_s") or {}).get(arm)  # older results have none
    return "" if cell is None else f"{cell['median']:.2f}"


def multiturn(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    lines = _header("13. Multi-turn chat: reuse of compressed caches", d)
    lines.append(
        f"{s['turns']} turns of about {s['turn_tokens']} new prose tokens each, greedy answers "
        f"of at most {s['max_tokens']} tokens; Q-Filters at budget {s['budget']}."
    )
    lines.append("")
    arms = list(d["turns"])
    picks = sorted({1, 2, len(d["turns"][arms[0]]) // 2, len(d["turns"][arms[0]])})
    rows = []
    for a in arms:
        for t in d["turns"][a]:
            if t["turn"] in picks:
                kept = t["kept_bytes"]
                rows.append(
                    [
                        t["turn"],
                        a,
                        t["prompt_tokens"],
                        t["cached_tokens"] if t["cached_tokens"] is not None else "—",
                        f"{t['ttft_s']:.2f}",
                        "—" if kept is None else f"{kept / MiB:.1f}",
                        f"{t['rss_bytes'] / MiB:.0f}",
                    ]
                )
    lines += _table(["turn", "arm", "prompt", "cached", "TTFT s", "KV MiB", "RSS MiB"], rows)
    by_conversation = d.get("last_over_second_ttft_by_conversation", {})
    n = s.get("conversations", 1)

    def ratio(a: str, v: float) -> str:
        each = by_conversation.get(a) or []
        if n < 2 or None in each:
            return f"{a} {v:.2f}×"
        return f"{a} {v:.2f}× (median of {n}; {min(each):.2f}–{max(each):.2f})"

    ratios = ", ".join(ratio(a, v) for a, v in d["last_over_second_ttft"].items() if v is not None)
    where = "in the first conversation " if n > 1 else ""
    lines += ["", f"Rows above: {where}turns 1, 2, the middle and the last."]
    lines += ["", f"TTFT at the last turn over turn 2: {ratios}."]
    return lines + _plots(d)


def batch_step(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    lines = _header("14. One decode step of a batch: per-request caches against mlx-lm's", d)
    lines.append(
        f"In process: {s['ours']} against {s['theirs']}; prompts of {s['prompt']} tokens, "
        f"budget {s['budget']}, {s['reps']} interleaved rounds (`ours_again` = A/A)."
        + (f" `ours_chunked`: {s['ours_chunked']}." if "ours_chunked" in s else "")
    )
    lines.append("")
    rows = []
    chunked = "ours_chunked" in s  # an arm added later: older results lack it
    for r in d["rows"]:
        ratio, aa, *more = r["ratios"]
        scale = r.get("tokens_per_s_over_batch_1", {})
        rows.append(
            [
                r["batch"],
                *(
                    f"{r['step_s'][a]['median'] * 1e3:.1f}"
                    for a in ("ours", "theirs", "ours_updates", "theirs_updates")
                ),  # fmt: skip
                f"{ratio['median']:.2f}",
                f"{aa['median']:.2f}",
                *([f"{more[0]['median']:.2f}"] if chunked else []),
                *(f"{scale[a]:.2f}×" if a in scale else "—" for a in ("ours", "theirs")),
            ]
        )
    headers = ["batch", "ours ms", "theirs ms", "ours updates ms", "theirs updates ms"]
    headers += ["ours/theirs", "A/A", *(["chunked/ours"] if chunked else [])]
    lines += _table([*headers, "ours tok/s ×", "theirs tok/s ×"], rows)
    return lines + _plots(d)


def selfcal_prefill(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    lines = _header("15. Self-calibration: its cost on a prefill", d)
    lines.append(
        f"In process: a {s['prompt_tokens']}-token prompt prefilled in {s['prefill_chunk']}-token "
        f"chunks into Q-Filters caches (budget {s['budget']}, recent {s['recent']}), "
        f"{s['reps']} interleaved rounds. `self` computes its filters from the prompt's own "
        "queries (qfserve.engine.kv.selfcal); `calibrated` uses the registry's, with no query taps; "
        "`calibrated_again` is the A/A copy. Ratios are to `calibrated`."
    )
    lines.append("")
    rows = [["calibrated", f"{d['prefill_s']['calibrated']['median']:.2f}", "1.00", ""]]
    for r in d["ratios"]:
        rows.append(
            [
                r["arm"],
                f"{d['prefill_s'][r['arm']]['median']:.2f}",
                f"{r['median']:.3f}",
                f"{r['min']:.3f}-{r['max']:.3f}",
            ]
        )
    lines += _table(["arm", "prefill s", "ratio", "range"], rows)
    return lines + _plots(d)


def refine_step(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    lines = _header("16. Chunks and adaptive budgets: the decode step at equal size", d)
    lines.append(
        f"In process: every arm prefilled with {s['prompt']}, so each step evicts one row; "
        f"recent {s['recent']}, {s['steps']} steps per timing, {s['reps']} interleaved rounds. "
        f"Ratios are to plain Q-Filters (`{s['reference']}`); `plain_b` is the A/A copy."
    )
    lines.append("")
    rows = []
    for r in d["rows"]:
        ref = r["ms_per_step"][s["reference"]]["median"]
        held = r.get("rows", {})

        def width(arm: str, held: dict = held) -> str:
            return str(held[arm]["stored_rows"]) if arm in held else "—"

        rows.append([r["budget"], s["reference"], width(s["reference"]), f"{ref:.1f}", "1.00", ""])
        for x in r["ratios"]:
            rows.append(
                [
                    "",
                    x["arm"],
                    width(x["arm"]),
                    f"{r['ms_per_step'][x['arm']]['median']:.1f}",
                    f"{x['median']:.3f}",
                    f"{x['q1']:.2f}-{x['q3']:.2f}",
                ]
            )
    lines += _table(["budget", "arm", "rows stored", "ms/step", "ratio", "IQR"], rows)
    lines += [
        "",
        "Rows stored: per layer and KV head, the width attention reads (adaptive budgets pad "
        "every head to the longest).",
    ]
    return lines + _plots(d)
