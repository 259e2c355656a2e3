"""Quantized (QDQ) convolutions on the integer GEMM: bit-exact, u8 between layers."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

import tvm_hybrid
from tvm_hybrid.bench import workloads

CASES = [  # channels, size, kernels, strides, activation
    ((16, 64, 24), (28, 28), (1, 1), (1, 1), "HardSwish"),
    ((32, 96, 40, 8), (7, 9), (1, 1, 1), (1, 1, 1), "Relu"),
    ((16, 32, 48, 24), (15, 17), (3, 1, 3), (2, 1, 1), "Relu"),  # padded, strided
    ((3, 24, 40), (32, 32), (3, 5), (2, 1), "HardSwish"),         # K = 27, 600
]
#: Features that give the integer GEMM a u8 dot product (the other convolutions need one).
DOT_PRODUCT = {"avx512vnni", "avxvnni", "amx-int8"}


def _assert_within_a_step(out: np.ndarray, ref: np.ndarray) -> None:
    """The integer sums are exact, but the epilogue is the QDQ graph's float arithmetic
    (``acc * scale + bias``, the activation, ``/ scale_y``), which the compiler may contract
    into FMAs: a value within an ulp of a rounding boundary may land one quantization step
    away (measured: 4e-5 of the outputs of a 64-channel 3x3 stack, never more than a step).
    ``test_qdq_conv_integer_sums_are_bit_exact`` checks the integer core bit for bit."""
    step = float(np.min(np.diff(np.unique(ref))))
    assert np.abs(out - ref).max() <= step * 1.001
    assert np.mean(out != ref) <= 1e-3


def _float_widths(main: str) -> set[int]:
    """Every dimension of the fp32 tensors of a lowered ``main``."""
    shapes = re.findall(r'R\.Tensor\(\(([^)]*)\), dtype="float32"\)', main)
    return {int(d) for shape in shapes for d in shape.split(",") if d.strip()}


@pytest.mark.requires("avx2")
@pytest.mark.parametrize("channels, size, kernels, strides, activation", CASES)
@pytest.mark.parametrize("mcpu", [None, "haswell"])
def test_qdq_convs_are_bit_exact_on_the_integer_gemm(channels, size, kernels, strides,
                                                     activation, mcpu, monkeypatch):
    """The host's integer kernels (VNNI where it has it) and the AVX2 ones (Haswell code, run
    here): as the integer reference (see :func:`_assert_within_a_step`); one integer GEMM per
    1x1 convolution, and
    per other convolution where the CPU has a u8 dot product (else that one is fp32), with
    the scale, bias, activation and quantization in its kernel; no fp32 activations between
    integer layers. (MLP chains off: consecutive small 1x1 convolutions would share one
    chain kernel, ``tests/test_gemm_chain.py``.)"""
    monkeypatch.setenv("TVM_HYBRID_GEMM_CHAINS", "off")
    wl = workloads.qdq_convs(channels, size, kernels=kernels, strides=strides,
                             activation=activation)
    target = "host" if mcpu is None else {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}
    model = tvm_hybrid.compile(wl.model, target)
    _assert_within_a_step(model(**wl.inputs), workloads.qdq_conv_reference(wl))
    dot = mcpu is None and bool(DOT_PRODUCT & tvm_hybrid.host.host_features())
    integer = [dot or k == 1 for k in kernels]
    gemms = [n for n in model.kernel_names() if "int8_packed_matmul" in n]
    assert len(gemms) == sum(integer), model.kernel_names()
    assert all("cast" in n for n in gemms), gemms  # the epilogue is in the GEMM's kernel
    between = {o for o, a, b in zip(channels[1:-1], integer, integer[1:]) if a and b}
    assert not _float_widths(model.lowered["main"].script()) & between


def test_qdq_convs_use_vpdpbusd_with_vnni(monkeypatch):
    """Compiled for a VNNI CPU (not run): every convolution, 1x1 or 3x3 (on the zero-point
    padded im2col), is a ``vpdpbusd`` GEMM on the template (of its own: chains off)."""
    monkeypatch.setenv("TVM_HYBRID_GEMM_CHAINS", "off")
    wl = workloads.qdq_convs((16, 32, 24), (14, 14), kernels=(3, 1))
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


@pytest.mark.requires("avx2")
@pytest.mark.parametrize("mcpu", [None, "haswell"])
def test_qdq_conv_integer_sums_are_bit_exact(mcpu):
    """With power-of-two scales, no bias and ReLU every float step of the epilogue is exact,
    so the outputs equal the integer reference bit for bit."""
    wl = workloads.qdq_convs((64, 64, 128, 64), (20, 20), kernels=(3, 1, 3), strides=(1, 1, 2),
                             activation="Relu", pow2_scales=True)
    target = "host" if mcpu is None else {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}
    model = tvm_hybrid.compile(wl.model, target)
    ref = workloads.qdq_conv_reference(wl)
    assert len(np.unique(ref)) > 32  # not all saturated or zero
    np.testing.assert_array_equal(model(**wl.inputs), ref)


@pytest.mark.requires("avx2")
@pytest.mark.parametrize("kernel", [1, 3])
def test_qdq_convs_of_s8_data_compile_and_match(kernel):
    """s8 activations (a quantizer's QInt8): the 1x1 convolution on the integer GEMM (the data
    shifted to u8), the 3x3 one on the fp32 path (its im2col would be merged with the shift);
    both within float rounding of the dequantized convolution in float64."""
    from tvm import relax

    from tvm_hybrid.testing.relax_modules import relax_function

    rng = np.random.default_rng(0)
    w8 = rng.integers(-127, 128, (16, 24, kernel, kernel)).astype("int8")
    x = relax.Var("x", relax.TensorType((1, 24, 12, 12), "float32"))

    def conv(bb, x):
        scale, zero = relax.const(0.05, "float32"), relax.const(-3, "int8")
        xq = bb.emit(relax.op.quantize(x, scale, zero, out_dtype="int8"))
        xd = bb.emit(relax.op.dequantize(xq, scale, zero))
        wd = bb.emit(relax.op.dequantize(relax.const(w8), relax.const(0.01, "float32"),
                                         relax.const(0, "int8")))
        return relax.op.nn.conv2d(xd, wd, padding=[kernel // 2] * 4)

    model = tvm_hybrid.compile(relax_function([x], conv))
    integer = [n for n in model.kernel_names() if "int8_packed_matmul" in n]
    assert bool(integer) == (kernel == 1), model.kernel_names()
    assert not [k for k in model.kernels if "conv2d" in k]
    data = rng.standard_normal((1, 24, 12, 12)).astype("float32")
    xd = (np.clip(np.round(data / np.float32(0.05)) - 3, -128, 127) + 3) * 0.05
    ref = workloads._conv_nchw(xd.astype(np.float64), w8.astype(np.float64) * 0.01, 1,
                               kernel // 2)
    np.testing.assert_allclose(model(data), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def _qlinear_conv(rng, channels, out, kernel, group, stride, per_channel, bias, signed):
    """A QLinearConv model (weights in [-64, 64]: ONNX Runtime's u8 x s8 kernels without VNNI
    saturate pair sums beyond 32767, so 7-bit weights keep its result exact on every CPU)."""
    from onnx import TensorProto, helper, numpy_helper

    act = np.int8 if signed else np.uint8
    params = {
        "x_scale": np.array(0.03, np.float32), "x_zp": np.array(3 if signed else 120, act),
        "w": rng.integers(-64, 65, (out, channels // group, kernel, kernel)).astype(np.int8),
        "w_scale": ((rng.random(out) * 0.01 + 0.002) if per_channel else np.array(0.004))
        .astype(np.float32),
        "w_zp": np.zeros(out if per_channel else (), np.int8),
        "y_scale": np.array(0.2, np.float32), "y_zp": np.array(0 if signed else 128, act),
    }
    if bias:
        params["bias"] = rng.integers(-3000, 3000, out).astype(np.int32)
    elem = TensorProto.INT8 if signed else TensorProto.UINT8
    node = helper.make_node("QLinearConv", ["x", *params], ["y"], group=group,
                            strides=[stride, stride], pads=[kernel // 2] * 4, name="qconv")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem,
                                                                          [1, channels, 14, 15])],
                              [helper.make_tensor_value_info("y", elem, None)],
                              [numpy_helper.from_array(v, k) for k, v in params.items()])
    info = np.iinfo(act)
    data = rng.integers(info.min, info.max + 1, (1, channels, 14, 15)).astype(act)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                             ir_version=8), data


@pytest.mark.parametrize("channels, out, kernel, group, stride, per_channel, bias, signed", [
    (16, 32, 3, 1, 1, True, True, False),   # 3x3, per-channel scales, int32 bias
    (16, 32, 1, 1, 1, True, True, False),   # pointwise
    (32, 32, 3, 32, 2, True, True, False),  # depthwise, stride 2
    (16, 24, 3, 1, 2, False, False, False),  # per-tensor scale, no bias
    (12, 24, 3, 3, 1, True, True, False),   # grouped
    (16, 32, 3, 1, 1, True, True, True),    # s8 activations
])
def test_qlinear_conv_is_imported_and_matches_onnxruntime(channels, out, kernel, group, stride,
                                                          per_channel, bias, signed):
    """TVM's importer lacks QLinearConv (the QOperator format ONNX Runtime's quantizer writes):
    ours decomposes it to QDQ with the bias at scale x_scale * w_scale, and FoldQDQ takes it.
    Within one quantization step of ONNX Runtime's own QLinearConv (a rounding tie may go
    either way), and of the stock pipeline's float QDQ."""
    ort = pytest.importorskip("onnxruntime", reason="compares with ONNX Runtime's QLinearConv")
    proto, data = _qlinear_conv(np.random.default_rng(channels + out + kernel), channels, out,
                                kernel, group, stride, per_channel, bias, signed)
    model = tvm_hybrid.compile(proto)
    ours = model(data).astype(np.int32)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (theirs,) = session.run(None, {"x": data})
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1
    assert np.mean(ours != theirs) <= 0.01
    stock = tvm_hybrid.compile(proto, pipeline="stock")(data).astype(np.int32)
    assert np.abs(ours - stock).max() <= 1
    # u8 data: the integer GEMM (a KxK one only with a dot product instruction; without one
    # FoldQDQ leaves it to the fp32 direct convolution, test_pass_structure)
    if group == 1 and not signed and (kernel == 1 or {"avx512vnni", "avxvnni"}
                                      & set(tvm_hybrid.host.host_features())):
        assert any("int8_packed_matmul" in k for k in model.kernel_names()), model.kernel_names()
