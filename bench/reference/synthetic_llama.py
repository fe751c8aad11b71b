"""A synthetic 1B-class Llama as a Q4_K_M GGUF file, for memory and speed at that size.

PyPI carries no 1-2B model in GGUF, so this writes one with llama.cpp's ``gguf`` package:
Llama 3.2 1B's shapes (hidden 2,048, 16 layers, MLP 8,192, 32 query and 8 KV heads of 64),
SmolLM2's 49,152-token vocabulary and chat template (copied from the default model's file,
so tokenizing and templating are real), random weights of N(0, 0.02) in float16; then
llama.cpp's own ``llama-quantize`` makes the Q4_K_M file users download. Its text is noise;
its memory and speed are those of a 1.1B-parameter file.

Usage: ``python -m bench.reference.synthetic_llama OUT_DIR`` (prints the Q4_K_M file).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

SHAPE = {"hidden": 2048, "layers": 16, "mlp": 8192, "heads": 32, "kv_heads": 8, "head_dim": 64}


def write_f16(path: Path, seed: int = 0) -> Path:
    """The float16 file: the default model's vocabulary and metadata keys, our shapes."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from qfserve.engine.models.catalog import SMOLLM2_135M, gguf_path

    source = GGUFReader(gguf_path(SMOLLM2_135M))
    writer = GGUFWriter(str(path), "llama")
    h, n = SHAPE["hidden"], SHAPE["layers"]
    own = {
        "llama.block_count": n,
        "llama.embedding_length": h,
        "llama.feed_forward_length": SHAPE["mlp"],
        "llama.attention.head_count": SHAPE["heads"],
        "llama.attention.head_count_kv": SHAPE["kv_heads"],
        "llama.rope.dimension_count": SHAPE["head_dim"],
    }
    for field in source.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", *own):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for key, value in own.items():
        writer.add_uint32(key, value)
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(seed)

    def add(name: str, rows: int, cols: int) -> None:
        writer.add_tensor(
            name, (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(np.float16)
        )

    add("token_embd.weight", vocab, h)
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    q, kv = SHAPE["heads"] * SHAPE["head_dim"], SHAPE["kv_heads"] * SHAPE["head_dim"]
    for i in range(n):
        for name, rows, cols in (
            ("attn_q", q, h),
            ("attn_k", kv, h),
            ("attn_v", kv, h),
            ("attn_output", h, q),
            ("ffn_gate", SHAPE["mlp"], h),
            ("ffn_up", SHAPE["mlp"], h),
            ("ffn_down", h, SHAPE["mlp"]),
        ):
            add(f"blk.{i}.{name}.weight", rows, cols)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str]) -> int:
    from qfserve.testing import llama_tool

    out = Path(argv[0] if argv else ".").expanduser()
    out.mkdir(parents=True, exist_ok=True)
    target = out / "synthetic-llama-1.1b.Q4_K_M.gguf"
    if not target.is_file():
        tool = llama_tool("llama-quantize")
        if tool is None:
            print(
                "llama-quantize is not built (bench/reference/llama_cpp_tools.sh)", file=sys.stderr
            )
            return 2
        f16 = write_f16(out / "synthetic-llama-1.1b.F16.gguf")
        subprocess.run(
            [str(tool), str(f16), str(target), "Q4_K_M"], check=True, capture_output=True
        )
        f16.unlink()
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
