"""``ConvToGemm``: dense convolutions run as im2col + the GEMM template, with ONNX Runtime's
results (relative 1e-4), for kernel sizes, strides, asymmetric padding, dilation and bias;
grouped and depthwise convolutions keep their own path and stay right."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvm_hybrid

ort = pytest.importorskip("onnxruntime", reason="the comparisons need onnxruntime (test extra)")


def _conv_model(c=8, o=16, k=3, size=(13, 11), group=1, relu=True, **attrs):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((o, c // group, k, k)) * 0.2).astype("float32")
    b = rng.standard_normal(o).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], group=group, **attrs)]
    nodes.append(helper.make_node("Relu" if relu else "Identity", ["c"], ["y"]))
    graph = helper.make_graph(
        nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, *size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "W"), onnx.numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.standard_normal((2, c, *size)).astype("float32")
    return model, x


def _onnxruntime(model, x):
    return ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _compiles_and_matches(model, x):
    """Compile ``model``; its output on ``x`` matches ONNX Runtime's (relative 1e-4)."""
    compiled = tvm_hybrid.compile(model)
    expected = _onnxruntime(model, x)
    got = np.asarray(compiled(x=x))
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    return compiled


CASES = [
    dict(k=1), dict(k=3, pads=[1, 1, 1, 1]), dict(k=3, strides=[2, 2], pads=[1, 1, 1, 1]),
    dict(k=5, pads=[2, 1, 0, 2]), dict(k=3, dilations=[2, 2], pads=[2, 2, 2, 2]),
    dict(k=1, strides=[2, 2]), dict(k=3, relu=False, c=3, o=5),
    dict(k=3, auto_pad="SAME_UPPER"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_dense_conv_runs_on_the_gemm_template_and_matches(case):
    model, x = _conv_model(**case)
    compiled = _compiles_and_matches(model, x)
    gemms = {k.schedule for k in compiled.kernels.values() if _on_the_engine(k.name)}
    assert gemms == {"template"}
    assert not [n for n in compiled.kernel_names() if "conv2d" in n]


def _on_the_engine(name: str) -> bool:
    return "packed_matmul" in name or "direct_conv" in name


def test_grouped_conv_keeps_its_path_and_matches():
    model, x = _conv_model(group=2, o=8, pads=[1, 1, 1, 1])
    compiled = tvm_hybrid.compile(model)
    np.testing.assert_allclose(np.asarray(compiled(x=x)), _onnxruntime(model, x), rtol=1e-4,
                               atol=1e-4)
    assert [n for n in compiled.kernel_names() if "conv2d" in n]
    assert not [n for n in compiled.kernel_names() if _on_the_engine(n)]


@pytest.mark.parametrize("case", [dict(k=3, pads=[1, 1, 1, 1]),
                                  dict(k=3, strides=[2, 2], pads=[1, 1, 1, 1]),
                                  dict(k=5, pads=[2, 1, 0, 2]), dict(k=3, dilations=[2, 2]),
                                  dict(k=1)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_depthwise_conv_runs_its_unrolled_kernel_and_matches(case):
    model, x = _conv_model(group=8, c=8, o=8, **case)
    compiled = _compiles_and_matches(model, x)
    names = compiled.kernel_names()
    assert [n for n in names if "depthwise" in n] and not [n for n in names if "conv2d" in n]


TRANSPOSED = [
    dict(k=2, strides=[2, 2]), dict(k=2, strides=[2, 2], output_padding=[1, 1]),
    dict(k=3, strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]),
    dict(k=4, strides=[2, 2], pads=[1, 1, 1, 1]), dict(k=3, dilations=[2, 2]),
    dict(k=3, strides=[1, 1], pads=[1, 1, 1, 1]),
]


@pytest.mark.parametrize("case", TRANSPOSED,
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_transposed_conv_runs_as_gemm_and_col2im(case):
    rng = np.random.default_rng(1)
    k = case.pop("k")
    w = (rng.standard_normal((8, 6, k, k)) * 0.2).astype("float32")  # [C, O, KH, KW]
    b = rng.standard_normal(6).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("ConvTranspose", ["x", "W", "B"], ["y"], **case)], "deconv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 7, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "W"), onnx.numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.standard_normal((2, 8, 7, 9)).astype("float32")
    compiled = _compiles_and_matches(model, x)
    names = compiled.kernel_names()
    assert [n for n in names if "col2im" in n] and not [n for n in names if "transpose" in n
                                                       and "conv2d" in n]


@pytest.mark.parametrize("case", [dict(k=3, pads=[1, 1]), dict(k=5, strides=[2], pads=[2, 1]),
                                  dict(k=3, dilations=[2]), dict(k=3, group=8, pads=[1, 1])],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_conv1d_runs_as_a_height_one_conv2d_and_matches(case):
    """Audio models (silero VAD) are 1-D convolutions: the GEMM (or depthwise) kernel too."""
    rng = np.random.default_rng(2)
    k, group = case.pop("k"), case.get("group", 1)
    w = (rng.standard_normal((8, 8 // group, k)) * 0.2).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["y"], **case)], "conv1d",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.standard_normal((2, 8, 40)).astype("float32")
    compiled = _compiles_and_matches(model, x)
    assert not [n for n in compiled.kernel_names() if "conv1d" in n or "conv2d" in n]


@pytest.mark.parametrize("case", [dict(k=3, pads=[1, 1, 1, 1], size=(12, 12), c=16, o=24),
                                  dict(k=3, dilations=[2, 2], size=(14, 16), c=16, o=40),
                                  dict(k=5, pads=[2, 2, 2, 2], size=(9, 8), c=8, o=32)],
                         ids=["3x3", "dilated", "5x5"])
def test_stride_one_conv_runs_direct_without_im2col(case):
    model, x = _conv_model(**case)
    compiled = _compiles_and_matches(model, x)
    (conv,) = [k for k in compiled.kernels.values() if "direct_conv" in k.name]
    assert conv.schedule == "template" and "direct convolution" in conv.detail
    assert not [n for n in compiled.kernel_names() if "im2col" in n]


def test_direct_conv_is_declined_where_no_microkernel_tiles_the_rows():
    # 17 pixels per row: no fp32 microkernel with at least 4 rows divides it, so im2col.
    model, x = _conv_model(k=3, pads=[1, 1, 1, 1], size=(6, 17), c=16, o=16)
    compiled = _compiles_and_matches(model, x)
    assert not [n for n in compiled.kernel_names() if "direct_conv" in n]
    assert [n for n in compiled.kernel_names() if "im2col" in n]


@pytest.mark.parametrize("mcpu,register", [("haswell", "ymm"), ("znver5", "zmm")])
def test_direct_conv_assembly_uses_the_isa_fma(mcpu, register):
    model, _ = _conv_model(k=3, pads=[1, 1, 1, 1], size=(12, 12), c=16, o=32)
    compiled = tvm_hybrid.compile(model, target={"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    (conv,) = [k for k in compiled.kernels.values() if "direct_conv" in k.name]
    assert conv.schedule == "template"
    assert re.search(rf"vfmadd\d+ps\s+[^\n]*%{register}", compiled.inspect_source("asm"))
