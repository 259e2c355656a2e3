"""Structural before/after tests of every graph pass: ``pass(Before)`` is exactly ``Expected``.

Each test builds a small Relax module, runs one pass and compares the result with the module
the pass should produce (``tvm.ir.assert_structural_equal``), built op by op with the same
BlockBuilder calls; generated kernels (``call_te``) come from the same TE computes, so what is
checked is the graph rewrite: which ops, which constants in which layout, in which order.
Targets are named CPUs, so every test runs on any x86 host.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tvm
from tvm import relax, topi

import tvm_hybrid
from tvm_hybrid import passes
from tvm_hybrid.passes.check_indices import check_function
from tvm_hybrid.passes.packed_gemm import KERNEL_NAMES, pack_weight, packed_gemm
from tvm_hybrid.testing.relax_modules import relax_function as _function

HASWELL = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
ICELAKE = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "icelake-server", "num-cores": 2})
COOPERLAKE = tvm_hybrid.make_target({"kind": "llvm", "mcpu": "cooperlake", "num-cores": 2})

RNG = np.random.default_rng(0)
W = RNG.standard_normal((24, 16)).astype("float32")
B = RNG.standard_normal(16).astype("float32")


def _tensor(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(shape, dtype))


def _same(after: tvm.IRModule, expected: tvm.IRModule) -> None:
    tvm.ir.assert_structural_equal(after, expected, map_free_vars=True)


# --- graph rewrites without kernels ----------------------------------------------------------


def test_sink_reshapes():
    x = _tensor("x", (36, 24))

    def before(bb, x):
        y = bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(x, relax.const(W))), (1, 6, 6, 16)))
        y = bb.emit(relax.op.add(y, relax.const(B.reshape(1, 1, 1, 16))))
        return relax.op.nn.relu(y)

    def expected(bb, x):
        y = bb.emit(relax.op.matmul(x, relax.const(W)))
        y = bb.emit(relax.op.add(y, relax.const(B)))
        y = bb.emit(relax.op.nn.relu(y))
        return relax.op.reshape(y, (1, 6, 6, 16))

    _same(passes.SinkReshapes()(_function([x], before)), _function([x], expected))



def test_fold_constant_cleanly_drops_what_fold_constant_leaks():
    """A slice with run-time bounds folds to nothing: TVM's FoldConstant leaves a call of a
    ``shape_func`` the module lacks (FuseOps then failed); FoldConstantCleanly leaves the
    function as it was. A model slicing by input starts and ends compiles and matches numpy."""
    x, begin = _tensor("x", (20, 10, 5)), _tensor("begin", (3,), "int64")

    def slice_(bb, x, begin):
        end = bb.emit(relax.op.add(begin, relax.const(np.array([5, 3, 4]), "int64")))
        return relax.op.dynamic_strided_slice(x, begin, end, relax.const(np.ones(3), "int64"))

    leaky = relax.transform.FoldConstant()(_function([x, begin], slice_))
    assert "shape_func" in leaky.script() and "shape_func" not in [
        gv.name_hint for gv in leaky.get_global_vars()]  # the TVM behaviour this works around
    _same(passes.FoldConstantCleanly()(_function([x, begin], slice_)),
          _function([x, begin], slice_))

    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "starts", "ends"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [20, 10, 5]),
         helper.make_tensor_value_info("starts", TensorProto.INT64, [3]),
         helper.make_tensor_value_info("ends", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    compiled = tvm_hybrid.compile(model)
    data = RNG.standard_normal((20, 10, 5)).astype("float32")
    for starts, ends in (([1, 0, -4], [7, 10, 5]), ([-3, 2, 0], [1000, -1, 2])):
        got = compiled(data, np.array(starts, "int64"), np.array(ends, "int64"))
        want = data[starts[0]:ends[0], starts[1]:ends[1], starts[2]:ends[2]]
        np.testing.assert_array_equal(np.asarray(got), want)


def test_sink_reshapes_past_an_integer_gemms_conversion():
    """A quantized 1x1 convolution's int32 sums: the reshape moves below their conversion to
    float and the scale, so the integer GEMM's epilogue sees them."""
    x = _tensor("x", (36, 24), "int32")
    w32 = RNG.integers(-127, 128, (24, 16)).astype("int32")

    def before(bb, x):
        y = bb.emit(relax.op.matmul(x, relax.const(w32), out_dtype="int32"))
        y = bb.emit(relax.op.astype(bb.emit(relax.op.reshape(y, (1, 6, 6, 16))), "float32"))
        return relax.op.multiply(y, relax.const(B.reshape(1, 1, 1, 16)))

    def expected(bb, x):
        y = bb.emit(relax.op.matmul(x, relax.const(w32), out_dtype="int32"))
        y = bb.emit(relax.op.astype(y, "float32"))
        y = bb.emit(relax.op.multiply(y, relax.const(B)))
        return relax.op.reshape(y, (1, 6, 6, 16))

    _same(passes.SinkReshapes()(_function([x], before)), _function([x], expected))


def test_sink_reshapes_past_a_quantized_layers_long_epilogue():
    """A QDQ layer's epilogue is a long chain (quantize-dequantize, BatchNorm, again, then the
    activation): the reshape still moves below all of it, however far the GEMM is."""
    x = _tensor("x", (36, 24))
    steps = [(relax.op.divide, 0.5), (relax.op.round, None), (relax.op.maximum, -128.0),
             (relax.op.minimum, 127.0), (relax.op.multiply, 0.5)] * 5

    def chain(bb, y):
        for op, c in steps:
            y = bb.emit(op(y) if c is None else op(y, relax.const(c, "float32")))
        return y

    def before(bb, x):
        y = bb.emit(relax.op.matmul(x, relax.const(W)))
        y = chain(bb, bb.emit(relax.op.reshape(y, (1, 6, 6, 16))))
        return relax.op.nn.relu(y)

    def expected(bb, x):
        y = chain(bb, bb.emit(relax.op.matmul(x, relax.const(W))))
        return relax.op.reshape(bb.emit(relax.op.nn.relu(y)), (1, 6, 6, 16))

    assert len(steps) > 16
    _same(passes.SinkReshapes()(_function([x], before)), _function([x], expected))


def test_fold_scales_into_weights():
    scale = RNG.standard_normal(16).astype("float32")
    x = _tensor("x", (36, 24))

    def before(bb, x):
        y = bb.emit(relax.op.matmul(x, relax.const(W)))
        y = bb.emit(relax.op.add(y, relax.const(B)))
        return relax.op.multiply(y, relax.const(scale))

    def expected(bb, x):
        y = bb.emit(relax.op.matmul(x, relax.const(W * scale)))
        return relax.op.add(y, relax.const(B * scale))

    _same(passes.FoldScalesIntoWeights()(_function([x], before)), _function([x], expected))


def test_fast_math_sigmoid():
    x = _tensor("x", (8,))

    def expected(bb, x):
        negated = bb.emit(relax.op.negative(x))
        exp = bb.emit_te(topi.fast_exp, negated, primfunc_name_hint="fast_exp")
        one = relax.const(1.0, "float32")
        fast = bb.emit(relax.op.divide(one, relax.op.add(one, exp)))
        return relax.op.where(relax.op.isnan(x), x, fast)

    after = passes.FastMath()(_function([x], lambda bb, x: relax.op.sigmoid(x)))
    _same(relax.transform.Normalize()(after),
          relax.transform.Normalize()(_function([x], expected)))


def test_check_indices():
    x, i = _tensor("x", (4, 10)), _tensor("i", (3,), "int64")
    message = "tvm_hybrid.index_out_of_range: Gather on input 'i': an index is outside [0, 4)"

    def expected(bb, x, i):
        flat = bb.emit(relax.op.reshape(i, (3,)))
        gv = bb.add_func(check_function(3, "int64", [4], False, message), "hybrid_check_indices")
        checked = bb.emit(relax.call_tir(gv, (flat,), relax.TensorType((3,), "int64")))
        return relax.op.take(x, bb.emit(relax.op.reshape(checked, (3,))), axis=0, mode="fast")

    after = passes.CheckIndices()(_function([x, i], lambda bb, x, i: relax.op.take(x, i, axis=0)))
    _same(after, _function([x, i], expected))


def test_integer_conv_to_float():
    w = RNG.integers(-127, 128, (4, 3, 3, 3)).astype("int32")
    x = _tensor("x", (1, 3, 8, 8), "uint8")

    def before(bb, x):
        shifted = bb.emit(relax.op.subtract(relax.op.astype(x, "int32"),
                                            relax.const(128, "int32")))
        conv = bb.emit(relax.op.nn.conv2d(shifted, relax.const(w), out_dtype="int32"))
        return relax.op.astype(conv, "float32")

    def expected(bb, x):
        shifted = bb.emit(relax.op.subtract(relax.op.astype(x, "int32"),
                                            relax.const(128, "int32")))
        as_float = bb.emit(relax.op.astype(shifted, "float32"))
        return relax.op.nn.conv2d(as_float, relax.const(w.astype("float32")),
                                  out_dtype="float32")

    after = passes.IntegerConvToFloat()(_function([x], before))
    _same(relax.transform.Normalize()(after), _function([x], expected))


# --- packed GEMMs: the weights packed at compile time in the chosen kernel's layout -------


def _packed_call(bb, x, weight, n, acc, out, extra=(), name="float32"):
    """What ``emit_packed_gemm`` emits: the call of :func:`packed_gemm` on the packed constant."""

    def compute(x, packed, *rest):
        return packed_gemm(x, packed, n, acc, out, *rest)

    return bb.call_te(compute, x, relax.const(weight), *extra,
                      primfunc_name_hint=KERNEL_NAMES[name])


def test_prepack_constant_weights_fp32():
    """Haswell, 36 rows, 16 columns: the 4 x 16 tile and one 16-wide panel (4 x 24, the best
    tile for wide GEMMs, would spend a third of its work on padding columns)."""
    x = _tensor("x", (36, 24))
    after = passes.PrepackConstantWeights(HASWELL)(
        _function([x], lambda bb, x: relax.op.matmul(x, relax.const(W))))
    expected = _function([x], lambda bb, x: _packed_call(bb, x, pack_weight(W, 16), 16,
                                                         "float32", "float32"))
    _same(after, expected)


def test_prepack_constant_weights_in_bf16_mode():
    """precision="bf16" on AVX512-BF16 (cooperlake): bf16 pairs; 16 columns take one 16-wide
    panel (a 32-wide tile would compute 16 columns of padding)."""
    x = _tensor("x", (36, 24))

    def expected(bb, x):
        x16 = bb.emit(relax.op.astype(x, "bfloat16"))
        packed = pack_weight(W, 16, 2, ml_dtypes.bfloat16)
        return _packed_call(bb, x16, packed, 16, "float32", "float32", name="bfloat16")

    after = passes.PrepackConstantWeights(COOPERLAKE, bf16=True)(
        _function([x], lambda bb, x: relax.op.matmul(x, relax.const(W))))
    _same(after, _function([x], expected))


W32 = RNG.integers(-128, 128, (30, 16)).astype("int32")


def _integer_matmul(bb, x):
    shifted = bb.emit(relax.op.subtract(relax.op.astype(x, "int32"), relax.const(3, "int32")))
    return relax.op.matmul(shifted, relax.const(W32), out_dtype="int32")


def test_integer_gemm_on_vnni():
    """u8 x s8 with the zero point as a compensation, K padded to groups of 4, the 16
    columns in one 16-wide panel."""
    x = _tensor("x", (8, 30), "uint8")

    def expected(bb, x):
        padded = bb.emit(relax.op.nn.pad(x, [0, 0, 0, 2]))
        packed = pack_weight(W32, 16, 4, np.int8)
        compensation = relax.const((3 * W32.sum(axis=0)).astype("int32"))
        return _packed_call(bb, padded, packed, 16, "int32", "int32", [compensation],
                            name="uint8")

    after = passes.IntegerGemmToVNNI(ICELAKE)(_function([x], _integer_matmul))
    _same(after, _function([x], expected))


def test_integer_gemm_on_avx2_s16():
    """Without VNNI: x - zp in s16 (fused into its producer), weights in s16 pairs."""
    x = _tensor("x", (8, 30), "uint8")

    def expected(bb, x):
        x16 = bb.emit(relax.op.subtract(relax.op.astype(x, "int16"), relax.const(3, "int16")))
        packed = pack_weight(W32, 16, 2, np.int16)
        return _packed_call(bb, x16, packed, 16, "int32", "int32", name="int16")

    after = passes.IntegerGemmToVNNI(HASWELL)(_function([x], _integer_matmul))
    _same(after, _function([x], expected))


def test_conv_to_gemm_pointwise():
    """A 1x1 convolution: NHWC, the pixels as GEMM rows, the OI weight transposed to [C, O]."""
    w = RNG.standard_normal((16, 8, 1, 1)).astype("float32")
    x = _tensor("x", (1, 8, 6, 6))

    def expected(bb, x):
        nhwc = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
        rows = bb.emit(relax.op.reshape(nhwc, (36, 8)))
        y = bb.emit(relax.op.matmul(rows, relax.const(np.ascontiguousarray(w[:, :, 0, 0].T))))
        y = bb.emit(relax.op.reshape(y, (1, 6, 6, 16)))
        return relax.op.permute_dims(y, [0, 3, 1, 2])

    after = passes.ConvToGemm(HASWELL)(
        _function([x], lambda bb, x: relax.op.nn.conv2d(x, relax.const(w))))
    _same(after, _function([x], expected))


def test_fold_qdq_matmul():
    """quantize -> dequantize -> matmul with a dequantized constant weight: the u8 x s8 GEMM on
    the quantized input, then one scale (sx * sw) on the int32 sums."""
    w8 = RNG.integers(-128, 128, (24, 16)).astype("int8")
    x = _tensor("x", (36, 24))

    def quantized(bb, x):
        xq = bb.emit(relax.op.quantize(x, relax.const(0.1, "float32"), relax.const(3, "int8"),
                                       out_dtype="uint8"))
        return xq

    def before(bb, x):
        xq = quantized(bb, x)
        xd = bb.emit(relax.op.dequantize(xq, relax.const(0.1, "float32"),
                                         relax.const(3, "int8")))
        wd = bb.emit(relax.op.dequantize(relax.const(w8), relax.const(0.05, "float32"),
                                         relax.const(0, "int8")))
        return relax.op.matmul(xd, wd)

    def expected(bb, x):
        xq = quantized(bb, x)
        packed = pack_weight(w8.astype("int32"), 16, 4, np.int8)
        compensation = relax.const((3 * w8.astype("int32").sum(axis=0)).astype("int32"))
        acc = bb.emit(_packed_call(bb, xq, packed, 16, "int32", "int32", [compensation],
                                   name="uint8"))
        sums = bb.emit(relax.op.astype(acc, "float32"))
        scale = np.full(16, np.float32(0.1) * np.float32(0.05), "float32")
        return bb.emit(relax.op.multiply(sums, relax.const(scale)))

    _same(passes.FoldQDQ(ICELAKE)(_function([x], before)), _function([x], expected))



def _quantized_input(bb, x):
    return bb.emit(relax.op.quantize(x, relax.const(0.1, "float32"), relax.const(3, "int8"),
                                     out_dtype="uint8"))


def test_fold_qdq_pointwise_conv():
    """A 1x1 convolution of dequantized u8 data by dequantized s8 weights (per output channel):
    the int32 convolution of ``x - zx`` by the weights, then one scale per output channel."""
    w8 = RNG.integers(-127, 128, (16, 24, 1, 1)).astype("int8")
    w_scale = RNG.uniform(0.01, 0.1, 16).astype("float32")
    x = _tensor("x", (1, 24, 6, 6))

    def before(bb, x):
        xd = bb.emit(relax.op.dequantize(_quantized_input(bb, x), relax.const(0.1, "float32"),
                                         relax.const(3, "int8")))
        wd = bb.emit(relax.op.dequantize(relax.const(w8), relax.const(w_scale),
                                         relax.const(np.zeros(16, "int8")), axis=0))
        return relax.op.nn.conv2d(xd, wd)

    def expected(bb, x):
        x32 = bb.emit(relax.op.astype(_quantized_input(bb, x), "int32"))
        shifted = bb.emit(relax.op.subtract(x32, relax.const(3, "int32")))
        conv = bb.emit(relax.op.nn.conv2d(shifted, relax.const(w8.astype("int32")),
                                          out_dtype="int32"))
        sums = bb.emit(relax.op.astype(conv, "float32"))
        scale = (np.float32(0.1) * w_scale).reshape(1, 16, 1, 1)
        return relax.op.multiply(sums, relax.const(scale))

    _same(passes.FoldQDQ(ICELAKE)(_function([x], before)), _function([x], expected))


def test_fold_qdq_leaves_3x3_convs_to_the_float_path_without_a_dot_product():
    """Without VNNI a 3x3 convolution of dequantized data stays as it is (its weights fold to
    fp32 and it runs on the fp32 direct convolution)."""
    w8 = RNG.integers(-127, 128, (16, 24, 3, 3)).astype("int8")
    x = _tensor("x", (1, 24, 6, 6))

    def before(bb, x):
        xd = bb.emit(relax.op.dequantize(_quantized_input(bb, x), relax.const(0.1, "float32"),
                                         relax.const(3, "int8")))
        wd = bb.emit(relax.op.dequantize(relax.const(w8), relax.const(0.05, "float32"),
                                         relax.const(0, "int8")))
        return relax.op.nn.conv2d(xd, wd)

    module = _function([x], before)
    _same(passes.FoldQDQ(HASWELL)(module), module)


def test_conv_to_gemm_integer_pointwise():
    """An int32 1x1 convolution of u8 data less its zero point: the NHWC pixels of the u8
    tensor as the rows of the int32 matmul that IntegerGemmToVNNI takes; the integer
    convolution is not made fp32 first (IntegerConvToFloat leaves it to the GEMM)."""
    w32 = RNG.integers(-127, 128, (16, 8, 1, 1)).astype("int32")
    x = _tensor("x", (1, 8, 6, 6), "uint8")

    def before(bb, x):
        shifted = bb.emit(relax.op.subtract(relax.op.astype(x, "int32"),
                                            relax.const(3, "int32")))
        return relax.op.nn.conv2d(shifted, relax.const(w32), out_dtype="int32")

    def expected(bb, x):
        nhwc = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
        rows = bb.emit(relax.op.astype(bb.emit(relax.op.reshape(nhwc, (36, 8))), "int32"))
        rows = bb.emit(relax.op.subtract(rows, relax.const(3, "int32")))
        y = bb.emit(relax.op.matmul(rows, relax.const(np.ascontiguousarray(w32[:, :, 0, 0].T)),
                                    out_dtype="int32"))
        y = bb.emit(relax.op.reshape(y, (1, 6, 6, 16)))
        return relax.op.permute_dims(y, [0, 3, 1, 2])

    module = passes.IntegerConvToFloat(ICELAKE)(_function([x], before))
    _same(passes.ConvToGemm(ICELAKE)(module), _function([x], expected))

def test_fuse_gemm_epilogues():
    """A GEMM, its bias and its activation become one composite function (one kernel)."""
    x = _tensor("x", (36, 24))

    def before(bb, x):
        y = bb.emit(relax.op.matmul(x, relax.const(W)))
        y = bb.emit(relax.op.add(y, relax.const(B)))
        return relax.op.nn.relu(y)

    bb = relax.BlockBuilder()
    params = [_tensor("x", (36, 24)), _tensor("param_0", (24, 16)), _tensor("param_1", (16,))]
    name = "fused_relax_matmul_relax_add_relax_nn_relu"
    with bb.function(name, params, attrs={"Composite": "hybrid.matmul_bias_relu",
                                          "Primitive": True}, private=True):
        with bb.dataflow():
            y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(*params[:2])), params[2]))
            out = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(out)
    fused = bb.get().get_global_var(name)
    main_x = _tensor("x", (36, 24))
    with bb.function("main", [main_x]):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(fused, [main_x, relax.const(W), relax.const(B)]))
        bb.emit_func_output(out)
    _same(passes.FuseGemmEpilogues()(_function([x], before)), bb.get())
