"""Quantized (QDQ) 1x1 convolutions on the integer GEMM: bit-exact, u8 between layers."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

import tvm_hybrid
from tvm_hybrid.bench import workloads

CASES = [((16, 64, 24), (28, 28), "HardSwish"), ((32, 96, 40, 8), (7, 9), "Relu")]


def _float_widths(main: str) -> set[int]:
    """Every dimension of the fp32 tensors of a lowered ``main``."""
    shapes = re.findall(r'R\.Tensor\(\(([^)]*)\), dtype="float32"\)', main)
    return {int(d) for shape in shapes for d in shape.split(",") if d.strip()}


@pytest.mark.requires("avx2")
@pytest.mark.parametrize("channels, size, activation", CASES)
@pytest.mark.parametrize("mcpu", [None, "haswell"])
def test_qdq_pointwise_convs_are_bit_exact_on_the_integer_gemm(channels, size, activation,
                                                                mcpu):
    """The host's integer kernel (VNNI where it has it) and the AVX2 s16 kernel (Haswell code,
    run here): bit-exact against the integer reference, one integer GEMM per convolution with
    the scale, bias, activation and quantization in its kernel, no fp32 activations between
    the layers."""
    wl = workloads.qdq_pointwise_convs(channels, size, activation=activation)
    target = "host" if mcpu is None else {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}
    model = tvm_hybrid.compile(wl.model, target)
    np.testing.assert_array_equal(model(**wl.inputs), workloads.qdq_pointwise_reference(wl))
    gemms = [n for n in model.kernel_names() if "int8_packed_matmul" in n]
    assert len(gemms) == len(channels) - 1, model.kernel_names()
    assert all("cast" in n for n in gemms), gemms  # the epilogue is in the GEMM's kernel
    assert not _float_widths(model.lowered["main"].script()) & set(channels[1:-1])


def test_qdq_pointwise_convs_use_vpdpbusd_with_vnni():
    """Compiled for a VNNI CPU (not run): every 1x1 convolution is a ``vpdpbusd`` GEMM on the
    template."""
    wl = workloads.qdq_pointwise_convs()
    model = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    gemms = [func.script() for gvar, func in model.lowered.functions.items()
             if isinstance(func, tvm.tirx.PrimFunc) and "int8_packed_matmul" in gvar.name_hint]
    assert len(gemms) == 2
    assert all("hybrid.gemm_template" in g and "avx512_vnni" in g for g in gemms)
    assert "vpdpbusd" in model.inspect_source("asm")


def test_integer_convs_the_integer_gemm_does_not_take_go_to_the_fp32_engine():
    """An int32 convolution of 8-bit data that reaches ConvToGemm and is no 1x1 (here a 3x3
    one, which IntegerConvToFloat would have made fp32 already) becomes the fp32 engine's
    convolution where fp32 is exact, never TVM's int32 loop nest."""
    from tvm import relax

    from tvm_hybrid import passes
    from tvm_hybrid.testing.relax_modules import relax_function

    w = np.random.default_rng(0).integers(-127, 128, (16, 8, 3, 3)).astype("int32")
    x = relax.Var("x", relax.TensorType((1, 8, 10, 10), "uint8"))

    def conv(bb, x):
        shifted = bb.emit(relax.op.subtract(relax.op.astype(x, "int32"),
                                            relax.const(3, "int32")))
        y = bb.emit(relax.op.nn.conv2d(shifted, relax.const(w), out_dtype="int32"))
        return relax.op.astype(y, "float32")

    target = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    script = passes.ConvToGemm(target)(relax_function([x], conv)).script()
    assert "R.nn.conv2d" not in script
    assert "hybrid_direct_conv" in script or "R.matmul" in script
