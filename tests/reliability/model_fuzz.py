"""Mutated model files, and what the server's start-up does with each.

A corpus is built from small valid GGUF files (:func:`bases`) by seeded mutations
(:data:`MUTATIONS`): truncation at every section and at random bytes, flipped bits, absurd
integers written over the header's and the tensor table's counts, offsets and dimensions,
unknown tensor types, NaN and infinite quantization scales, huge metadata arrays and strings,
and tokenizers whose merges or scores disagree with their vocabulary. :func:`verdict` runs
what ``qfserve --model FILE`` runs before it listens (resolve, convert, load the converted
folder) and sorts the outcome: ``served`` (the file is valid), ``refused`` (a
:class:`~qfserve.engine.models.gguf.GGUFError` or, where the magic is gone, a
``ModelNotFoundError``: the command line turns either into one line naming the file and exit
status 2), ``slow`` (refused, but after more than
:data:`LIMIT_S`) or ``crash`` (any other exception: a traceback). ``model_findings.json`` keeps every mutant that once
crashed as its recipe (the corpus's seed and index: the corpus is deterministic), and the
tests rebuild and check each.
"""

from __future__ import annotations

import random
import struct
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LIMIT_S = 5.0  # a refusal must come within this
FINDINGS = Path(__file__).resolve().parent / "model_findings.json"


@dataclass(frozen=True)
class Verdict:
    outcome: str  # served, refused, slow or crash
    seconds: float
    message: str  # the refusal's line or the crash's traceback


def verdict(path: Path) -> Verdict:
    """What start-up makes of the file at ``path`` (see the module docstring)."""
    from qfserve.engine.models.gguf import GGUFError
    from qfserve.engine.models.loading import ModelNotFoundError, load_model, resolve_model_ref

    tic = time.perf_counter()
    try:
        load_model(resolve_model_ref(str(path)))
    except (GGUFError, ModelNotFoundError) as exc:  # what the command line refuses in a line
        seconds = time.perf_counter() - tic
        return Verdict("refused" if seconds <= LIMIT_S else "slow", seconds, str(exc))
    except Exception:  # noqa: BLE001 - what the fuzzer looks for
        return Verdict("crash", time.perf_counter() - tic, traceback.format_exc())
    return Verdict("served", time.perf_counter() - tic, "")


# -- the files the mutations start from ------------------------------------------------------


def bases(folder: Path) -> list[Path]:
    """Small valid GGUF files: a BPE llama with Q8_0 and F32 tensors, one with K-quant and
    legacy 4/5-bit tensors, and a SentencePiece one."""
    from gguf import GGMLQuantizationType as T

    from tests.gguf_files import write_tiny_gguf

    folder.mkdir(parents=True, exist_ok=True)
    made = {
        "q8_0.gguf": {},
        "mixed.gguf": {"qtype": T.Q4_1, "quantized": ("attn_q", "ffn_up")},
    }
    paths = []
    for name, kwargs in made.items():
        path = folder / name
        if not path.exists():
            write_tiny_gguf(path, **kwargs)
        paths.append(path)
    return paths


# -- the file's layout, as far as the mutations need it ---------------------------------------


@dataclass(frozen=True)
class Layout:
    """Byte offsets in a GGUF file: each metadata field's and tensor info's start, where the
    tensor data starts, and each tensor's data (offset, type, byte count)."""

    fields: list[tuple[str, int, int]]  # name, start, end
    infos: list[tuple[str, int, int]]  # tensor name, start of its info, end
    data_start: int
    tensors: list[tuple[str, int, int, int]]  # name, data's offset in the file, type id, bytes


def layout(path: Path) -> Layout:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = [
        (name, int(f.offset), int(f.offset) + sum(int(p.nbytes) for p in f.parts))
        for name, f in reader.fields.items()
        if not name.startswith("GGUF.")
    ]
    infos = [
        (
            t.name,
            int(t.field.offset),
            int(t.field.offset) + sum(int(p.nbytes) for p in t.field.parts),
        )
        for t in reader.tensors
    ]
    tensors = [
        (t.name, int(t.data_offset), int(t.tensor_type), int(t.n_bytes)) for t in reader.tensors
    ]
    return Layout(fields, infos, int(reader.data_offset), tensors)


# -- mutations: each (data, layout, rng) -> mutated bytes ---------------------------------------

Mutation = Callable[[bytes, Layout, random.Random], bytes]
ABSURD = (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**62, 2**63 - 1, 2**64 - 1)


def truncate_at_section(data: bytes, lay: Layout, rng: random.Random) -> bytes:
    cuts = [s for _, s, _ in lay.fields] + [s for _, s, _ in lay.infos] + [lay.data_start]
    cuts += [o for _, o, _, _ in lay.tensors]
    return data[: rng.choice(cuts) + rng.choice((-1, 0, 1, 7))]


def truncate_anywhere(data: bytes, lay: Layout, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))]


def flip_bits(data: bytes, lay: Layout, rng: random.Random) -> bytes:
    out = bytearray(data)
    end = lay.data_start if rng.random() < 0.8 else len(out)  # mostly the header
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(end)
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def absurd_integer(data: bytes, lay: Layout, rng: random.Random) -> bytes:
    """An absurd u64 over a count, a length, a dimension or an offset of the header: the
    tensor and field counts (bytes 8-23), or any 8 bytes of a field or tensor info."""
    out = bytearray(data)
    spans = [(8, 24)] + [(s, e) for _, s, e in lay.fields] + [(s, e) for _, s, e in lay.infos]
    start, end = rng.choice(spans)
    at = rng.randrange(start, max(start + 1, end - 7))
    out[at : at + 8] = struct.pack("<Q", rng.choice(ABSURD))
    return bytes(out)


def unknown_type(data: bytes, lay: Layout, rng: random.Random) -> bytes:
    """A tensor info's type id (the u32 after its dimensions) made one nothing reads, or a
    metadata value's type made unknown."""
    out = bytearray(data)
    if rng.random() < 0.5:
        _, start, end = rng.choice(lay.infos)
        at = end - 12  # type (u32) then offset (u64) end the info
    else:
        _, start, end = rng.choice(lay.fields)
        name_len = struct.unpack_from("<Q", data, start)[0]
        at = start + 8 + name_len
    out[at : at + 4] = struct.pack("<I", rng.choice((13, 31, 99, 2**31, 2**32 - 1)))
    return bytes(out)


def bad_scales(data: bytes, lay: Layout, rng: random.Random) -> bytes:
    """NaN or infinity in a quantized tensor's float16 scales (the first two bytes of a
    Q8_0 / Q4_1 block), or in an F32 tensor's values."""
    from gguf import GGML_QUANT_SIZES

    out = bytearray(data)
    name, at, kind, n_bytes = rng.choice(lay.tensors)  # at: the data's offset in the file
    bad = rng.choice((0x7C00, 0xFC00, 0x7E00))  # +inf, -inf, NaN as float16
    if kind in (8, 3):  # Q8_0, Q4_1: a block starts with its float16 scale
        block = GGML_QUANT_SIZES[_type(kind)][1]
        at += block * rng.randrange(max(1, n_bytes // block))
        out[at : at + 2] = struct.pack("<H", bad)
    else:
        at += 4 * rng.randrange(max(1, n_bytes // 4))
        out[at : at + 4] = np.float32(rng.choice((np.inf, -np.inf, np.nan))).tobytes()
    return bytes(out)


def _type(kind: int) -> Any:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(kind)


MUTATIONS: dict[str, Mutation] = {
    "truncate_at_section": truncate_at_section,
    "truncate_anywhere": truncate_anywhere,
    "flip_bits": flip_bits,
    "absurd_integer": absurd_integer,
    "unknown_type": unknown_type,
    "bad_scales": bad_scales,
}


# -- structured mutants, written through gguf's writer ---------------------------------------


def rewritten(base: Path, out: Path, change: str, rng: random.Random) -> None:
    """``base`` written again with one field changed through gguf's own reader and writer:
    a huge array or string in the metadata, merges naming pieces the vocabulary lacks,
    scores or types of another length than the tokens, absurd hyperparameters."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(base)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out, arch)
    fields = {n: f for n, f in reader.fields.items() if not n.startswith("GGUF.")}
    values: dict[str, Any] = {n: f.contents() for n, f in fields.items()}
    kinds = {n: f.types for n, f in fields.items()}
    if change == "merges_unknown":
        values["tokenizer.ggml.merges"] = [f"zz{rng.randrange(10**6)} qq" for _ in range(50)]
    elif change == "scores_short":
        values["tokenizer.ggml.scores"] = [0.0] * rng.randrange(1, 10)
        kinds["tokenizer.ggml.scores"] = [GGUFValueType.ARRAY, GGUFValueType.FLOAT32]
    elif change == "types_short":
        values["tokenizer.ggml.token_type"] = [1] * rng.randrange(1, 10)
    elif change == "token_ids_out_of_range":
        key = rng.choice(("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"))
        values[key] = rng.choice((10**6, 2**31 - 1))
    elif change == "huge_string":
        values["general.name"] = "x" * rng.choice((10**6, 2 * 10**7))
    elif change == "huge_array":
        # gguf's reader parses an array of strings element by element in Python (~15 s a
        # million): 10**6 is left to llama.cpp's own limits, here 10**4 and 10**5.
        values["general.tags"] = ["t"] * rng.choice((10**4, 10**5))
        kinds["general.tags"] = [GGUFValueType.ARRAY, GGUFValueType.STRING]
    elif change == "absurd_hparams":
        key = rng.choice(
            [n for n in values if n.startswith(f"{arch}.") and isinstance(values[n], int)]
        )
        values[key] = rng.choice((0, 2**31 - 1, 2**32 - 1))
    elif change == "bad_rope":
        values[f"{arch}.rope.freq_base"] = rng.choice((0.0, -1.0, float("inf"), float("nan")))
        kinds[f"{arch}.rope.freq_base"] = [GGUFValueType.FLOAT32]
    for name, value in values.items():
        if name == "general.architecture":
            continue
        types = kinds.get(name) or [_guess(value)]
        if types[0] == GGUFValueType.ARRAY:
            writer.add_array(name, list(value))
        else:
            writer.add_key_value(name, value, types[0])
    for t in reader.tensors:  # as stored (a quantized one's bytes, its shape from them)
        raw = None if int(t.tensor_type) == 0 else t.tensor_type
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _guess(value: Any) -> Any:
    from gguf import GGUFValueType

    return GGUFValueType.get_type(value)


CHANGES = (
    "merges_unknown",
    "scores_short",
    "types_short",
    "token_ids_out_of_range",
    "huge_string",
    "huge_array",
    "absurd_hparams",
    "bad_rope",
)


def corpus(folder: Path, n: int, seed: int = 0) -> Iterator[tuple[str, Path]]:
    """``n`` mutants of :func:`bases` (about one in ten rewritten, the rest byte mutations),
    written into ``folder`` one at a time; yields (what was done, path)."""
    rng = random.Random(seed)
    sources = bases(folder / "bases")
    data = {p: p.read_bytes() for p in sources}
    lays = {p: layout(p) for p in sources}
    for i in range(n):
        base = rng.choice(sources)
        out = folder / f"m{i:05d}.gguf"
        if rng.random() < 0.1:
            change = rng.choice(CHANGES)
            rewritten(base, out, change, rng)
            yield f"{base.stem}/{change}", out
            continue
        name = rng.choice(list(MUTATIONS))
        out.write_bytes(MUTATIONS[name](data[base], lays[base], rng))
        yield f"{base.stem}/{name}", out


def rebuilt(folder: Path, seed: int, index: int) -> Path:
    """Mutant ``index`` of the corpus of ``seed``, written again into ``folder``."""
    for i, (_, path) in enumerate(corpus(folder, index + 1, seed)):
        if i < index:
            path.unlink()
    return path
