"""The u8 x s8 -> s32 VNNI GEMM: microkernel, rewrite of integer matmuls, bit-exactness."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

import tvm_hybrid
from tvm_hybrid import workloads
from tvm_hybrid.host import check_runnable_here, make_target
from tvm_hybrid.microkernels import ensure_tensor_intrin, int8_microkernels, tensor_intrin
from tvm_hybrid.passes.integer_gemm import INT8_PACKED_MATMUL, pack_weight_vnni
from tvm_hybrid.schedules.gemm_template import TEMPLATE_ANNOTATION

HOST = make_target("host")
needs_vnni = pytest.mark.skipif(not int8_microkernels(HOST),
                                reason="needs AVX512-VNNI to run the int8 microkernel")


def _gemm_kernels(model) -> list[str]:
    return [g.name_hint for g, f in model.lowered.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and INT8_PACKED_MATMUL in g.name_hint]


def test_vnni_packing_layout():
    rng = np.random.default_rng(0)
    w = rng.integers(-128, 128, (8, 40)).astype(np.int8)
    packed = pack_weight_vnni(w, 32)
    assert packed.shape == (2, 2, 32, 4) and packed.dtype == np.int8
    for k in range(8):
        for n in range(40):
            assert packed[n // 32, k // 4, n % 32, k % 4] == w[k, n]
    assert not packed[1, :, 8:, :].any()  # padded columns are zero
    with pytest.raises(ValueError, match="K % 4"):
        pack_weight_vnni(w[:6], 32)


def test_int8_microkernel_family_and_names():
    kernels = int8_microkernels(make_target({"kind": "llvm", "mcpu": "icelake-server"}))
    assert kernels and all(k.in_dtype == "uint8" and k.acc_dtype == "int32" for k in kernels)
    assert all(k.k_step == 4 and k.fits_registers() for k in kernels)
    haswell = int8_microkernels(make_target({"kind": "llvm", "mcpu": "haswell"}))
    assert haswell and all(k.isa == "avx2_int8" for k in haswell)  # the exact fallback
    assert int8_microkernels(make_target({"kind": "llvm", "mcpu": "nehalem"})) == []
    name = tensor_intrin(kernels[0], 64)
    assert name == f"{kernels[0].name}_k64" and ensure_tensor_intrin(name)


@pytest.mark.parametrize("mcpu, register", [
    ("znver4", "zmm"), ("icelake-server", "zmm"),  # sapphirerapids takes AMX: test_amx
    ("alderlake", "ymm"),  # AVX-VNNI: no AVX-512, the 256-bit form
])
def test_int8_gemm_assembly_uses_vpdpbusd(mcpu, register):
    """Compile for a VNNI CPU (no execution): the kernel's inner loop is vpdpbusd."""
    wl = workloads.matmul_integer(64, 64, 128)
    model = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    assert _gemm_kernels(model)
    asm = model.inspect_source("asm")
    assert asm.count("vpdpbusd") >= 8
    assert re.search(rf"vpdpbusd\s+%{register}", asm)


@needs_vnni
@pytest.mark.parametrize("m, n, k, activations, zp, wzp", [
    (32, 64, 64, "uint8", 3, None),
    (16, 100, 128, "int8", -5, None),      # s8 activations: shifted to u8, compensated
    (7, 64, 32, "uint8", 0, 4),            # weight zero point folded into the s8 weights
    (1, 96, 256, "uint8", 128, None),      # M = 1
    (64, 1, 64, "int8", 127, None),        # N = 1, extreme zero point
    (48, 48, 1024, "uint8", 255, None),
])
def test_matmul_integer_is_bit_exact(m, n, k, activations, zp, wzp):
    # With a weight zero point, weights are drawn so that W - w_zp stays in s8.
    low, high = (-128, 128) if wzp is None else (-128 + max(wzp, 0), 128 + min(wzp, 0))
    wl = workloads.matmul_integer(m, n, k, activations=activations, zero_point=zp,
                                  weight_zero_point=wzp, weight_range=(low, high))
    model = tvm_hybrid.compile(wl.model)
    assert _gemm_kernels(model), model.kernel_names()
    out = model(**wl.inputs)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, workloads.matmul_integer_reference(wl))
    # Extreme inputs too: every activation at its minimum and maximum.
    for fill in (np.iinfo(activations).min, np.iinfo(activations).max):
        data = np.full((m, k), fill, activations)
        wl_fill = workloads.Workload(wl.name, wl.model, {"a": data}, wl.flops)
        np.testing.assert_array_equal(model(data), workloads.matmul_integer_reference(wl_fill))


@pytest.mark.parametrize("m, n, k, activations, zp", [
    (64, 64, 128, "uint8", 3), (7, 40, 36, "int8", -5), (1, 96, 256, "uint8", 255),
    (32, 32, 64, "uint8", 0),
])
def test_avx2_int8_fallback_is_exact(m, n, k, activations, zp):
    """Without VNNI: widened to s16 and vpmaddwd, never the saturating vpmaddubsw."""
    target = make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    wl = workloads.matmul_integer(m, n, k, activations=activations, zero_point=zp)
    model = tvm_hybrid.compile(wl.model, target)
    (name,) = _gemm_kernels(model)
    assert "avx2_int8" in model.lowered[name].script()
    asm = model.inspect_source("asm")
    assert "vpmaddwd" in asm and "vpmaddubsw" not in asm
    try:
        check_runnable_here(target)
    except tvm_hybrid.TargetError as err:
        pytest.skip(f"needs AVX2 to run: {err}")
    np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))
    # Full-range extremes, where a saturating pmaddubsw would be wrong.
    for fill in (np.iinfo(activations).min, np.iinfo(activations).max):
        data = np.full((m, k), fill, activations)
        filled = workloads.Workload(wl.name, wl.model, {"a": data}, wl.flops)
        np.testing.assert_array_equal(model(data), workloads.matmul_integer_reference(filled))


def test_avx_vnni_kernel_is_bit_exact():
    """The 256-bit AVX-VNNI family, run here when this CPU has AVX-VNNI."""
    target = make_target({"kind": "llvm", "mcpu": "alderlake", "num-cores": 2})
    try:
        check_runnable_here(target)
    except tvm_hybrid.TargetError as err:
        pytest.skip(f"needs AVX-VNNI to run: {err}")
    wl = workloads.matmul_integer(40, 48, 64, activations="int8", zero_point=-7)
    model = tvm_hybrid.compile(wl.model, target)
    (name,) = _gemm_kernels(model)
    assert "avx_vnni" in model.lowered[name].script()
    np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))


@needs_vnni
def test_int8_gemm_runs_in_the_template():
    wl = workloads.matmul_integer(256, 256, 256)
    model = tvm_hybrid.compile(wl.model)
    (name,) = _gemm_kernels(model)
    script = model.lowered[name].script()
    assert TEMPLATE_ANNOTATION in script and "avx512_vnni" in script
    assert "hybrid.gemm_template" in script


@needs_vnni
@pytest.mark.parametrize("k, wzp", [(30, None), (64, -100)])
def test_integer_matmuls_the_microkernel_cannot_take_stay_exact(k, wzp):
    """K % 4 != 0, or weights leaving the s8 range after the zero point: stock int32 matmul."""
    wl = workloads.matmul_integer(16, 32, k, weight_zero_point=wzp)
    model = tvm_hybrid.compile(wl.model)
    assert not _gemm_kernels(model)
    np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))


@needs_vnni
def test_int8_gemm_is_a_tuning_task(tmp_path):
    from tvm_hybrid.tuning import extract_tasks

    (task,) = extract_tasks(workloads.matmul_integer(64, 64, 64).model, HOST)
    assert all(k.kernel.in_dtype == "uint8" for k in task.space.heuristic())
