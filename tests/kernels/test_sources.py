"""The kernel text: both renderings are complete, and the CUDA one compiles where nvcc exists."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from qfserve.kernels.sources import APPLY, KERNELS, SCORE, cuda_module_source, render

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed: CUDA text not compiled")

# How mx.fast.cuda_kernel lays out a kernel (its build_kernel), with a stand-in for MLX's
# device header, so the text MLX would compile is compiled here.
_MLX_CUDA_PRELUDE = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <cstdint>
#define inf cuda::std::numeric_limits<float>::infinity()
"""
_MLX_TYPES = {"T": "__half", "TV": "__nv_bfloat16", "float": "float", "int": "int32_t"}


def mlx_style_cuda(spec) -> str:
    header, body = render(spec, "cuda")
    args = [
        f"    const {_MLX_TYPES[t]}* {n}"
        for n, t in zip(spec.input_names, spec.input_types, strict=True)
    ]
    args += [
        f"    {_MLX_TYPES[t]}* {n}"
        for n, t in zip(spec.output_names, spec.output_types, strict=True)
    ]
    consts = {"T": "  using T = __half;", "TV": "  using TV = __nv_bfloat16;"}
    consts |= {
        "TG": "  constexpr int TG = 256;",
        "MAX_BUDGET": "  constexpr int MAX_BUDGET = 4096;",
    }
    return (
        _MLX_CUDA_PRELUDE
        + header
        + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
        + f"__global__ void custom_kernel_{spec.name}(\n"
        + ",\n".join(args)
        + ") {\n"
        + "\n".join(consts[n] for n in spec.template_names)
        + "\n"
        + body
        + "}\n}\n"
    )


@pytest.mark.parametrize("backend", ["metal", "cuda"])
@pytest.mark.parametrize("spec", KERNELS, ids=lambda s: s.name)
def test_every_token_is_rendered(spec, backend):
    header, source = render(spec, backend)
    assert "QF_" not in header + source


def test_metal_source_names_the_attributes_mlx_passes_in():
    # mx.fast.metal_kernel adds a thread attribute only if its name appears in the source.
    assert "threadgroup_position_in_grid" in render(APPLY, "metal")[1]
    assert "thread_index_in_threadgroup" in render(APPLY, "metal")[1]
    assert "thread_index_in_simdgroup" in render(SCORE, "metal")[1]


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be"):
        render(APPLY, "vulkan")


def compile_cuda(tmp_path, text: str) -> str:
    src = tmp_path / "k.cu"
    src.write_text(text)
    out = tmp_path / "k.ptx"
    cmd = [NVCC, "--ptx", "-arch=compute_80", "-Werror", "all-warnings", "-o", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out.read_text()


@needs_nvcc
def test_standalone_cuda_module_compiles(tmp_path):
    dtypes = ["float16", "bfloat16", "float32"]
    instances = [(spec, d, d) for spec in KERNELS for d in dtypes] + [(APPLY, "float16", "float32")]
    ptx = compile_cuda(tmp_path, cuda_module_source(instances))
    for name in [
        "qfilters_score_float16",
        "qfilters_apply_bfloat16_bfloat16",
        "qfilters_apply_float16_float32",
    ]:
        assert f".entry {name}(" in ptx


@needs_nvcc
@pytest.mark.parametrize("spec", KERNELS, ids=lambda s: s.name)
def test_the_text_mlx_would_compile_compiles(tmp_path, spec):
    # MLX compiles each kernel as its own module.
    ptx = compile_cuda(tmp_path, mlx_style_cuda(spec))
    assert f"custom_kernel_{spec.name}" in ptx
