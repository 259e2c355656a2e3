"""bf16: the AVX512-BF16 microkernel, the emulated (widening) one, bf16 models, precision="bf16".

Assembly tests compile for named CPUs (any host); numeric tests run whichever bf16 kernel the
host has (native with AVX512-BF16, else the emulated one), and the emulated kernel is also run
here directly (haswell code) wherever the host has AVX2.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from onnx import numpy_helper
from tvm import relax

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.passes.packed_gemm import KERNEL_NAMES, pack_weight

BF16_PACKED_MATMUL = KERNEL_NAMES["bfloat16"]

HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}


def _bf16_kernels(model) -> list[str]:
    return [g.name_hint for g, f in model.lowered.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and BF16_PACKED_MATMUL in g.name_hint]


def _bf16_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Both operands rounded to bf16, products and sums exact (float64)."""
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    wb = w.astype(ml_dtypes.bfloat16).astype(np.float64)
    return xb @ wb


def test_bf16_packing_layout():
    w = np.arange(5 * 40, dtype=np.float32).reshape(5, 40)
    packed = pack_weight(w, 32, 2, ml_dtypes.bfloat16)
    assert packed.shape == (2, 3, 32, 2) and packed.dtype == ml_dtypes.bfloat16
    for k in range(5):
        for n in range(40):
            assert packed[n // 32, k // 2, n % 32, k % 2] == w[k, n].astype(ml_dtypes.bfloat16)
    assert not packed[:, 2, :, 1].astype(np.float32).any()  # K padded to even with zeros


@pytest.mark.parametrize("mcpu", ["znver4", "cooperlake"])  # sapphirerapids: AMX, test_amx
def test_bf16_assembly_uses_vdpbf16ps(mcpu):
    wl = workloads.gemm(64, 64, 128)
    model = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": mcpu, "num-cores": 2},
                               precision="bf16")
    assert _bf16_kernels(model)
    asm = model.inspect_source("asm")
    assert asm.count("vdpbf16ps") >= 8 and "vdpbf16ps\t%zmm" in asm


@pytest.mark.parametrize("mcpu, register, isa", [
    ("skylake-avx512", "zmm", "avx512_bf16emu"), ("haswell", "ymm", "avx2_bf16emu"),
    ("znver3", "ymm", "avx2_bf16emu")])
def test_bf16_without_avx512_bf16_widens_in_the_microkernel(mcpu, register, isa, caplog):
    """No AVX512-BF16 (compiled, not run): bf16 weights, widened by shifts and masks, FMAs."""
    wl = workloads.gemm(64, 64, 128)
    with caplog.at_level("WARNING"):
        model = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": mcpu, "num-cores": 2},
                                   precision="bf16")
    assert "bf16 compute is emulated" in caplog.text
    (name,) = _bf16_kernels(model)
    assert isa in model.lowered[name].script()
    asm = model.inspect_source("asm")
    assert "vdpbf16ps" not in asm
    assert len(re.findall(rf"vfmadd\d+ps\s+.*%{register}", asm)) >= 8
    assert re.search(rf"vpslld\s+\$16, .*%{register}", asm)
    # The weights stay bf16 in the compiled module (half the bytes of fp32).
    packed = [c for c in _constants(model) if c.dtype == ml_dtypes.bfloat16]
    assert packed and packed[0].size >= 64 * 128


def test_precision_bf16_needs_avx2():
    with pytest.raises(tvm_hybrid.TargetError, match="AVX2"):
        tvm_hybrid.compile(workloads.gemm(8, 8, 8).model,
                           {"kind": "llvm", "mcpu": "nehalem"}, precision="bf16")
    with pytest.raises(ValueError, match="precision"):
        tvm_hybrid.compile(workloads.gemm(8, 8, 8).model, precision="fp16")


def _constants(model) -> list[np.ndarray]:
    found = []
    tvm.relax.analysis.post_order_visit(
        model.lowered["main"],
        lambda e: found.append(e.value.numpy())
        if isinstance(e, tvm.ir.GenericConst) and hasattr(e.value, "numpy") else None)
    return found


@pytest.mark.requires("avx2", "fma")
@pytest.mark.parametrize("target", ["host", "haswell"])
@pytest.mark.parametrize("m, n, k", [(64, 64, 64), (1, 96, 255), (37, 100, 37), (256, 256, 512)])
def test_bf16_mode_gemm_accuracy(target, m, n, k):
    """precision="bf16": the GEMM equals the bf16-rounded product up to fp32 summation, with
    the host's bf16 kernel and with the emulated AVX2 one."""
    wl = workloads.gemm(m, n, k)
    model = tvm_hybrid.compile(wl.model, HASWELL if target == "haswell" else "host",
                               precision="bf16")
    assert _bf16_kernels(model)
    x = wl.inputs["a"]
    w = numpy_helper.to_array(wl.model.graph.initializer[0])
    out = model(x)
    assert out.dtype == np.float32
    scale = np.abs(_bf16_reference(x, w)).max()
    np.testing.assert_allclose(out, _bf16_reference(x, w), atol=1e-5 * scale, rtol=0)
    # ...and is within bf16's expected error of the fp32 result: 2**-8 relative per operand.
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(out - exact).max() <= 2**-7 * np.abs(x).max() * np.abs(w).max() * k ** 0.5 * 4


@pytest.mark.requires("avx2", "fma")
def test_bf16_mode_bert_layer_error_is_within_bf16_expectations():
    wl = workloads.bert_layer(1, 32, hidden=128, heads=2, ffn=256)
    bf16 = tvm_hybrid.compile(wl.model, precision="bf16")
    fp32 = tvm_hybrid.compile(wl.model)
    assert len(_bf16_kernels(bf16)) >= 4
    a, b = bf16(**wl.inputs), fp32(**wl.inputs)
    rel = np.abs(a - b).max() / np.abs(b).max()
    assert 1e-6 < rel < 2e-2, rel  # clearly bf16 (not fp32), clearly right


@pytest.mark.requires("avx2", "fma")
def test_bf16_model_runs_on_the_microkernel():
    """A Relax model whose weights and activations are bf16 (not the fp32 mode).

    (Built in Relax: TVM's ONNX importer misreads BFLOAT16 initializers, stock and hybrid
    alike.)
    """
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype(ml_dtypes.bfloat16)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((16, 64), "bfloat16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(w)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    model = tvm_hybrid.compile(bb.get())
    assert _bf16_kernels(model), model.kernel_names()
    data = rng.standard_normal((16, 64)).astype(ml_dtypes.bfloat16)
    got = model(data)
    assert got.dtype == ml_dtypes.bfloat16
    want = _bf16_reference(data.astype(np.float32), w.astype(np.float32))
    # fp32 accumulation, one rounding to bf16 at the end: within half a bf16 ulp (2**-8).
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2**-8, atol=1e-6)
