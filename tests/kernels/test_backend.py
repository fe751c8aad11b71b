"""Backend choice, the auto/on/off setting, and the errors that run without a GPU."""

from __future__ import annotations

import mlx.core as mx
import pytest

from qfserve import kernels
from qfserve.kernels import MAX_BUDGET, fused_evict, resolve_kernel_mode, use_backend
from qfserve.kernels.backend import ENV_VAR, _chosen, active_backend, detect_backend
from qfserve.kernels.qfilters_apply import fused_evict_kernel


def small():
    keys = mx.zeros((1, 2, 20, 4), mx.float16)
    return keys, keys, mx.zeros((1, 2, 20))


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_auto_uses_the_kernel_where_a_backend_exists_and_the_budget_fits(backend):
    with use_backend(backend):
        assert resolve_kernel_mode("auto", 512) is True
        assert resolve_kernel_mode("auto", MAX_BUDGET) is True
        assert resolve_kernel_mode("auto", MAX_BUDGET + 1) is False
        assert resolve_kernel_mode("on", MAX_BUDGET) is True
        assert resolve_kernel_mode("off", 512) is False


def test_auto_and_off_without_a_backend():
    with use_backend(None):
        assert resolve_kernel_mode("auto", 512) is False
        assert resolve_kernel_mode("off", 512) is False


def test_forced_on_without_a_backend_raises():
    with use_backend(None), pytest.raises(RuntimeError, match="neither a Metal nor a CUDA"):
        resolve_kernel_mode("on", 512)


def test_use_kernel_true_without_a_backend_raises():
    with use_backend(None), pytest.raises(RuntimeError, match="kernel='on' / use_kernel=True"):
        fused_evict(*small(), budget=8, n_sink=1, recent=1, use_kernel=True)


@pytest.mark.parametrize("backend", [None, "metal", "cuda"])
def test_forced_on_above_the_max_budget_raises_whatever_the_backend(backend):
    with use_backend(backend), pytest.raises(ValueError, match=r"\[1, 4096\].*got 4097"):
        resolve_kernel_mode("on", MAX_BUDGET + 1)


def test_the_kernel_refuses_a_budget_above_the_bound_rather_than_truncating():
    L = MAX_BUDGET + 8
    keys = mx.zeros((1, 1, L, 2), mx.float16)
    with pytest.raises(ValueError, match=f"got {MAX_BUDGET + 1}"):
        fused_evict_kernel(
            keys, keys, mx.zeros((1, 1, L)), budget=MAX_BUDGET + 1, n_sink=0, recent=0
        )
    with use_backend("metal"), pytest.raises(ValueError, match="budget must be in"):
        fused_evict(
            keys,
            keys,
            mx.zeros((1, 1, L)),
            budget=MAX_BUDGET + 1,
            n_sink=0,
            recent=0,
            use_kernel=True,
        )


def test_auto_above_the_max_budget_falls_back_to_plain_mlx():
    L = MAX_BUDGET + 3
    keys = mx.zeros((1, 1, L, 2), mx.float16)
    with use_backend("metal"):  # would fail here if it tried the kernel
        k, _, _ = fused_evict(
            keys, keys, mx.zeros((1, 1, L)), budget=MAX_BUDGET + 1, n_sink=0, recent=0
        )
    assert k.shape == (1, 1, MAX_BUDGET + 1, 2)


@pytest.mark.parametrize("mode, budget", [("sometimes", 8), ("auto", 0)])
def test_bad_settings_raise_value_errors(mode, budget):
    with pytest.raises(ValueError):
        resolve_kernel_mode(mode, budget)


def test_override_is_scoped_and_validated():
    before = active_backend()
    with use_backend("cuda"):
        assert active_backend() == "cuda"
        with use_backend(None):
            assert active_backend() is None
        assert active_backend() == "cuda"
    assert active_backend() == before
    with pytest.raises(ValueError, match="backend must be"), use_backend("rocm"):  # type: ignore[arg-type]
        pass


@pytest.fixture
def fresh_choice(monkeypatch):
    _chosen.cache_clear()
    yield monkeypatch
    _chosen.cache_clear()


def test_environment_pins_the_choice_once(fresh_choice):
    fresh_choice.setenv(ENV_VAR, "none")
    assert active_backend() is None
    fresh_choice.setenv(ENV_VAR, "auto")
    assert active_backend() is None  # chosen once: the first answer is kept
    _chosen.cache_clear()
    assert active_backend() == detect_backend()


def test_environment_values_are_checked(fresh_choice):
    fresh_choice.setenv(ENV_VAR, "tpu")
    with pytest.raises(ValueError, match=ENV_VAR):
        active_backend()
    _chosen.cache_clear()
    missing = "cuda" if detect_backend() != "cuda" else "metal"
    fresh_choice.setenv(ENV_VAR, missing)
    with pytest.raises(RuntimeError, match=missing):
        active_backend()


@pytest.mark.skipif(detect_backend() == "cuda", reason="MLX here has CUDA")
def test_cuda_kernel_objects_are_built_on_first_call_not_at_import():
    # Importing the kernels built nothing; asking for the CUDA kernel is what fails on this build.
    assert kernels.fused_evict is fused_evict
    with use_backend("cuda"), pytest.raises(RuntimeError, match="CUDA"):
        fused_evict(*small(), budget=8, n_sink=1, recent=1, use_kernel=True)
