"""Integer GEMMs: VNNI (u8 x s8) and AVX2 (s16) microkernels, the rewrite, bit-exactness.

Assembly tests compile for named CPUs (any host); numeric tests run the host's own kernel.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.host import CacheSizes, host_features, make_target
from tvm_hybrid.microkernels import (
    ensure_tensor_intrin,
    family_of,
    integer_gemm_dtype,
    microkernels_for,
    tensor_intrin,
    weight_pair_sum,
)
from tvm_hybrid.passes.packed_gemm import KERNEL_NAMES, pack_weight
from tvm_hybrid.schedules.gemm.template import TEMPLATE_ANNOTATION

HOST = make_target("host")
INT8_PACKED_MATMUL = KERNEL_NAMES["uint8"]


def _host_int8_isa() -> tuple[str, ...]:
    """The integer families the host's GEMMs with s8 weights use: its best vector microkernel,
    and AMX tiles where the host has them (the heuristic takes them for shapes they cover)."""
    dtype = integer_gemm_dtype(HOST, -128, 127)
    isa = microkernels_for(HOST, dtype, include_blocks=False)[0].isa
    return (isa, "amx") if "amx-int8" in host_features() else (isa,)


def _template_notes(model) -> list[str]:
    return [m for g, f in model.lowered.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and INT8_PACKED_MATMUL in g.name_hint
            for m in re.findall(r'"hybrid.gemm_template": "([^"]+)"', f.script())]


def _gemm_kernels(model) -> list[str]:
    return [g.name_hint for g, f in model.lowered.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and INT8_PACKED_MATMUL in g.name_hint]


def test_vnni_packing_layout():
    rng = np.random.default_rng(0)
    w = rng.integers(-128, 128, (8, 40)).astype(np.int8)
    packed = pack_weight(w, 32, 4, np.int8)
    assert packed.shape == (2, 2, 32, 4) and packed.dtype == np.int8
    for k in range(8):
        for n in range(40):
            assert packed[n // 32, k // 4, n % 32, k % 4] == w[k, n]
    assert not packed[1, :, 8:, :].any()  # padded columns are zero
    short = pack_weight(w[:6], 32, 4, np.int8)  # K padded to the group with zeros
    assert short.shape == (2, 2, 32, 4) and not short[:, 1, :, 2:].any()


def test_s16_pair_packing_layout():
    w = np.random.default_rng(0).integers(-255, 256, (7, 20)).astype(np.int16)
    packed = pack_weight(w, 16, 2, np.int16)
    assert packed.shape == (2, 4, 16, 2) and packed.dtype == np.int16
    for k in range(7):
        for n in range(20):
            assert packed[n // 16, k // 2, n % 16, k % 2] == w[k, n]
    assert not packed[:, 3, :, 1].any() and not packed[1, :, 4:, :].any()  # padding is zero


def test_int8_microkernel_family_and_names():
    icelake = make_target({"kind": "llvm", "mcpu": "icelake-server"})
    kernels = microkernels_for(icelake, "uint8")
    assert kernels and all(k.in_dtype == "uint8" and k.acc_dtype == "int32" for k in kernels)
    assert all(k.k_step == 4 and k.fits_registers() for k in kernels)
    haswell = make_target({"kind": "llvm", "mcpu": "haswell"})
    # No u8 x s8 dot product without VNNI: vpmaddubsw, exact for bounded weights only...
    maddubs = microkernels_for(haswell, "uint8")
    assert maddubs and all(k.isa == "avx2_maddubs" and k.k_step == 4 for k in maddubs)
    assert family_of(maddubs[0]).pair_bound == 128 and not family_of(kernels[0]).pair_bound
    s16 = microkernels_for(haswell, "int16")  # ...and the exact s16 kernel for any weights
    assert s16 and all(k.isa == "avx2_s16" and k.k_step == 2 and k.fits_registers() for k in s16)
    assert integer_gemm_dtype(haswell, -128, 127) == "int16"
    assert integer_gemm_dtype(haswell, -128, 127, pair_sum=129) == "int16"
    assert integer_gemm_dtype(haswell, -64, 64, pair_sum=128) == "uint8"
    assert integer_gemm_dtype(icelake, -128, 127) == "uint8"
    assert integer_gemm_dtype(icelake, -128, 127, pair_sum=255) == "uint8"  # VNNI: any s8
    assert integer_gemm_dtype(icelake, 0, 255) == "int16"  # u8 weights: s16 on any AVX2 CPU
    nehalem = make_target({"kind": "llvm", "mcpu": "nehalem"})
    assert integer_gemm_dtype(nehalem, -128, 127) is None
    for kernel in (kernels[0], s16[0], maddubs[0]):
        name = tensor_intrin(kernel, 64)
        assert name == f"{kernel.name}_k64" and ensure_tensor_intrin(name)


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


@pytest.mark.parametrize("mcpu", ["haswell", "znver3"])
def test_avx2_integer_gemm_assembly_uses_vpmaddwd(mcpu):
    """Without VNNI (compiled, not run): s16 vpmaddwd on ymm, never the saturating vpmaddubsw."""
    wl = workloads.matmul_integer(64, 64, 128)
    model = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    assert any(note.startswith("avx2_s16") for note in _template_notes(model))
    asm = model.inspect_source("asm")
    assert len(re.findall(r"vpmaddwd\s+.*%ymm", asm)) >= 8
    assert "vpmaddubsw" not in asm and "zmm" not in asm and "vpdpbusd" not in asm


def test_weight_pair_sum_is_per_column_and_pads_odd_k():
    w = np.zeros((5, 3), np.int32)
    w[0, 0], w[1, 0] = 64, -64      # one pair at the bound
    w[1, 1], w[2, 1] = 127, 127     # different pairs (0, 1) and (2, 3): 127 each
    w[4, 2] = -128                  # K = 5: the last k pairs with a zero
    assert weight_pair_sum(w) == 128
    w[3, 1] = 2
    assert weight_pair_sum(w) == 129
    assert weight_pair_sum(np.zeros((0, 4), np.int32)) == 0


def _bounded_weights(k, n, seed=0):
    """s8 weights with every pair of adjacent k within the vpmaddubsw bound, the extreme
    pairs included: (127, 1), (-128, 0), (64, 64), (-64, -64), (100, -28)."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-64, 65, (k, n))
    extremes = [(127, 1), (-128, 0), (64, 64), (-64, -64), (100, -28), (0, -128)]
    for j, (a, b) in enumerate(extremes * (n // len(extremes) + 1)):
        if j < n and k >= 2:
            w[0, j], w[1, j] = a, b
    return w.astype(np.int8)


def _matmul_integer_with(weight, m, activations, zp, seed=1):
    """A MatMulInteger workload with the given constant weight (workloads.matmul_integer's
    graph, its weight initializer replaced)."""
    from onnx import numpy_helper

    k, n = weight.shape
    wl = workloads.matmul_integer(m, n, k, activations=activations, zero_point=zp, seed=seed)
    node = wl.model.graph.node[0]
    for init in wl.model.graph.initializer:
        if init.name == node.input[1]:
            init.CopyFrom(numpy_helper.from_array(weight, init.name))
    return wl


@pytest.mark.parametrize("mcpu", ["haswell", "znver3"])
def test_avx2_bounded_weights_assembly_uses_vpmaddubsw(mcpu):
    """7-bit weights without VNNI (compiled, not run): the vpmaddubsw + vpmaddwd sequence on
    ymm, on the template."""
    wl = workloads.matmul_integer(64, 64, 128, weight_range=(-64, 65))
    model = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    assert any(note.startswith("avx2_maddubs") for note in _template_notes(model))
    asm = model.inspect_source("asm")
    assert len(re.findall(r"vpmaddubsw\s+.*%ymm", asm)) >= 8
    assert len(re.findall(r"vpmaddwd\s+.*%ymm", asm)) >= 8
    assert "zmm" not in asm and "vpdpbusd" not in asm


@pytest.mark.requires("avx2")
@pytest.mark.parametrize("m, n, k, activations, zp", [
    (64, 64, 128, "uint8", 3), (7, 40, 36, "int8", -5), (1, 96, 256, "uint8", 255),
    (32, 32, 63, "uint8", 0), (16, 24, 64, "int8", 127), (48, 48, 1024, "uint8", 128),
])
def test_avx2_vpmaddubsw_kernel_is_exact_for_bounded_weights(m, n, k, activations, zp):
    """Haswell code (run here): weights at the pair bound, activations at their extremes,
    where one more unit of weight would saturate; bit-exact against int64 numpy."""
    target = make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    wl = _matmul_integer_with(_bounded_weights(k, n), m, activations, zp)
    model = tvm_hybrid.compile(wl.model, target)
    (name,) = _gemm_kernels(model)
    assert "avx2_maddubs" in model.lowered[name].script()
    np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))
    for fill in (np.iinfo(activations).min, np.iinfo(activations).max):
        data = np.full((m, k), fill, activations)
        filled = workloads.Workload(wl.name, wl.model, {"a": data}, wl.flops)
        np.testing.assert_array_equal(model(data), workloads.matmul_integer_reference(filled))


@pytest.mark.requires("avx2")
def test_one_pair_beyond_the_bound_takes_the_s16_kernel():
    """A single pair (127, 2) makes vpmaddubsw saturate at a = 255: the s16 kernel, exact."""
    target = make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    weight = _bounded_weights(64, 32)
    weight[10, 5], weight[11, 5] = 127, 2
    wl = _matmul_integer_with(weight, 16, "uint8", 0)
    model = tvm_hybrid.compile(wl.model, target)
    (name,) = _gemm_kernels(model)
    assert "avx2_s16" in model.lowered[name].script()
    data = np.full((16, 64), 255, np.uint8)
    filled = workloads.Workload(wl.name, wl.model, {"a": data}, wl.flops)
    np.testing.assert_array_equal(model(data), workloads.matmul_integer_reference(filled))


@pytest.mark.requires("avx2")
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
    assert any(note.startswith(_host_int8_isa()) for note in _template_notes(model))
    out = model(**wl.inputs)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, workloads.matmul_integer_reference(wl))
    # Extreme inputs too: every activation at its minimum and maximum.
    for fill in (np.iinfo(activations).min, np.iinfo(activations).max):
        data = np.full((m, k), fill, activations)
        wl_fill = workloads.Workload(wl.name, wl.model, {"a": data}, wl.flops)
        np.testing.assert_array_equal(model(data), workloads.matmul_integer_reference(wl_fill))


@pytest.mark.requires("avx2")
@pytest.mark.parametrize("m, n, k, activations, zp, wzp, weight_range", [
    (64, 64, 128, "uint8", 3, None, (-128, 128)), (7, 40, 36, "int8", -5, None, (-128, 128)),
    (1, 96, 256, "uint8", 255, None, (-128, 128)), (32, 32, 63, "uint8", 0, None, (-128, 128)),
    (16, 24, 64, "uint8", 7, -128, (-128, 128)),  # W - w_zp in [0, 255]: outside s8
])
def test_avx2_s16_kernel_is_exact(m, n, k, activations, zp, wzp, weight_range):
    """Without VNNI (haswell code, run here): s16 operands, exact for any 8-bit data."""
    target = make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    wl = workloads.matmul_integer(m, n, k, activations=activations, zero_point=zp,
                                  weight_zero_point=wzp, weight_range=weight_range)
    model = tvm_hybrid.compile(wl.model, target)
    (name,) = _gemm_kernels(model)
    assert "avx2_s16" in model.lowered[name].script()
    np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))
    # Full-range extremes, where a saturating vpmaddubsw would be wrong.
    for fill in (np.iinfo(activations).min, np.iinfo(activations).max):
        data = np.full((m, k), fill, activations)
        filled = workloads.Workload(wl.name, wl.model, {"a": data}, wl.flops)
        np.testing.assert_array_equal(model(data), workloads.matmul_integer_reference(filled))


@pytest.mark.requires("avx2")
@pytest.mark.parametrize("k, weight_range, isa, k_block", [
    (2048, (-128, 128), "avx2_s16", 512),     # 8-bit weights: the s16 kernel, 512 per K block
    (4096, (-64, 65), "avx2_maddubs", 1024),  # bounded weights: vpmaddubsw, 1024 per K block
])
def test_k_blocked_integer_gemm_is_bit_exact(k, weight_range, isa, k_block, monkeypatch):
    """K blocks (caches set small, 128 KiB of L2, so that a 48-row GEMM takes them) keep the
    integer GEMM bit-exact: Haswell code run here, extremes included."""
    monkeypatch.setattr("tvm_hybrid.schedules.gemm.template.cache_sizes",
                        lambda: CacheSizes(l1d=32 * 1024, l2=128 * 1024, l3=8 << 20))
    target = make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    wl = workloads.matmul_integer(48, 184, k, activations="uint8", zero_point=3,
                                  weight_range=weight_range)
    model = tvm_hybrid.compile(wl.model, target)
    notes = _template_notes(model)
    assert notes and all(n.startswith(isa) and f"K blocks of {k_block}" in n for n in notes), notes
    np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))
    for fill in (0, 255):
        data = np.full((48, k), fill, np.uint8)
        filled = workloads.Workload(wl.name, wl.model, {"a": data}, wl.flops)
        np.testing.assert_array_equal(model(data), workloads.matmul_integer_reference(filled))


def test_k_blocked_vnni_gemm_compiles(monkeypatch):
    """The VNNI family takes K blocks too (Zen 4 code, compiled and read here): 1024 (1 KiB of
    a row of A) with a 32 KiB L1, although a 32-column panel's block then fills it (smaller
    blocks lost there; the L1 bound is fp32's)."""
    monkeypatch.setattr("tvm_hybrid.schedules.gemm.template.cache_sizes",
                        lambda: CacheSizes(l1d=32 * 1024, l2=128 * 1024, l3=8 << 20))
    target = make_target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    wl = workloads.matmul_integer(24, 88, 8192, activations="uint8", zero_point=3)
    model = tvm_hybrid.compile(wl.model, target)
    notes = _template_notes(model)
    assert notes and all(n.startswith("avx512_vnni") and "K blocks of 1024" in n
                         for n in notes), notes
    assert "vpdpbusd" in model.inspect_source("asm")


@pytest.mark.requires("avxvnni")
def test_avx_vnni_kernel_is_bit_exact():
    """The 256-bit AVX-VNNI family, run here when this CPU has AVX-VNNI."""
    target = make_target({"kind": "llvm", "mcpu": "alderlake", "num-cores": 2})
    wl = workloads.matmul_integer(40, 48, 64, activations="int8", zero_point=-7)
    model = tvm_hybrid.compile(wl.model, target)
    (name,) = _gemm_kernels(model)
    assert "avx_vnni" in model.lowered[name].script()
    np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))


@pytest.mark.parametrize("mcpu, isa", [("znver4", "avx512_vnni"), ("alderlake", "avx_vnni"),
                                       ("haswell", "avx2_s16")])
def test_int8_gemm_runs_in_the_template(mcpu, isa):
    """Compiled for a named CPU (not run): the integer GEMM is scheduled by the template with
    that CPU's microkernel family, never left to the fallback."""
    wl = workloads.matmul_integer(256, 256, 256)
    model = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    (name,) = _gemm_kernels(model)
    script = model.lowered[name].script()
    assert TEMPLATE_ANNOTATION in script and isa in script


@pytest.mark.requires("avx2")
@pytest.mark.parametrize("k, wzp", [(30, None), (64, -100)])
def test_integer_matmuls_with_odd_k_or_wide_weights_stay_exact(k, wzp):
    """K % 4 != 0 is zero-padded; weights leaving s8 after the zero point take the s16 kernel
    (on any host: every AVX2 CPU has it)."""
    wl = workloads.matmul_integer(16, 32, k, weight_zero_point=wzp)
    model = tvm_hybrid.compile(wl.model)
    assert _gemm_kernels(model), model.kernel_names()
    if wzp is not None:
        assert all(note.startswith("avx2_s16") for note in _template_notes(model))
    np.testing.assert_array_equal(model(**wl.inputs), workloads.matmul_integer_reference(wl))


@pytest.mark.requires("avx2")
def test_int8_gemm_is_a_tuning_task(tmp_path):
    from tvm_hybrid.tuning import extract_tasks

    (task,) = extract_tasks(workloads.matmul_integer(64, 64, 64).model, HOST)
    assert all(k.kernel.in_dtype in ("uint8", "int16") for k in task.space.heuristic())
