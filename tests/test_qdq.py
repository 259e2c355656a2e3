"""QDQ models to int8: the rewrite, integer requantization, bit-exactness, int8 between layers."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

import tvm_hybrid
from tvm_hybrid.bench import workloads
from tvm_hybrid.passes.qdq import (
    quantized_multiplier,
    requantization_constants,
    requantize_reference,
)

# Every integer GEMM family (VNNI, AVX-VNNI, the AVX2 s16 kernel) runs on an AVX2 CPU or better.
pytestmark = pytest.mark.requires("avx2")



def _gemm_layers(model) -> list[str]:
    """The GEMM template's note on each integer GEMM layer of ``model`` (one per layer, whether
    the layer is a kernel of its own or part of an MLP chain: tests/test_gemm_chain.py)."""
    import re

    notes = []
    for gvar, func in model.lowered.functions.items():
        name = gvar.name_hint
        if isinstance(func, tvm.tirx.PrimFunc) and ("int8_packed_matmul" in name
                                                    or "gemm_chain" in name):
            notes += re.findall(r'"hybrid.gemm_template": "([^"]+)"', func.script())
    return notes


def test_quantized_multiplier_is_accurate():
    real = np.array([1e-6, 3.3e-3, 0.5, 0.9999999, 1.0, 7.25])
    m, s = quantized_multiplier(real)
    assert np.all((m >= 2**30) & (m < 2**31))
    np.testing.assert_allclose(m / 2.0**s, real, rtol=2**-30)
    with pytest.raises(ValueError):
        quantized_multiplier(np.array([0.0]))


def test_requantize_reference_rounds_half_up_and_saturates():
    bias, m, s = requantization_constants(np.array([0.5]), 1.0, None)
    acc = np.array([[1, 3, -1, -3, 1000, -1000]])
    out = requantize_reference(acc, bias, m, s, 10, "uint8", relu=False)
    np.testing.assert_array_equal(out, [[11, 12, 10, 9, 255, 0]])
    out = requantize_reference(acc, bias, m, s, 10, "uint8", relu=True)
    np.testing.assert_array_equal(out, [[11, 12, 10, 10, 255, 10]])


@pytest.mark.parametrize("ratio", [0.01, 0.7, 2.5, 9.0, 50.0])
def test_bias_keeps_output_precision_when_the_output_scale_is_finer(ratio):
    """sx * sw / sy > 2 used to round the bias to the accumulator's scale: 2-25 steps off.

    Against float QDQ semantics (round((acc * sx * sw + bias) / sy)), the integer result is
    within one step, for any ratio of accumulator to output scale."""
    rng = np.random.default_rng(1)
    acc_scale = np.full(64, 0.01)
    bias = rng.uniform(-3, 3, 64)
    acc = rng.integers(-20000, 20000, (16, 64))
    sy = 0.01 / ratio
    fixed, m, s = requantization_constants(acc_scale, sy, bias)
    got = requantize_reference(acc, fixed, m, s, 0, "int8", relu=False).astype(np.int64)
    exact = np.clip(np.round((acc * acc_scale + bias) / sy), -128, 127)
    assert np.abs(got - exact).max() <= 1


@pytest.mark.parametrize("batch, dims", [
    (8, (64, 96, 32)),
    (32, (13, 512, 256, 128)),        # MLP_1: K = 13 is zero-padded to 16
    (5, (100, 36, 20, 7)),
])
def test_qdq_mlp_is_bit_exact_and_int8_between_layers(batch, dims, monkeypatch):
    monkeypatch.setenv("TVM_HYBRID_GEMM_CHAINS", "off")  # one kernel per layer, to inspect
    wl = workloads.qdq_mlp(batch, dims)
    model = tvm_hybrid.compile(wl.model)
    np.testing.assert_array_equal(model(**wl.inputs), workloads.qdq_reference(wl))
    names = model.kernel_names()
    gemms = [n for n in names if "int8_packed_matmul" in n]
    assert len(gemms) == len(dims) - 1, names
    assert all("requantize" in n for n in gemms), names  # requantization fused in the GEMM
    # Between layers only 8-bit tensors flow: no fp32 tensor of any layer's width in main.
    main = model.lowered["main"].script()
    for width in dims[1:-1]:
        assert f"({batch}, {width}), dtype=\"float32\"" not in main
    # Within a quantization step of TVM's float evaluation of the same QDQ graph.
    stock = tvm_hybrid.compile(wl.model, pipeline="stock")(**wl.inputs)
    out = model(**wl.inputs)
    last_scale = float(np.min(np.abs(np.diff(np.unique(out))))) if out.size > 1 else 1.0
    assert np.abs(out - stock).max() <= last_scale * 1.01


def test_qdq_mlp_with_sigmoid_matches_reference():
    wl = workloads.qdq_mlp(16, (479, 256, 64, 1), final="Sigmoid")
    model = tvm_hybrid.compile(wl.model)
    np.testing.assert_allclose(model(**wl.inputs), workloads.qdq_reference(wl), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("mcpu, instruction, isa", [
    ("znver4", "vpdpbusd", "avx512_vnni"), ("haswell", "vpmaddwd", "avx2_s16")])
def test_qdq_gemm_kernels_use_the_template(mcpu, instruction, isa):
    """Compiled for a named CPU (not run): every QDQ GEMM kernel is on the template."""
    wl = workloads.qdq_mlp(32, (256, 128, 64))
    model = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    layers = _gemm_layers(model)
    assert len(layers) == 2 and all(isa in note for note in layers), layers
    asm = model.inspect_source("asm")
    assert instruction in asm and "vpmaddubsw" not in asm


def test_qdq_without_vnni_uses_the_exact_avx2_kernel():
    wl = workloads.qdq_mlp(8, (64, 32, 16))
    model = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    assert len(_gemm_layers(model)) == 2, model.kernel_names()
    np.testing.assert_array_equal(model(**wl.inputs), workloads.qdq_reference(wl))


@pytest.mark.parametrize("reduce_range, isa", [(True, "avx2_maddubs"), (False, "avx2_s16")])
def test_qdq_reduce_range_weights_take_vpmaddubsw_without_vnni(reduce_range, isa):
    """7-bit weights (ONNX Runtime's reduce_range) run on the vpmaddubsw kernel on an AVX2 CPU,
    8-bit ones on s16; both bit-exact against the integer reference (haswell code, run here)."""
    wl = workloads.qdq_mlp(32, (13, 512, 256, 128), reduce_range=reduce_range)
    model = tvm_hybrid.compile(wl.model, {"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    layers = _gemm_layers(model)
    assert len(layers) == 3 and all(isa in note for note in layers), layers
    np.testing.assert_array_equal(model(**wl.inputs), workloads.qdq_reference(wl))


def test_without_avx2_qdq_models_keep_the_float_path():
    """A target with no int8 microkernel leaves QDQ to TVM's float lowering (as stock)."""
    wl = workloads.qdq_mlp(8, (64, 32, 16))
    target = {"kind": "llvm", "mcpu": "nehalem", "num-cores": 2}
    model = tvm_hybrid.compile(wl.model, target)
    assert not [n for n in model.kernel_names() if "int8" in n]
    stock = tvm_hybrid.compile(wl.model, target, pipeline="stock")
    np.testing.assert_allclose(model(**wl.inputs), stock(**wl.inputs), rtol=1e-5, atol=1e-6)


def _qlinear_matmul_model(m, k, n, a_dtype, seed=0, weight_bound=127):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    elem = {"uint8": TensorProto.UINT8, "int8": TensorProto.INT8}[a_dtype]
    b = rng.integers(-weight_bound, weight_bound + 1, (k, n)).astype(np.int8)
    params = {
        "a_scale": np.array(0.02, np.float32),
        "a_zp": np.array(120 if a_dtype == "uint8" else -7, a_dtype),
        "b": b,
        "b_scale": (0.01 * rng.uniform(0.5, 1.5, n)).astype(np.float32),
        "b_zp": np.zeros(n, np.int8),
        "y_scale": np.array(0.3, np.float32),
        "y_zp": np.array(128 if a_dtype == "uint8" else 0, a_dtype),
    }
    node = helper.make_node("QLinearMatMul", ["a", "a_scale", "a_zp", "b", "b_scale", "b_zp",
                                              "y_scale", "y_zp"], ["y"])
    graph = helper.make_graph([node], "qlinear", [helper.make_tensor_value_info("a", elem, [m, k])],
                              [helper.make_tensor_value_info("y", elem, [m, n])],
                              [numpy_helper.from_array(v, name) for name, v in params.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    info = np.iinfo(a_dtype)
    data = rng.integers(info.min, info.max + 1, (m, k)).astype(a_dtype)
    acc = (data.astype(np.int64) - int(params["a_zp"])) @ b.astype(np.int64)
    scale = (np.float32(params["a_scale"]) * params["b_scale"]).astype(np.float32)
    bias_fixed, mult, shift = requantization_constants(scale, float(params["y_scale"]), None)
    want = requantize_reference(acc, bias_fixed, mult, shift, int(params["y_zp"]), a_dtype,
                                relu=False)
    return proto, data, want


@pytest.mark.parametrize("a_dtype", ["uint8", "int8"])
def test_qlinear_matmul_is_imported_and_bit_exact(a_dtype):
    """TVM lacks a QLinearMatMul importer: ours decomposes it to QDQ, FoldQDQ makes it int8."""
    proto, data, want = _qlinear_matmul_model(16, 64, 48, a_dtype)
    model = tvm_hybrid.compile(proto)
    (name,) = [n for n in model.kernel_names() if "int8_packed_matmul" in n]
    assert "requantize" in name  # s8 activations add one kernel: the shift to u8
    np.testing.assert_array_equal(model(data), want)
    stock = tvm_hybrid.compile(proto, pipeline="stock")(data)  # float QDQ: within one step
    assert np.abs(stock.astype(np.int32) - want).max() <= 1


def test_qlinear_matmul_agrees_with_onnxruntime():
    """Weights in [-64, 64]: without VNNI, ONNX Runtime's u8 x s8 kernel (``vpmaddubsw``)
    saturates a pair of products beyond 32767, so only 7-bit weights (255 * 128 <= 32767)
    give it exact sums on every CPU; hybrid is exact for any weights (the test above)."""
    ort = pytest.importorskip("onnxruntime", reason="compares with ONNX Runtime's QLinearMatMul")
    proto, data, _ = _qlinear_matmul_model(32, 128, 64, "uint8", seed=1, weight_bound=64)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (theirs,) = session.run(None, {"a": data})
    ours = tvm_hybrid.compile(proto)(data)
    assert np.abs(ours.astype(np.int32) - theirs).max() <= 1  # ties may round differently


def test_qdq_gemm_with_transposed_per_channel_weights():
    """Gemm(transB=1) with W[N, K] quantized per output channel (axis 0) and a bias."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    m, k, n = 16, 64, 48
    wq = rng.integers(-127, 128, (n, k)).astype(np.int8)
    ws = (0.01 * rng.uniform(0.5, 1.5, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    sx, zx, sy, zy = np.float32(0.02), np.uint8(128), np.float32(0.05), np.uint8(0)
    inits = {"sx": np.array(sx), "zx": np.array(zx), "wq": wq, "ws": ws,
             "wz": np.zeros(n, np.int8), "b": bias, "sy": np.array(sy), "zy": np.array(zy)}
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("Gemm", ["xd", "wd", "b"], ["g"], transB=1),
        helper.make_node("Relu", ["g"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "sy", "zy"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "qgemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(v, name) for name, v in inits.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    x = rng.standard_normal((m, k)).astype(np.float32)
    model = tvm_hybrid.compile(proto)
    assert [n_ for n_ in model.kernel_names() if "int8_packed_matmul" in n_]
    xq = np.clip(np.round(x / sx) + zx, 0, 255).astype(np.int64)
    acc = (xq - int(zx)) @ wq.T.astype(np.int64)
    scale = (sx * ws).astype(np.float32)
    bias_fixed, mult, shift = requantization_constants(scale, float(sy), bias)
    yq = requantize_reference(acc, bias_fixed, mult, shift, int(zy), "uint8", relu=True)
    want = (yq.astype(np.int32) - int(zy)).astype(np.float32) * sy
    np.testing.assert_array_equal(model(x), want)


def test_weights_quantized_in_the_graph_fold_to_integer_initializers():
    """QuantizeLinear of constants (what ONNX Runtime's quantizer writes for weights kept in
    Constant nodes) folds to the integer initializer it computes (any size: a weight above the
    fold's limit for other ops is included), bit-identical to ONNX Runtime's
    QuantizeLinear: per tensor without a zero point (u8), per axis 0 and the default axis 1
    (s8), from an initializer and from a Constant node; a QuantizeLinear of an input stays."""
    ort = pytest.importorskip("onnxruntime", reason="compares with ONNX Runtime's QuantizeLinear")
    from onnx import TensorProto, helper, numpy_helper

    from tvm_hybrid.frontend.fold import MAX_FOLDED_ELEMENTS, fold_constants

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 5, MAX_FOLDED_ELEMENTS // 16)) * 3).astype(np.float32)
    w[0, 0, 0] = 2.5 * 0.5  # a tie at scale 0.5: rounds to even
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.float32(0.5), "s"),
             numpy_helper.from_array((rng.random(6) * 0.1 + 0.01).astype(np.float32), "s0"),
             numpy_helper.from_array(np.zeros(6, np.int8), "z0"),
             numpy_helper.from_array((rng.random(5) * 0.1 + 0.01).astype(np.float32), "s1"),
             numpy_helper.from_array(np.array([3, -2, 0, 1, 7], np.int8), "z1")]
    constant = helper.make_node("Constant", [], ["wc"], value=numpy_helper.from_array(w))
    nodes = [constant,
             helper.make_node("QuantizeLinear", ["w", "s"], ["q_tensor"]),
             helper.make_node("QuantizeLinear", ["wc", "s0", "z0"], ["q_axis0"], axis=0),
             helper.make_node("QuantizeLinear", ["w", "s1", "z1"], ["q_axis1"]),
             helper.make_node("QuantizeLinear", ["x", "s"], ["q_input"])]
    outputs = [("q_tensor", TensorProto.UINT8), ("q_axis0", TensorProto.INT8),
               ("q_axis1", TensorProto.INT8), ("q_input", TensorProto.UINT8)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                         [4])],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
                              inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    folded, _ = fold_constants(proto, {"x": (4,)})
    left = [n for n in folded.graph.node if n.op_type == "QuantizeLinear"]
    assert [n.input[0] for n in left] == ["x"]  # the input's stays
    # (the folded values are graph outputs here, so fold.py emits them as Constant nodes)
    values = {n.output[0]: numpy_helper.to_array(n.attribute[0].t)
              for n in folded.graph.node if n.op_type == "Constant"}
    x = rng.standard_normal(4).astype(np.float32)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for (name, _), theirs in zip(outputs[:3], session.run(None, {"x": x})[:3]):
        assert values[name].dtype == theirs.dtype
        np.testing.assert_array_equal(values[name], theirs)
    assert values["q_tensor"][0, 0, 0] == 2  # 1.25 / 0.5 = 2.5 -> 2
