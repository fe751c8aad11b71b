"""``qfserve calibrate``: make a model's calibrated Q-Filters artifact.

Usage::

    qfserve calibrate --model <hf-id-or-folder> [--text FILE ...] [--sequences N]
        [--tokens T] [--samples-per-head S] [--out DIR] [--seed N]
    python -m qfserve.calibrations --model ...      # the same, without the server installed

Loads the model with ``mlx_lm.load``, runs it over the calibration text (default: the
Python standard library's sources, see :mod:`qfserve.calibrations.corpus`), samples its post-RoPE
queries, computes the filters and writes ``<out>/<model-id>.safetensors``. Defaults follow
the paper: 20 sequences x 2,048 tokens (clamped to the model's context), 3,000 positions per
head.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from tqdm import tqdm

from qfserve.calibrations.artifact import save_calibration
from qfserve.calibrations.capture import DEFAULT_SAMPLES_PER_HEAD, capture_queries
from qfserve.calibrations.compute import compute_filters, query_scales
from qfserve.calibrations.corpus import (
    DEFAULT_SEQUENCES,
    DEFAULT_TOKENS,
    describe_files,
    describe_stdlib,
    make_sequences,
    read_documents,
    stdlib_files,
)
from qfserve.calibrations.kvzap.train import DEFAULT_TEXTS as DEFAULT_KVZAP_TEXTS
from qfserve.calibrations.kvzap.train import DEFAULT_TOKENS as DEFAULT_KVZAP_TOKENS
from qfserve.calibrations.model_info import attention_shape, max_context, model_fingerprint
from qfserve.calibrations.registry import (
    artifact_name,
    default_output_dir,
    model_id_for,
    search_path,
    surrogate_name,
)

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def build_parser(prog: str = "qfserve calibrate") -> argparse.ArgumentParser:
    """The argument parser (also used by the server's CLI to show help)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Compute a model's calibrated Q-Filters from its post-RoPE queries and save them "
            "where qfserve finds them by model id."
        ),
    )
    p.add_argument(
        "--model",
        required=True,
        help="Hugging Face id, local mlx-lm folder, or (through qfserve) a GGUF file or "
        "catalog name such as smollm2-135m-instruct",
    )
    p.add_argument(
        "--model-id",
        help="id to register the filters under "
        "(default: the hub id, or the folder's config.json _name_or_path / name)",
    )
    p.add_argument(
        "--text",
        nargs="+",
        action="extend",
        metavar="FILE",
        type=Path,
        help="calibration text files (default: the Python standard library's "
        "top-level *.py sources, shuffled with --seed)",
    )
    p.add_argument(
        "--sequences",
        type=_positive_int,
        default=DEFAULT_SEQUENCES,
        help=f"calibration sequences (default {DEFAULT_SEQUENCES})",
    )
    p.add_argument(
        "--tokens",
        type=_positive_int,
        default=DEFAULT_TOKENS,
        help=f"tokens per sequence, clamped to the model's context (default {DEFAULT_TOKENS})",
    )
    p.add_argument(
        "--samples-per-head",
        type=_positive_int,
        default=DEFAULT_SAMPLES_PER_HEAD,
        help=f"query positions sampled per head (default {DEFAULT_SAMPLES_PER_HEAD})",
    )
    p.add_argument(
        "--chunk-size",
        type=_positive_int,
        default=None,
        help="prefill each sequence in blocks of this many tokens (less memory)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output folder (default: {default_output_dir()}, which qfserve searches)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of text order and sampling")
    p.add_argument(
        "--kvzap",
        action="store_true",
        help="train the model's KVzap surrogates (kv_method kvzap) instead of its Q-Filters: a "
        "linear and an MLP surrogate per layer, on --kvzap-texts texts of the standard "
        "library's sources, measured on held-out prose (installed packages' descriptions); "
        "the linear one is written as <out>/<model-id>.kvzap unless the MLP ranks held-out "
        "keys better by more than 0.02 (Spearman)",
    )
    p.add_argument(
        "--kvzap-texts",
        type=_positive_int,
        default=DEFAULT_KVZAP_TEXTS,
        help=f"training texts for --kvzap (default {DEFAULT_KVZAP_TEXTS})",
    )
    p.add_argument(
        "--kvzap-tokens",
        type=_positive_int,
        default=DEFAULT_KVZAP_TOKENS,
        help=f"tokens per --kvzap text (default {DEFAULT_KVZAP_TOKENS})",
    )
    return p


def _print_summary(summaries: list[dict]) -> None:
    print("layer  positive_share  top_energy  drift_ratio")
    for s in summaries:
        print(
            f"{s['layer']:>5}  {s['positive_share']:>14.3f}  {s['top_energy']:>10.3f}  "
            f"{s['drift_ratio']:>11.2f}"
        )


def main(
    argv: list[str] | None = None,
    *,
    resolve_model: Callable[[str], str] | None = None,
    load: Callable[[str], tuple[Any, Any, dict]] | None = None,
) -> int:
    """Run ``qfserve calibrate``; returns the process exit code.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).
        resolve_model: Turns ``--model`` into what ``mlx_lm.load`` reads (the server passes
            :func:`qfserve.engine.models.loading.resolve_model_ref`, which converts GGUF files and fetches
            catalog models); default: ``--model`` as given.
        load: ``(model, tokenizer, config)`` of a resolved source (the server passes its own
            loader, whose native kernels read quantized codes ~20x faster on a CPU than MLX's
            generic ones); default: ``mlx_lm.load``.
    """
    args = build_parser().parse_args(argv)
    import mlx_lm  # imported here so `--help` stays fast

    source = args.model
    if resolve_model is not None:
        try:
            source = resolve_model(args.model)
        except (OSError, ValueError, RuntimeError) as e:  # missing, unservable, unfetchable
            print(f"error: {e}", file=sys.stderr)
            return 1
    model_id = args.model_id or model_id_for(source)
    missing = [str(f) for f in args.text or () if not f.is_file()]
    if missing:
        print(f"error: --text file(s) not found: {missing}", file=sys.stderr)
        return 2
    try:
        # mlx_lm.load is typed as either a 2- or a 3-tuple; with return_config it is 3.
        model, tokenizer, config = cast(
            "tuple[nn.Module, TokenizerWrapper, dict]",
            load(source) if load is not None else mlx_lm.load(source, return_config=True),
        )
    except Exception as e:  # no such folder/id, no network, unsupported architecture
        print(f"error: cannot load model {args.model!r}: {e}", file=sys.stderr)
        return 1
    if args.kvzap:
        return _kvzap(args, model, tokenizer, model_id, model_fingerprint(model, config))
    try:
        n_layers, n_kv_heads, head_dim = attention_shape(model)
    except ValueError as e:
        print(f"error: {args.model!r} cannot be calibrated: {e}", file=sys.stderr)
        return 1

    tokens = args.tokens
    context = max_context(model)
    if context is not None and tokens > context:
        print(f"--tokens {tokens} exceeds the model's context; using {context}")
        tokens = context
    files = args.text or stdlib_files(args.seed)
    sequences, used = make_sequences(
        tokenizer, read_documents(files), n_sequences=args.sequences, tokens=tokens
    )
    if len(sequences) < args.sequences:
        print(
            f"note: the text ran out after {len(sequences)} of the {args.sequences} sequences "
            f"asked for ({sum(len(s) for s in sequences)} tokens); pass more --text for more"
        )
    text = describe_files(files, used) if args.text else describe_stdlib(args.seed, used)
    total = sum(len(s) for s in sequences)
    print(
        f"calibrating {model_id!r}: {n_layers} layers, {n_kv_heads} KV heads, head_dim "
        f"{head_dim}; {len(sequences)} sequences, {total} tokens of {text}"
    )

    start = time.perf_counter()
    with tqdm(total=total, unit="tok", desc="capturing queries") as bar:
        samples = capture_queries(
            model,
            sequences,
            samples_per_head=args.samples_per_head,
            chunk_size=args.chunk_size,
            seed=args.seed,
            progress=bar.update,
        )
    filters, summaries = compute_filters([s.queries for s in samples], n_kv_heads)

    out_dir = args.out if args.out is not None else default_output_dir()
    path = save_calibration(
        out_dir / artifact_name(model_id),
        filters,
        model_id=model_id,
        n_sequences=len(sequences),
        tokens_per_sequence=max(len(s) for s in sequences),
        samples_per_head=min(s.queries.shape[1] for s in samples),
        text=text,
        anisotropy=summaries,
        weights=model_fingerprint(model, config),
        query_scale=query_scales([s.queries for s in samples], filters),
    )
    _print_summary(summaries)
    print(
        f"done in {time.perf_counter() - start:.1f}s; wrote {path} "
        f"(filters {n_layers} x {n_kv_heads} x {head_dim}) for model id {model_id!r}"
    )
    if out_dir.expanduser().resolve() not in [d.resolve() for d in search_path()]:
        print(
            f"note: {out_dir} is not on qfserve's search path; set QFSERVE_CALIBRATIONS="
            f"{out_dir} (or copy the file to {default_output_dir()}) for the server to use it"
        )
    return 0


def _kvzap(args: Any, model: Any, tokenizer: Any, model_id: str, fingerprint: str) -> int:
    """Train, measure and write the model's KVzap surrogates (``--kvzap``)."""
    from qfserve.calibrations.kvzap.surrogate import save_surrogate
    from qfserve.calibrations.kvzap.train import choose, held_out_documents, train_surrogates

    files = args.text or stdlib_files(args.seed)
    start = time.perf_counter()
    print(
        f"training KVzap surrogates for {model_id!r}: {args.kvzap_texts} texts of "
        f"{args.kvzap_tokens} tokens"
    )
    try:
        with tqdm(total=args.kvzap_texts, unit="text", desc="KVzip+ targets") as bar:
            trained = train_surrogates(
                model,
                tokenizer,
                read_documents(files),
                held_out_documents(),
                texts=args.kvzap_texts,
                tokens=args.kvzap_tokens,
                seed=args.seed,
                progress=bar.update,
            )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for form, s in trained.items():
        print(
            f"  {form}: held-out Spearman median {s.fidelity['spearman_median']:.3f} "
            f"({s.nbytes / 2**20:.1f} MiB)"
        )
    best = choose(trained)
    best.model_id, best.fingerprint = model_id, fingerprint
    best.fidelity["forms"] = {f: s.fidelity["spearman_median"] for f, s in trained.items()}
    best.fidelity["text"] = (
        "files given with --text"
        if args.text
        else describe_stdlib(args.seed, best.fidelity["train_texts"])
    )
    out_dir = args.out if args.out is not None else default_output_dir()
    path = save_surrogate(out_dir / surrogate_name(model_id), best)
    print(f"done in {time.perf_counter() - start:.1f}s; wrote {path} ({best.form})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
