"""Kernel source text for the fused eviction path, for Metal and CUDA, with no MLX import.

Each kernel body is written once in a small neutral dialect (``QF_*`` tokens for barriers,
shared memory, thread indices and the SIMD sum) and rendered for a backend by :func:`render`,
so the Metal and CUDA kernels share every line of the algorithm and cannot drift apart.
This module imports nothing but the standard library: ``bench/studies/kernel_cuda.py`` reads
the CUDA text from here on machines that have CUDA but no MLX (:func:`cuda_module_source`).

The bodies follow the calling convention of ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel``:
inputs and outputs are flat row-major buffers named as in the specs below, and ``T``, ``TV``,
``TG`` and ``MAX_BUDGET`` are compile-time template arguments. Sizes that change from call to
call (``L``, ``budget`` ...) travel in a small int32 ``params`` input, so a new sequence
length never triggers a recompile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Survivor rows are staged in threadgroup memory, which needs a compile-time bound.
MAX_BUDGET = 4096
# Threads per threadgroup for the apply kernel (one threadgroup per (b, h) group).
DEFAULT_THREADS = 256
# Lanes that share one row in the score kernel (a SIMD group / CUDA warp).
SIMD_WIDTH = 32
# Rows scored per threadgroup: DEFAULT_THREADS / SIMD_WIDTH.
SCORE_ROWS_PER_GROUP = DEFAULT_THREADS // SIMD_WIDTH


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: its name, buffer names, compile-time arguments and neutral-dialect body.

    ``input_types`` gives, per input, the C type used when the kernel is compiled outside
    MLX: a template parameter name (``"T"``, ``"TV"``) or a concrete type.
    """

    name: str
    template_names: tuple[str, ...]
    input_names: tuple[str, ...]
    input_types: tuple[str, ...]
    output_names: tuple[str, ...]
    output_types: tuple[str, ...]
    body: str


# Shared by both kernels. ``qf_rank`` is the value a row is ranked by: the stored score,
# NaN ranked last (-inf), protected rows (sinks, recent window) first (+inf).
_HEADER = """
QF_FUNC float qf_rank(float s, uint i, uint L, uint n_sink, uint recent) {
  s = (s != s) ? -QF_INF : s;
  return (i < n_sink || i + recent >= L) ? QF_INF : s;
}
"""

_CUDA_PRELUDE = """
typedef unsigned int uint;

__device__ inline float qf_warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
"""

# Dispatch 1: scores[g, i] = qf_rank(keys[g, i] . filters[g]) in float32.
# params = [L, D, n_sink, recent, G]. One SIMD group per row: lanes stride over D (coalesced
# loads), then a butterfly sum; lane 0 writes.
SCORE = KernelSpec(
    name="qfilters_score",
    template_names=("T",),
    input_names=("keys", "filters", "params"),
    input_types=("T", "float", "int"),
    output_names=("scores",),
    output_types=("float",),
    body="""
  const size_t row = (size_t)(QF_GLOBAL) / 32;
  const uint lane = QF_LANE;
  const uint L = (uint)params[0];
  const uint D = (uint)params[1];
  const uint n_sink = (uint)params[2];
  const uint recent = (uint)params[3];
  // The whole SIMD group leaves together, so the sum below never sees a missing lane.
  if (row >= (size_t)params[4] * L) {
    return;
  }
  const size_t g = row / L;
  const uint i = (uint)(row - g * L);
  float acc = 0.0f;
  for (uint d = lane; d < D; d += 32) {
    acc += static_cast<float>(keys[row * D + d]) * filters[g * D + d];
  }
  acc = QF_SIMD_SUM(acc);
  if (lane == 0) {
    scores[row] = qf_rank(acc, i, L, n_sink, recent);
  }
""",
)

# Dispatch 2: per group, the ``budget`` survivors against threshold ``thresh[g]``, copied in
# temporal order. params = [L, D, Dv, budget, n_sink, recent]. Thread t owns the contiguous
# run of rows [t * chunk, (t + 1) * chunk): one exclusive scan over per-thread counts then
# gives every survivor its slot, in temporal order, with no sort.
APPLY = KernelSpec(
    name="qfilters_apply",
    template_names=("T", "TV", "TG", "MAX_BUDGET"),
    input_names=("keys", "values", "scores", "thresh", "params"),
    input_types=("T", "TV", "float", "float", "int"),
    output_names=("out_keys", "out_values", "out_scores"),
    output_types=("T", "TV", "float"),
    body="""
  QF_SHARED uint scan_above[TG];
  QF_SHARED uint scan_tied[TG];
  QF_SHARED uint keep_rows[MAX_BUDGET];

  const uint g = QF_GROUP;
  const uint t = QF_THREAD;
  const uint L = (uint)params[0];
  const uint D = (uint)params[1];
  const uint Dv = (uint)params[2];
  const uint budget = (uint)params[3];
  const uint n_sink = (uint)params[4];
  const uint recent = (uint)params[5];
  const float th = thresh[g];
  const size_t base = (size_t)g * L;

  const uint chunk = (L + (uint)TG - 1) / (uint)TG;
  const uint lo = t * chunk < L ? t * chunk : L;
  const uint hi = lo + chunk < L ? lo + chunk : L;

  // Phase 1: count this thread's rows strictly above the threshold and equal to it.
  uint n_above = 0;
  uint n_tied = 0;
  for (uint i = lo; i < hi; ++i) {
    const float r = qf_rank(scores[base + i], i, L, n_sink, recent);
    n_above += (r > th) ? 1u : 0u;
    n_tied += (r == th) ? 1u : 0u;
  }

  // Phase 2: inclusive Hillis-Steele scan of both counts over the threadgroup.
  scan_above[t] = n_above;
  scan_tied[t] = n_tied;
  QF_BARRIER;
  for (uint offset = 1; offset < (uint)TG; offset <<= 1) {
    const uint a = (t >= offset) ? scan_above[t - offset] : 0u;
    const uint b = (t >= offset) ? scan_tied[t - offset] : 0u;
    QF_BARRIER;
    scan_above[t] += a;
    scan_tied[t] += b;
    QF_BARRIER;
  }
  uint above_before = scan_above[t] - n_above;
  uint tied_before = scan_tied[t] - n_tied;
  // Tied rows only fill what the strictly-above rows leave of the budget, so equal scores
  // (every protected row ties at +inf) can never push the group past the budget.
  const uint quota = budget - scan_above[(uint)TG - 1];

  // Phase 3: two-tier admission; a survivor's slot counts the survivors before it.
  for (uint i = lo; i < hi; ++i) {
    const float r = qf_rank(scores[base + i], i, L, n_sink, recent);
    if (r > th) {
      const uint slot = above_before + (tied_before < quota ? tied_before : quota);
      if (slot < budget) {
        keep_rows[slot] = i;
      }
      above_before += 1;
    } else if (r == th) {
      if (tied_before < quota) {
        keep_rows[above_before + tied_before] = i;
      }
      tied_before += 1;
    }
  }
  QF_BARRIER;

  // Phase 4: copy the survivors' scores, keys and values bit for bit, coalesced.
  for (uint j = t; j < budget; j += (uint)TG) {
    out_scores[(size_t)g * budget + j] = scores[base + keep_rows[j]];
  }
  for (uint j = t; j < budget * D; j += (uint)TG) {
    const uint k = j / D;
    out_keys[((size_t)g * budget + k) * D + (j - k * D)] =
        keys[(base + keep_rows[k]) * D + (j - k * D)];
  }
  for (uint j = t; j < budget * Dv; j += (uint)TG) {
    const uint k = j / Dv;
    out_values[((size_t)g * budget + k) * Dv + (j - k * Dv)] =
        values[(base + keep_rows[k]) * Dv + (j - k * Dv)];
  }
""",
)

KERNELS = (SCORE, APPLY)

_TOKENS = {
    # Metal names are what mx.fast.metal_kernel looks for in the source to add attributes.
    "metal": {
        "QF_FUNC": "inline",
        "QF_SHARED": "threadgroup",
        "QF_BARRIER": "threadgroup_barrier(mem_flags::mem_threadgroup)",
        "QF_GROUP": "threadgroup_position_in_grid.x",
        "QF_THREAD": "thread_index_in_threadgroup",
        "QF_GLOBAL": "thread_position_in_grid.x",
        "QF_LANE": "thread_index_in_simdgroup",
        "QF_SIMD_SUM": "simd_sum",
        "QF_INF": "INFINITY",
    },
    "cuda": {
        "QF_FUNC": "__device__ inline",
        "QF_SHARED": "__shared__",
        "QF_BARRIER": "__syncthreads()",
        "QF_GROUP": "blockIdx.x",
        "QF_THREAD": "threadIdx.x",
        "QF_GLOBAL": "(blockIdx.x * blockDim.x + threadIdx.x)",
        "QF_LANE": "(threadIdx.x & 31u)",
        "QF_SIMD_SUM": "qf_warp_sum",
        "QF_INF": "__int_as_float(0x7f800000)",
    },
}

_TOKEN_RE = re.compile(r"\bQF_[A-Z_]+\b")


def _substitute(text: str, backend: str) -> str:
    tokens = _TOKENS[backend]
    return _TOKEN_RE.sub(lambda m: tokens[m.group(0)], text)


def render(spec: KernelSpec, backend: str) -> tuple[str, str]:
    """The ``(header, source)`` pair to hand to ``mx.fast.<backend>_kernel``.

    Args:
        spec: :data:`SCORE` or :data:`APPLY`.
        backend: ``"metal"`` or ``"cuda"``.
    Returns:
        The header (helpers placed before the kernel function) and the kernel body.
    """
    if backend not in _TOKENS:
        raise ValueError(f"backend must be 'metal' or 'cuda', got {backend!r}")
    prelude = _CUDA_PRELUDE if backend == "cuda" else ""
    return prelude + _substitute(_HEADER, backend), _substitute(spec.body, backend)


# C type for each dtype name, as MLX's CUDA backend spells it.
CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}


def cuda_kernel_name(spec: KernelSpec, dtype: str, value_dtype: str | None = None) -> str:
    """The ``extern "C"`` name :func:`cuda_module_source` gives one instantiation."""
    name = f"{spec.name}_{dtype}"
    return name if value_dtype is None or "TV" not in spec.input_types else f"{name}_{value_dtype}"


def cuda_module_source(
    instances: list[tuple[KernelSpec, str, str]],
    *,
    threads: int = DEFAULT_THREADS,
    max_budget: int = MAX_BUDGET,
) -> str:
    """A self-contained CUDA translation unit, for NVRTC (CuPy) or nvcc, without MLX.

    Each kernel gets the signature ``mx.fast.cuda_kernel`` would generate (inputs, then
    outputs, as plain pointers) and the same compile-time constants, as an ``extern "C"``
    function named by :func:`cuda_kernel_name`.

    Args:
        instances: ``(spec, key dtype, value dtype)`` triples; dtypes are names in
            :data:`CUDA_TYPES`.
        threads: ``TG``, threads per block; must match the launch.
        max_budget: ``MAX_BUDGET``, the staging bound of the apply kernel.
    Returns:
        CUDA source text.
    """
    header, _ = render(SCORE, "cuda")
    used = {d for _, dtype, value_dtype in instances for d in (dtype, value_dtype)}
    includes = "#include <cuda_fp16.h>\n" + (
        "#include <cuda_bf16.h>\n" if "bfloat16" in used else ""
    )
    parts = [includes, header]
    for spec, dtype, value_dtype in instances:
        types = {"T": CUDA_TYPES[dtype], "TV": CUDA_TYPES[value_dtype], "int": "int"}
        args = [
            f"    const {types.get(t, t)}* {n}"
            for n, t in zip(spec.input_names, spec.input_types, strict=True)
        ]
        args += [
            f"    {types.get(t, t)}* {n}"
            for n, t in zip(spec.output_names, spec.output_types, strict=True)
        ]
        values = {"TG": threads, "MAX_BUDGET": max_budget}
        consts = "".join(
            f"  using {n} = {types[n]};\n"
            if n in types
            else f"  constexpr int {n} = {values[n]};\n"
            for n in spec.template_names
        )
        name = cuda_kernel_name(spec, dtype, value_dtype)
        body = render(spec, "cuda")[1]
        parts.append(f'extern "C" __global__ void {name}(\n' + ",\n".join(args) + ") {\n")
        parts.append(consts + body + "}\n")
    return "\n".join(parts)
