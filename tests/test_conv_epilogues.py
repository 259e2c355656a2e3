"""Convolution epilogues in the GEMM kernel: ``SinkReshapes`` and ``FoldScalesIntoWeights``
(structural before/after tests and numerics), the pointwise epilogue stage (SiLU, HardSwish,
HardSigmoid, clips, a ReLU after the residual), ``Clip`` imported as maximum/minimum, fake
quantization as elementwise ops (bit-identical), and the fast sigmoid. End to end against
ONNX Runtime within relative 1e-4 of the output's scale."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax

import tvm_hybrid
from tvm_hybrid.frontend import import_model
from tvm_hybrid.host import host_target
from tvm_hybrid.passes import ConvToGemm, FastMath, FoldScalesIntoWeights, SinkReshapes
from tvm_hybrid.testing.relax_modules import relax_function as _function

ort = pytest.importorskip("onnxruntime", reason="the comparisons need onnxruntime (test extra)")


def _ops(mod: tvm.IRModule) -> list[str]:
    """The Relax ops ``main`` binds, in order."""
    names = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                names.append(value.op.name.removeprefix("relax."))
    return names


def _run(mod: tvm.IRModule, *args: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a) for a in args)).numpy()


RNG = np.random.default_rng(0)
W = RNG.standard_normal((24, 16)).astype("float32")
B = RNG.standard_normal(16).astype("float32")


def test_sink_reshapes_moves_a_gemm_reshape_below_its_epilogue():
    x = relax.Var("x", relax.TensorType((36, 24), "float32"))
    r = relax.Var("r", relax.TensorType((1, 6, 6, 16), "float32"))

    def body(bb, x, r):
        y = bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(x, relax.const(W))), (1, 6, 6, 16)))
        y = bb.emit(relax.op.add(y, relax.const(B.reshape(1, 1, 1, 16))))
        y = bb.emit(relax.op.multiply(y, bb.emit(relax.op.sigmoid(y))))
        return relax.op.add(r, y)

    before = _function([x, r], body)
    after = SinkReshapes()(before)
    assert _ops(before) == ["matmul", "reshape", "add", "sigmoid", "multiply", "add"]
    # The residual is reshaped to the GEMM's shape (a view), the result reshaped once.
    assert _ops(after) == ["matmul", "add", "sigmoid", "multiply", "reshape", "add", "reshape"]
    args = RNG.standard_normal((36, 24)).astype("float32"), \
        RNG.standard_normal((1, 6, 6, 16)).astype("float32")
    np.testing.assert_allclose(_run(after, *args), _run(before, *args), rtol=1e-6, atol=1e-6)


def test_sink_reshapes_leaves_reshapes_that_are_not_from_a_gemm_or_change_the_channels():
    x = relax.Var("x", relax.TensorType((36, 16), "float32"))
    other = _function([x], lambda bb, x: relax.op.sigmoid(
        bb.emit(relax.op.reshape(x, (1, 6, 6, 16)))))
    assert _ops(SinkReshapes()(other)) == ["reshape", "sigmoid"]
    # A per-channel constant after a reshape that regroups the last axis cannot move.
    regrouped = _function([x], lambda bb, x: relax.op.add(
        bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(x, relax.const(W[:16]))), (36, 4, 4))),
        relax.const(B[:4])))
    assert _ops(SinkReshapes()(regrouped)) == ["matmul", "reshape", "add"]


def _batch_norm_after_gemm(bb, x):
    mean, var = RNG.standard_normal(16).astype("float32"), RNG.random(16).astype("float32") + .5
    gamma, beta = RNG.standard_normal(16).astype("float32"), RNG.standard_normal(16).astype(
        "float32")
    y = bb.emit(relax.op.matmul(x, relax.const(W)))
    y = bb.emit(relax.op.add(y, relax.const(B)))
    y = bb.emit(relax.op.subtract(y, relax.const(mean)))
    y = bb.emit(relax.op.divide(y, relax.const(np.sqrt(var + 1e-5))))
    y = bb.emit(relax.op.multiply(relax.const(gamma), y))
    return relax.op.add(y, relax.const(beta))


def test_fold_scales_turns_a_batch_norm_after_a_gemm_into_its_weight_and_one_bias():
    x = relax.Var("x", relax.TensorType((36, 24), "float32"))
    before = _function([x], _batch_norm_after_gemm)
    after = FoldScalesIntoWeights()(before)
    assert _ops(before) == ["matmul", "add", "subtract", "divide", "multiply", "add"]
    assert _ops(after) == ["matmul", "add"]
    arg = RNG.standard_normal((36, 24)).astype("float32")
    np.testing.assert_allclose(_run(after, arg), _run(before, arg), rtol=1e-5, atol=1e-5)


def test_fold_scales_leaves_a_gemm_that_is_also_used_elsewhere():
    x = relax.Var("x", relax.TensorType((36, 24), "float32"))

    def body(bb, x):
        y = bb.emit(relax.op.matmul(x, relax.const(W)))
        return relax.op.add(bb.emit(relax.op.multiply(y, relax.const(B))), y)

    before = _function([x], body)
    assert _ops(FoldScalesIntoWeights()(before)) == ["matmul", "multiply", "add"]


def test_fast_sigmoid_matches_and_keeps_nan():
    x = relax.Var("x", relax.TensorType((4000,), "float32"))
    mod = FastMath()(_function([x], lambda bb, x: relax.op.sigmoid(x)))
    assert "sigmoid" not in _ops(mod)
    values = np.concatenate([np.linspace(-100, 100, 3996), [np.nan, np.inf, -np.inf, 0]])
    got = _run(mod, values.astype("float32"))
    expected = 1 / (1 + np.exp(-values))
    assert np.isnan(got[3996])
    np.testing.assert_allclose(got[:3996], expected[:3996], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got[3997:], [1.0, 0.0, 0.5])


# --- end to end: ONNX convolutions with the activations real exports use ---------------------

def _activation(kind: str, x: str, nodes: list, inits: list) -> str:
    """Append ``kind`` applied to ``x``; return its output's name."""
    def add(op, inputs, **attrs):
        out = f"{x}_{kind}_{len(nodes)}"
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    if kind == "silu":
        return add("Mul", [x, add("Sigmoid", [x])])
    if kind == "hardswish":
        return add("HardSwish", [x])
    if kind == "hardsigmoid_mul":
        return add("Mul", [x, add("HardSigmoid", [x], alpha=1 / 6, beta=0.5)])
    if kind == "relu6":
        inits += [onnx.numpy_helper.from_array(np.array(v, "float32"), f"{x}_{n}")
                  for n, v in (("lo", 0.0), ("hi", 6.0))]
        return add("Clip", [x, f"{x}_lo", f"{x}_hi"])
    return add("Relu", [x])


def _conv_block(activation: str, residual: bool, c: int = 16):
    """``x -> Conv 3x3 -> BatchNormalization -> activation [-> + x -> Relu]``."""
    w = (RNG.standard_normal((c, c, 3, 3)) * 0.2).astype("float32")
    stats = [RNG.standard_normal(c), RNG.standard_normal(c), RNG.standard_normal(c),
             RNG.random(c) + 0.5]
    inits = [onnx.numpy_helper.from_array(w, "W")] + [
        onnx.numpy_helper.from_array(v.astype("float32"), n)
        for n, v in zip(("gamma", "beta", "mean", "var"), stats)]
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"],
                              ["bn"])]
    out = _activation(activation, "bn", nodes, inits)
    if residual:
        nodes.append(helper.make_node("Add", [out, "x"], ["sum"]))
        out = _activation("relu", "sum", nodes, inits)
    nodes.append(helper.make_node("Identity", [out], ["y"]))
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 12, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual-relu"])
@pytest.mark.parametrize("activation", ["silu", "hardswish", "hardsigmoid_mul", "relu6", "relu"])
def test_conv_batch_norm_activation_residual_is_one_gemm_kernel(activation, residual):
    model = _conv_block(activation, residual)
    x = RNG.standard_normal((1, 16, 12, 10)).astype("float32")
    compiled = tvm_hybrid.compile(model)
    expected = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = np.asarray(compiled(x=x))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    kernels = compiled.kernels.values()
    gemms = [k for k in kernels if "packed_matmul" in k.name or "direct_conv" in k.name]
    assert len(gemms) == 1 and gemms[0].schedule == "template"
    # Besides the convolution (with BatchNorm, activation and residual inside): the padding
    # and the layout changes at the model's ends, nothing elementwise.
    others = sorted(k.name for k in kernels if k not in gemms)
    assert all(any(part in name for part in ("im2col", "transpose", "pad")) for name in others), \
        others


def test_clip_with_constant_bounds_imports_as_maximum_and_minimum():
    inits = []
    nodes = []
    out = _activation("relu6", "x", nodes, inits)
    graph = helper.make_graph(
        nodes, "clip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    ops = _ops(import_model(model).mod)
    assert "call_tir" not in ops and {"maximum", "minimum"} <= set(ops)
    x = (RNG.standard_normal((4, 8)) * 5).astype("float32")
    np.testing.assert_array_equal(np.asarray(tvm_hybrid.compile(model)(x=x)), np.clip(x, 0, 6))


def test_clip_with_a_bound_from_an_input_keeps_tvms_conversion():
    graph = helper.make_graph(
        [helper.make_node("Clip", ["x", "lo"], ["y"])], "clip",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
         helper.make_tensor_value_info("lo", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = RNG.standard_normal((4, 8)).astype("float32")
    lo = np.array(0.25, "float32")
    np.testing.assert_array_equal(np.asarray(tvm_hybrid.compile(model)(x=x, lo=lo)),
                                  np.maximum(x, lo))


@pytest.mark.parametrize("dtype,zero", [("uint8", 131), ("int8", -3)])
def test_fake_quantization_becomes_elementwise_ops_with_the_same_bits(dtype, zero):
    x = relax.Var("x", relax.TensorType((2, 8, 5, 5), "float32"))
    scale = relax.const(np.float32(0.0371))
    zp = relax.const(np.array(zero, dtype))

    def body(bb, x):
        q = bb.emit(relax.op.quantize(x, scale, zp, axis=1, out_dtype=dtype))
        return relax.op.dequantize(q, scale, zp, axis=1, out_dtype="float32")

    before = _function([x], body)
    after = ConvToGemm(host_target())(before)
    assert "quantize" not in _ops(after) and "dequantize" not in _ops(after)
    values = np.concatenate([RNG.standard_normal(390) * 4, np.arange(10) * 0.0371 * 0.5 - 0.1])
    arg = values.astype("float32").reshape(2, 8, 5, 5)
    np.testing.assert_array_equal(_run(after, arg), _run(before, arg))
