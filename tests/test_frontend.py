"""The front end before and around TVM's importer: shape folding and the LSTM/GRU/RNN converters.

Folding is checked structurally (which nodes are left) and numerically (the folded model computes
what the original does under ONNX Runtime); the recurrent converters are compared with ONNX
Runtime (layout 1, which it lacks, with onnx's reference evaluator) within 1e-5.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvm_hybrid
from tvm_hybrid.errors import UnsupportedModelError
from tvm_hybrid.frontend.fold import MAX_FOLDED_ELEMENTS, fold_constants

ort = pytest.importorskip("onnxruntime", reason="the comparisons need onnxruntime (test extra)")


def _model(nodes, inputs, outputs, inits=(), opset=14) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _outputs(compiled, feeds) -> list[np.ndarray]:
    out = compiled(**feeds)
    return [np.asarray(o) for o in (out if isinstance(out, (list, tuple)) else [out])]


def _int64(name, values):
    return helper.make_tensor(name, TensorProto.INT64, (len(values),), values)


def _exported_reshape() -> onnx.ModelProto:
    """``Reshape(x, Cast(Concat(Slice(Cast(Shape(x))), [-1])))`` as paddle2onnx writes it."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Cast", ["s"], ["s32"], to=TensorProto.INT32),
        helper.make_node("Slice", ["s32", "zero", "two"], ["head"]),
        helper.make_node("Cast", ["head"], ["head64"], to=TensorProto.INT64),
        helper.make_node("Concat", ["head64", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("Relu", ["flat"], ["y"]),
    ]
    inits = [_int64("zero", [0]), _int64("two", [2]), _int64("minus_one", [-1])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "h", "w"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return _model(nodes, [x], [y], inits)


def test_shape_arithmetic_folds_to_a_constant_reshape_target():
    model = _exported_reshape()
    folded, report = fold_constants(model, {"x": (2, 3, 4, 5)})
    assert [n.op_type for n in folded.graph.node] == ["Reshape", "Relu"]
    assert report.shapes == 1 and report.folded == 5
    target = {i.name: onnx.numpy_helper.to_array(i) for i in folded.graph.initializer}["target"]
    assert target.tolist() == [2, 3, -1]
    # the input model is untouched, and folding without known shapes changes nothing
    assert len(model.graph.node) == 7
    same, nothing = fold_constants(model, {})
    assert nothing.folded == 0 and len(same.graph.node) == 7


def test_exported_reshape_compiles_and_matches_onnxruntime(rng):
    """TVM's importer alone rejects it ("Reshape requires the input new shape to be Shape")."""
    x = rng.standard_normal((2, 3, 4, 5)).astype("float32")
    compiled = tvm_hybrid.compile(_exported_reshape(), input_shapes={"x": x.shape})
    (out,) = _outputs(compiled, {"x": x})
    np.testing.assert_array_equal(out, _ort(_exported_reshape(), {"x": x})[0])


def test_range_of_an_input_dimension_folds():
    """YOLO's anchor grid: ``Range(0, Gather(Shape(x), 2))`` became a fresh symbolic size that
    FoldConstant could not handle; with the shape known it is a constant."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "two"], ["w"]),
        helper.make_node("Cast", ["w"], ["wf"], to=TensorProto.FLOAT),
        helper.make_node("Range", ["zero_f", "wf", "one_f"], ["grid"]),
        helper.make_node("Add", ["x", "grid"], ["y"]),
    ]
    inits = [helper.make_tensor("two", TensorProto.INT64, (), [2]),
             helper.make_tensor("zero_f", TensorProto.FLOAT, (), [0.0]),
             helper.make_tensor("one_f", TensorProto.FLOAT, (), [1.0])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "h", "w"])
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   inits)
    folded, _ = fold_constants(model, {"x": (1, 4, 6)})
    assert [n.op_type for n in folded.graph.node] == ["Add"]
    feeds = {"x": np.ones((1, 4, 6), "float32")}
    (out,) = _outputs(tvm_hybrid.compile(model, input_shapes={"x": (1, 4, 6)}), feeds)
    np.testing.assert_array_equal(out, _ort(model, feeds)[0])


def test_if_on_a_known_shape_keeps_only_the_taken_branch():
    """PyTorch exports ``squeeze(dim)`` as ``If(size(dim) == 1, Squeeze, Identity)``."""
    then = helper.make_graph([helper.make_node("Squeeze", ["x", "axis"], ["t_out"])], "then", [],
                             [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e_out"])], "else", [],
                              [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "axis0"], ["d"]),
        helper.make_node("Equal", ["d", "one"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
    ]
    inits = [_int64("axis", [0]), helper.make_tensor("axis0", TensorProto.INT64, (), [0]),
             helper.make_tensor("one", TensorProto.INT64, (), [1])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   inits)
    for n, kept in ((1, ["Squeeze", "Identity"]), (3, ["Identity", "Identity"])):
        folded, _ = fold_constants(model, {"x": (n, 4)})
        assert [node.op_type for node in folded.graph.node] == kept
        feeds = {"x": np.arange(n * 4, dtype="float32").reshape(n, 4)}
        (out,) = _outputs(tvm_hybrid.compile(model, input_shapes={"x": (n, 4)}), feeds)
        np.testing.assert_array_equal(out, _ort(model, feeds)[0])


def test_quantization_and_large_constants_are_left_to_the_passes():
    """``DequantizeLinear`` of an int8 weight must reach the int8 passes; a large constant
    expression stays for TVM's FoldConstant (the ONNX graph does not grow)."""
    big = MAX_FOLDED_ELEMENTS + 1
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "scale"], ["w"]),
        helper.make_node("ConstantOfShape", ["big_shape"], ["big"]),
        helper.make_node("Mul", ["x", "w"], ["xw"]),
        helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
        helper.make_node("Add", ["xw", "total"], ["y"]),
    ]
    inits = [helper.make_tensor("wq", TensorProto.INT8, (4,), [1, -2, 3, -4]),
             helper.make_tensor("scale", TensorProto.FLOAT, (), [0.5]), _int64("big_shape", [big])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   inits)
    folded, report = fold_constants(model, {"x": (4,)})
    assert report.folded == 0
    assert [n.op_type for n in folded.graph.node] == [n.op_type for n in nodes]


# --- LSTM and GRU ---------------------------------------------------------------------------


def _recurrent(op, *, steps=5, batch=3, size=4, hidden=6, direction="forward", layout=0,
               bias=True, lengths=False, initial=True, peepholes=False, **attrs):
    directions = 2 if direction == "bidirectional" else 1
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    rng = np.random.default_rng(1)

    def weight(name, shape, scale):
        value = (rng.standard_normal(shape) * scale).astype("float32")
        return helper.make_tensor(name, TensorProto.FLOAT, shape, value.ravel())

    inits = [weight("W", (directions, gates * hidden, size), 0.5),
             weight("R", (directions, gates * hidden, hidden), 0.5)]
    x_shape = (batch, steps, size) if layout else (steps, batch, size)
    state_shape = (batch, directions, hidden) if layout else (directions, batch, hidden)
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    feeds = {"X": rng.standard_normal(x_shape).astype("float32")}
    names = ["X", "W", "R", "B" if bias else "", "lens" if lengths else ""]
    if bias:
        inits.append(weight("B", (directions, 2 * gates * hidden), 0.3))
    if lengths:
        inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, (batch,)))
        feeds["lens"] = rng.integers(1, steps + 1, batch).astype("int32")
    states = ["h0", "c0"] if op == "LSTM" else ["h0"]
    for state in states:
        names.append(state if initial else "")
        if initial:
            inputs.append(helper.make_tensor_value_info(state, TensorProto.FLOAT, state_shape))
            feeds[state] = rng.standard_normal(state_shape).astype("float32")
    if peepholes:
        names.append("P")
        inits.append(weight("P", (directions, 3 * hidden), 0.3))
    while not names[-1]:
        names.pop()
    outs = ["Y", "Y_h", "Y_c"][: 1 + len(states)]
    if layout:
        attrs["layout"] = 1
    node = helper.make_node(op, names, outs, hidden_size=hidden, direction=direction, **attrs)
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs]
    return _model([node], inputs, outputs, inits), feeds


RECURRENT_CASES = [
    dict(op="LSTM"), dict(op="LSTM", direction="reverse"),
    dict(op="LSTM", direction="bidirectional"), dict(op="LSTM", layout=1),
    dict(op="LSTM", bias=False, initial=False), dict(op="LSTM", peepholes=True),
    dict(op="LSTM", clip=0.5), dict(op="LSTM", input_forget=1), dict(op="LSTM", lengths=True),
    dict(op="LSTM", lengths=True, direction="bidirectional"), dict(op="LSTM", steps=1),
    dict(op="GRU"), dict(op="GRU", direction="bidirectional"),
    dict(op="GRU", linear_before_reset=1), dict(op="GRU", lengths=True, direction="reverse"),
    dict(op="GRU", layout=1, bias=False),
    dict(op="GRU", activations=["HardSigmoid", "Relu"], activation_alpha=[0.3],
         activation_beta=[0.4]),
    dict(op="RNN"), dict(op="RNN", direction="bidirectional", lengths=True),
    dict(op="RNN", layout=1), dict(op="RNN", clip=0.7), dict(op="RNN", bias=False, initial=False),
    dict(op="RNN", direction="reverse", activations=["Relu"]),
]


@pytest.mark.parametrize("case", RECURRENT_CASES,
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_recurrent_ops_match_onnxruntime(case):
    model, feeds = _recurrent(**case)
    if case.get("layout"):  # ONNX Runtime rejects batch-first recurrences
        from onnx.reference import ReferenceEvaluator

        expected = ReferenceEvaluator(model).run(None, feeds)
    else:
        expected = _ort(model, feeds)
    got = _outputs(tvm_hybrid.compile(model), feeds)
    assert len(got) == len(expected)
    for out, ref in zip(got, expected):
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_recurrent_op_with_a_dynamic_sequence_length():
    """Symbolic compiles refuse it naming the node; the default specializes per length."""
    model, feeds = _recurrent("LSTM")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "steps"
    with pytest.raises(UnsupportedModelError, match=r"LSTM node .*static shape.*input_shapes"):
        tvm_hybrid.compile(model, dynamic="symbolic")
    compiled = tvm_hybrid.compile(model)
    for steps in (2, 5):
        part = dict(feeds, X=feeds["X"][:steps])
        for out, ref in zip(_outputs(compiled, part), _ort(model, part)):
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_unknown_recurrent_activation_is_refused_by_name():
    model, _ = _recurrent("GRU", activations=["Sigmoid", "Elu"])
    with pytest.raises(UnsupportedModelError, match="'Elu' is not supported"):
        tvm_hybrid.compile(model)


@pytest.mark.parametrize("op", ["Sum", "Max", "Min", "Mean"])
def test_variadic_elementwise_ops_import_as_binary_chains(op, rng):
    """Sum/Max/Min/Mean of three broadcasting inputs: pairwise ops (no stacked copy, which
    TVM's ``ConvertLayout`` cannot carry), the same values as ONNX Runtime."""
    from tvm_hybrid.frontend.importer import import_model

    shapes = {"a": [2, 3, 4], "b": [3, 4], "c": [1]}
    model = _model([helper.make_node(op, list(shapes), ["y"])],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                    for n, s in shapes.items()],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=13)
    script = import_model(model).mod.script()
    assert "R.stack" not in script and "broadcast_to" not in script
    feeds = {n: rng.standard_normal(s).astype("float32") for n, s in shapes.items()}
    got = _outputs(tvm_hybrid.compile(model), feeds)[0]
    np.testing.assert_allclose(got, _ort(model, feeds)[0], rtol=1e-6, atol=1e-6)


def test_a_sum_residual_keeps_the_convolutions_in_nhwc(rng):
    """ResNet's residual ``Sum`` between convolutions: one layout change at each end of the
    chain, not a transpose pair around every convolution."""
    w = [(rng.standard_normal((8, 8, 3, 3)) * 0.2).astype("float32") for _ in range(3)]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c0", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Sum", ["c0", "c1"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 10, 12])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [onnx.numpy_helper.from_array(v, f"w{i}") for i, v in enumerate(w)])
    compiled = tvm_hybrid.compile(model)
    assert len([n for n in compiled.kernel_names() if "transpose" in n]) <= 2
    x = rng.standard_normal((1, 8, 10, 12)).astype("float32")
    np.testing.assert_allclose(_outputs(compiled, {"x": x})[0], _ort(model, {"x": x})[0],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_celu_imports_and_matches_onnxruntime(alpha, rng):
    """TVM's importer has no Celu converter (the model was refused)."""
    model = _model([helper.make_node("Celu", ["x"], ["y"], alpha=alpha)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 37, 64])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=12)
    feeds = {"x": (rng.standard_normal((4, 37, 64)) * 3).astype("float32")}
    got = _outputs(tvm_hybrid.compile(model), feeds)[0]
    np.testing.assert_allclose(got, _ort(model, feeds)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("depth", [np.array([10], np.int64), np.array(7.0, np.float32)])
def test_one_hot_with_a_one_element_depth(depth, rng):
    """The spec's rank-1 one-element depth (and a float scalar one) with negative indices:
    TVM's converter failed on the rank-1 form with a type error from ``relax.op.one_hot``."""
    model = _model([helper.make_node("OneHot", ["i", "depth", "values"], ["y"], axis=1)],
                   [helper.make_tensor_value_info("i", TensorProto.INT64, [2, 6])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [onnx.numpy_helper.from_array(depth, "depth"),
                    onnx.numpy_helper.from_array(np.array([-1.0, 2.5], np.float32), "values")],
                   opset=11)
    n = int(depth.reshape(()))
    feeds = {"i": rng.integers(-n, n, (2, 6)).astype(np.int64)}
    got = _outputs(tvm_hybrid.compile(model), feeds)[0]
    np.testing.assert_array_equal(got, _ort(model, feeds)[0])
    assert got.shape == (2, n, 6) and got.dtype == np.float32  # TVM's converter: float64


@pytest.mark.parametrize("axis,values", [(-2, np.array([0, 1], "int32")),
                                         (0, np.array([0.5, -3], "float32"))])
def test_one_hot_float_indices_negative_axis_and_integer_values(axis, values, rng):
    """Float indices (cast to int64, the spec; TVM's converter refused them), a negative axis
    (TVM's one_hot misplaced it) and integer values (the output's type), against ONNX's
    reference implementation (ONNX Runtime lacks float indices with int32 values; the
    reference compares float indices uncast, so they are whole numbers here)."""
    from onnx.reference import ReferenceEvaluator

    model = _model([helper.make_node("OneHot", ["i", "depth", "values"], ["y"], axis=axis)],
                   [helper.make_tensor_value_info("i", TensorProto.FLOAT, [3, 4])],
                   [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(
                       values.dtype), None)],
                   [onnx.numpy_helper.from_array(np.array(5, np.int64), "depth"),
                    onnx.numpy_helper.from_array(values, "values")], opset=11)
    feeds = {"i": rng.integers(-6, 6, (3, 4)).astype("float32")}
    got = _outputs(tvm_hybrid.compile(model), feeds)[0]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.dtype == values.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("output_shape", [None, [1, 2, 5, 6]])
def test_max_unpool_with_an_output_shape(output_shape, rng):
    """``MaxUnpool`` of a 2x2 pooling's values and indices; with ``output_shape`` (TVM's
    converter failed on it) the unpooled values keep their places and zeros follow (ONNX's
    reference)."""
    from onnx.reference import ReferenceEvaluator

    inputs = ["v", "idx"] + (["shape"] if output_shape else [])
    inits = [_int64("shape", output_shape)] if output_shape else []
    model = _model([helper.make_node("MaxUnpool", inputs, ["y"], kernel_shape=[2, 2],
                                     strides=[2, 2])],
                   [helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 2, 2, 2]),
                    helper.make_tensor_value_info("idx", TensorProto.INT64, [1, 2, 2, 2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=11)
    # Each value's flat index in the 4x4 unpooled planes: one position of its 2x2 window.
    rows, cols = np.meshgrid(np.arange(2), np.arange(2), indexing="ij")
    where = (2 * rows + rng.integers(0, 2, (1, 2, 2, 2))) * 4 + 2 * cols + rng.integers(
        0, 2, (1, 2, 2, 2))
    feeds = {"v": rng.standard_normal((1, 2, 2, 2)).astype("float32"),
             "idx": (where + 16 * np.arange(2).reshape(1, 2, 1, 1)).astype("int64")}
    got = _outputs(tvm_hybrid.compile(model), feeds)[0]
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, feeds)[0])
    assert got.shape == tuple(output_shape or (1, 2, 4, 4))


@pytest.mark.parametrize("opset,mode,scales", [(7, "nearest", [1, 1, 2, 3]),
                                                (9, "nearest", [1, 1, 1.5, 2.5]),
                                                (9, "linear", [1, 1, 2, 1.5]),
                                                (9, "linear", [1, 1, 1.5, 1.7]),
                                                (9, "nearest", [1, 1, 1.3, 1.9]),
                                                (9, "nearest", [1, 2, 2, 1])])
def test_upsample_matches_onnxruntime(opset, mode, scales, rng):
    """``Upsample`` (opsets 7-9): TVM's converter read only opset 7's attribute and rounded
    nearest source pixels where the specification takes the floor."""
    attrs = {"scales": [float(v) for v in scales]} if opset == 7 else {}
    inits = [] if opset == 7 else [helper.make_tensor("s", TensorProto.FLOAT, [4], scales)]
    model = _model([helper.make_node("Upsample", ["x"] + ([] if opset == 7 else ["s"]), ["y"],
                                     mode=mode, **attrs)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 5, 6])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
                   opset=opset)
    feeds = {"x": rng.standard_normal((1, 2, 5, 6)).astype("float32")}
    want = _ort(model, feeds)[0]
    got = _outputs(tvm_hybrid.compile(model), feeds)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _nms(scalars_as_inputs: bool) -> onnx.ModelProto:
    values = [_int64("limit", [3]), helper.make_tensor("iou", TensorProto.FLOAT, (1,), [0.5]),
              helper.make_tensor("floor", TensorProto.FLOAT, (1,), [0.2])]
    boxes = [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 6, 4]),
             helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 2, 6])]
    scalars = [helper.make_tensor_value_info(v.name, v.data_type, [1]) for v in values]
    return _model([helper.make_node("NonMaxSuppression", ["boxes", "scores", "limit", "iou",
                                                          "floor"], ["picked"], name="nms")],
                  boxes + (scalars if scalars_as_inputs else []),
                  [helper.make_tensor_value_info("picked", TensorProto.INT64, [None, 3])],
                  [] if scalars_as_inputs else values, opset=11)


def test_non_max_suppression_limits_given_at_run_time(rng):
    """TVM's converter replaces limits given at run time by defaults (max_output_boxes 0: no
    box selected). Constant limits match ONNX Runtime; limits that are graph inputs are
    compiled as constants per value (``frontend/value_inputs.py``) and match it too; with
    ``dynamic="symbolic"`` (one binary) they are refused with the node and input named."""
    boxes = np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, -0.1, 1, 0.9], [0, 10, 1, 11],
                       [0, 10.1, 1, 11.1], [0, 100, 1, 101]]], "float32")
    feeds = {"boxes": boxes, "scores": rng.random((1, 2, 6)).astype("float32")}
    model = _nms(False)
    np.testing.assert_array_equal(_outputs(tvm_hybrid.compile(model), feeds)[0],
                                  _ort(model, feeds)[0])
    by_value = tvm_hybrid.compile(_nms(True))
    for limit, iou in ((3, 0.5), (1, 0.5), (3, 0.05)):
        limits = {"limit": np.array([limit], "int64"), "iou": np.array([iou], "float32"),
                  "floor": np.array([0.2], "float32")}
        np.testing.assert_array_equal(_outputs(by_value, {**feeds, **limits})[0],
                                      _ort(_nms(True), {**feeds, **limits})[0])
    assert len(by_value.specializations) == 3
    with pytest.raises(UnsupportedModelError,
                       match="'nms': max_output_boxes_per_class is given at run time"):
        tvm_hybrid.compile(_nms(True), dynamic="symbolic")


@pytest.mark.parametrize("opset", [10, 11])
def test_top_k_reads_k_where_the_opset_puts_it(opset, rng):
    """Opset 10 moved ``k`` to an input; TVM's converter read opset 1's attribute (absent:
    ``k = 1``). A ``k`` past the axis read past the input's end; now refused by name."""
    model = _model([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1, name="top")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 9])],
                   [helper.make_tensor_value_info("v", TensorProto.FLOAT, None),
                    helper.make_tensor_value_info("i", TensorProto.INT64, None)],
                   [_int64("k", [4])], opset=opset)
    feeds = {"x": rng.permutation(27).reshape(3, 9).astype("float32")}
    for got, want in zip(_outputs(tvm_hybrid.compile(model), feeds), _ort(model, feeds)):
        np.testing.assert_array_equal(got, want)
    model.graph.initializer[0].CopyFrom(_int64("k", [10]))
    with pytest.raises(UnsupportedModelError, match="TopK node 'top': k = 10 is not within "
                                                    "the 9 elements of axis 1"):
        tvm_hybrid.compile(model)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_space_to_depth_in_either_mode(mode, rng):
    """``SpaceToDepth``'s ``mode`` (opset 28): TVM ignored it and always moved blocks in DCR
    order, so CRD models got their channels permuted. Against ONNX's reference."""
    from onnx.reference import ReferenceEvaluator

    model = _model([helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2, mode=mode)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 6])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=28)
    feeds = {"x": rng.standard_normal((2, 3, 4, 6)).astype("float32")}
    np.testing.assert_array_equal(_outputs(tvm_hybrid.compile(model), feeds)[0],
                                  ReferenceEvaluator(model).run(None, feeds)[0])


@pytest.mark.parametrize("positive,negative", [(1, 0), (0, 1), (1, 1), (0, 0)])
def test_is_inf_detects_the_signs_asked_for(positive, negative):
    """TVM's converter ignored ``detect_positive`` / ``detect_negative``."""
    model = _model([helper.make_node("IsInf", ["x"], ["y"], detect_positive=positive,
                                     detect_negative=negative)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
                   [helper.make_tensor_value_info("y", TensorProto.BOOL, None)], opset=10)
    x = np.array([-np.inf, np.inf, 0.0, np.nan, -1.0, 3e38], "float32")
    want = (np.isposinf(x) & bool(positive)) | (np.isneginf(x) & bool(negative))
    np.testing.assert_array_equal(_outputs(tvm_hybrid.compile(model), {"x": x})[0], want)


@pytest.mark.parametrize("strides,output_shape,auto_pad", [
    ([3, 2], [16, 10], "NOTSET"),     # longer than the full result: output_padding
    ([2, 2], [10, 9], "NOTSET"),      # shorter: cropped, the odd row at the start
    ([2, 2], [10, 9], "SAME_UPPER"),  # the odd row at the end
], ids=["longer", "shorter", "same_upper"])
def test_conv_transpose_output_shape(strides, output_shape, auto_pad, rng):
    """TVM's converter ignored ``output_shape`` (the output had the unpadded size)."""
    model = _model([helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=strides,
                                     output_shape=output_shape, auto_pad=auto_pad)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 5, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [onnx.numpy_helper.from_array(rng.standard_normal((3, 2, 3, 3)).astype(
                       "float32"), "w"), onnx.numpy_helper.from_array(
                       np.array([0.5, -1.0], "float32"), "b")], opset=11)
    feeds = {"x": rng.standard_normal((1, 3, 5, 4)).astype("float32")}
    got = _outputs(tvm_hybrid.compile(model), feeds)[0]
    want = _ort(model, feeds)[0]
    assert got.shape == want.shape == (1, 2, *output_shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_normalization_mean_and_inverse_deviation_outputs(axis, rng):
    """TVM's converter returned 0 for the optional ``Mean`` and ``InvStdDev`` outputs."""
    shape = (2, 5, 16)
    norm = shape[axis:] if axis != -1 else shape[-1:]
    model = _model([helper.make_node("LayerNormalization", ["x", "g", "b"], ["y", "m", "s"],
                                     axis=axis, epsilon=1e-3)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "yms"],
                   [onnx.numpy_helper.from_array(rng.standard_normal(norm).astype("float32"), n)
                    for n in "gb"], opset=17)
    feeds = {"x": (rng.standard_normal(shape) * 3 + 1).astype("float32")}
    for got, want in zip(_outputs(tvm_hybrid.compile(model), feeds), _ort(model, feeds)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_expand_to_a_shape_given_at_run_time(rng):
    """The shape as a graph input, with 1s where the data is larger: broadcast both ways
    (TVM's converter broadcast to the shape as given, and gave those dimensions 1)."""
    model = _model([helper.make_node("Expand", ["x", "shape"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 1]),
                    helper.make_tensor_value_info("shape", TensorProto.INT64, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=13)
    compiled = tvm_hybrid.compile(model)
    for shape in ([2, 1, 6], [1, 3, 1], [4, 3, 2]):
        feeds = {"x": rng.standard_normal((3, 1)).astype("float32"),
                 "shape": np.array(shape, np.int64)}
        got, want = _outputs(compiled, feeds)[0], _ort(model, feeds)[0]
        assert got.shape == want.shape, shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rank,interleaved,rotary", [(4, 0, 0), (4, 1, 8), (3, 0, 8), (3, 1, 0)])
def test_rotary_embedding_matches_the_reference(rank, interleaved, rotary, rng):
    """ONNX's ``RotaryEmbedding`` (opset 23; TVM's importer lacks it), against ONNX's reference
    implementation: rank 4 and rank 3 with ``num_heads``, halves and interleaved pairs, the
    whole head or its first 8 channels, position ids into a cache of 32 positions."""
    from onnx.reference import ReferenceEvaluator

    b, s, h, d = 2, 7, 3, 16
    half = (rotary or d) // 2
    shape = [b, h, s, d] if rank == 4 else [b, s, h * d]
    attrs = {"interleaved": interleaved, "rotary_embedding_dim": rotary}
    if rank == 3:
        attrs["num_heads"] = h
    model = _model([helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"],
                                     **attrs)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                    helper.make_tensor_value_info("pos", TensorProto.INT64, [b, s])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [onnx.numpy_helper.from_array(f(np.arange(32)[:, None] * 0.1 * np.arange(
                       1, half + 1)).astype("float32"), n) for f, n in ((np.cos, "cos"),
                                                                         (np.sin, "sin"))],
                   opset=23)
    feeds = {"x": rng.standard_normal(shape).astype("float32"),
             "pos": rng.integers(0, 32, (b, s)).astype(np.int64)}
    compiled = tvm_hybrid.compile(model)
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    np.testing.assert_allclose(_outputs(compiled, feeds)[0], want, rtol=1e-5, atol=1e-6)
    feeds["pos"][1, 3] = 32  # past the cache: refused before anything reads it
    with pytest.raises(tvm_hybrid.errors.InputError, match="pos"):
        compiled(**feeds)


@pytest.mark.parametrize("p,axis", [(2, -1), (1, 1), (2, 0)])
def test_lp_normalization_matches_onnxruntime(p, axis, rng):
    """``LpNormalization`` (missing in TVM's importer), a zero row included (0, as in ONNX
    Runtime and ONNX's reference), against numpy and ONNX Runtime."""
    model = _model([helper.make_node("LpNormalization", ["x"], ["y"], p=p, axis=axis)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6, 5])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=13)
    x = rng.standard_normal((4, 6, 5)).astype("float32")
    x[1, 2, :] = 0.0
    got = _outputs(tvm_hybrid.compile(model), {"x": x})[0]
    norm = np.sum(np.abs(x) ** p, axis=axis, keepdims=True) ** (1 / p)
    want = np.where(norm == 0, 0, x / np.where(norm == 0, 1, norm))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod_matches_the_reference(exclusive, reverse, rng):
    """``CumProd`` (opset 26; missing in TVM's importer)."""
    from onnx.reference import ReferenceEvaluator

    model = _model([helper.make_node("CumProd", ["x", "axis"], ["y"], exclusive=exclusive,
                                     reverse=reverse)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 7])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [helper.make_tensor("axis", TensorProto.INT64, [], [1])], opset=26)
    feeds = {"x": rng.uniform(0.5, 1.5, (3, 7)).astype("float32")}
    np.testing.assert_allclose(_outputs(tvm_hybrid.compile(model), feeds)[0],
                               ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5)


@pytest.mark.parametrize("past,bias,activation", [(False, False, "none"), (True, True, "silu"),
                                                 (True, False, "swish")])
def test_causal_conv_with_state_matches_the_reference(past, bias, activation, rng):
    """``CausalConvWithState`` (opset 27, Gated DeltaNet and Mamba; missing in TVM's importer):
    the output and the carried state."""
    from onnx.reference import ReferenceEvaluator

    names = ["x", "w", "b" if bias else "", "past" if past else ""]
    while not names[-1]:
        names.pop()
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 5])]
    if past:
        inputs.append(helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, 6, 3]))
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((6, 1, 4)).astype("float32"), "w")]
    if bias:
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal(6).astype("float32"), "b"))
    model = _model([helper.make_node("CausalConvWithState", names, ["y", "state"],
                                     activation=activation)], inputs,
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                    for n in ("y", "state")], inits, opset=27)
    feeds = {v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim])
             .astype("float32") for v in inputs}
    for got, want in zip(_outputs(tvm_hybrid.compile(model), feeds),
                         ReferenceEvaluator(model).run(None, feeds)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,axes", [([3, 8, 4], None), ([5, 3], [-2, 1])])
def test_center_crop_pad_matches_the_reference(shape, axes, rng):
    """``CenterCropPad`` (opset 18; missing in TVM's importer): crops and pads, centred."""
    from onnx.reference import ReferenceEvaluator

    attrs = {"axes": axes} if axes else {}
    model = _model([helper.make_node("CenterCropPad", ["x", "s"], ["y"], **attrs)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5, 6])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [_int64("s", shape)], opset=18)
    feeds = {"x": rng.standard_normal((4, 5, 6)).astype("float32")}
    np.testing.assert_array_equal(_outputs(tvm_hybrid.compile(model), feeds)[0],
                                  ReferenceEvaluator(model).run(None, feeds)[0])


@pytest.mark.parametrize("rule,per_head", [("linear", False), ("gated", False),
                                           ("delta", False), ("gated_delta", True)])
def test_linear_attention_matches_the_reference(rule, per_head, rng):
    """``LinearAttention`` (opset 27; missing in TVM's importer), unrolled over 5 tokens with a
    past state, 4 query heads sharing 2 key/value heads."""
    from onnx.reference import ReferenceEvaluator

    b, t, hq, hkv, dk, dv = 2, 5, 4, 2, 8, 6
    shapes = {"q": [b, t, hq * dk], "k": [b, t, hkv * dk], "v": [b, t, hkv * dv],
              "past": [b, hkv, dk, dv]}
    if "gated" in rule:
        shapes["g"] = [b, t, hkv if per_head else hkv * dk]
    if "delta" in rule:
        shapes["beta"] = [b, t, hkv]
    names = ["q", "k", "v", "past", "g" if "g" in shapes else "",
             "beta" if "beta" in shapes else ""]
    while not names[-1]:
        names.pop()
    model = _model([helper.make_node("LinearAttention", names, ["y", "state"], update_rule=rule,
                                     q_num_heads=hq, kv_num_heads=hkv)],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, d)
                    for n, d in shapes.items()],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                    for n in ("y", "state")], opset=27)
    feeds = {n: (rng.standard_normal(d) * 0.5).astype("float32") for n, d in shapes.items()}
    if "g" in feeds:
        feeds["g"] = -np.abs(feeds["g"])  # log-space decays
    if "beta" in feeds:
        feeds["beta"] = rng.uniform(0, 1, shapes["beta"]).astype("float32")
    for got, want in zip(_outputs(tvm_hybrid.compile(model), feeds),
                         ReferenceEvaluator(model).run(None, feeds)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_linear_attention_prefill_beyond_the_unrolled_steps_is_refused():
    from tvm_hybrid.frontend.linear_attention import MAX_STEPS

    model = _model([helper.make_node("LinearAttention", ["q", "k", "v"], ["y"], name="la",
                                     update_rule="linear", q_num_heads=1, kv_num_heads=1)],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, MAX_STEPS + 1, 4])
                    for n in "qkv"],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=27)
    with pytest.raises(UnsupportedModelError, match=f"'la': {MAX_STEPS + 1} tokens"):
        tvm_hybrid.compile(model)


@pytest.mark.parametrize("axis", [0, -1])
def test_rms_normalization_over_every_axis(axis, rng):
    """``RMSNormalization`` with ``axis`` 0 (every axis) failed in TVM's constant folding."""
    from onnx.reference import ReferenceEvaluator

    scale_shape = [3, 5, 4] if axis == 0 else [4]
    model = _model([helper.make_node("RMSNormalization", ["x", "s"], ["y"], axis=axis)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [onnx.numpy_helper.from_array(
                       rng.standard_normal(scale_shape).astype("float32"), "s")], opset=23)
    feeds = {"x": rng.standard_normal((3, 5, 4)).astype("float32")}
    np.testing.assert_allclose(_outputs(tvm_hybrid.compile(model), feeds)[0],
                               ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("op", ["Elu", "Selu", "ThresholdedRelu"])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.FLOAT])
def test_activations_in_every_float_type(op, dtype, rng):
    """TVM's converters of these wrote float32 constants: float16 and float64 models failed."""
    from onnx.reference import ReferenceEvaluator

    model = _model([helper.make_node(op, ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", dtype, [4, 9])],
                   [helper.make_tensor_value_info("y", dtype, None)], opset=22)
    feeds = {"x": (rng.standard_normal((4, 9)) * 2).astype(helper.tensor_dtype_to_np_dtype(
        dtype))}
    got, want = _outputs(tvm_hybrid.compile(model), feeds)[0], \
        ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got.astype("float64"), want.astype("float64"), rtol=2e-3,
                               atol=2e-3)


@pytest.mark.parametrize("case", ["add_int64", "add_float64", "gemm_float64", "lrn_float16",
                                  "lrn_float64", "resize_float64", "stft_float64"])
def test_other_types_keep_their_type(case, rng):
    """int64 and float64 constants that a pass or converter rebuilt became int32 and float32
    (``relax.const``'s defaults), and the model failed to compile where stock TVM compiled it;
    float16 and float64 ``LRN`` failed in TVM's converter. Against ONNX's reference."""
    from onnx.reference import ReferenceEvaluator

    kind, name = case.split("_")
    dtype = {"int64": TensorProto.INT64, "float64": TensorProto.DOUBLE,
             "float16": TensorProto.FLOAT16}[name]
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    shape, inits, opset = [2, 3, 8, 8], [], 18
    if kind == "add":  # a constant of lower rank: broadcast by the layout pass's reshape
        nodes, shape = [helper.make_node("Add", ["x", "c"], ["y"])], [2, 3]
        inits = [onnx.numpy_helper.from_array(np.array([1, 2, 3], np_dtype), "c")]
    elif kind == "gemm":
        nodes, shape = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], beta=2.0,
                                         transB=1)], [3, 16]
        inits = [onnx.numpy_helper.from_array(rng.random((8, 16)), "w"),
                 onnx.numpy_helper.from_array(rng.random(8), "b")]
    elif kind == "lrn":
        nodes = [helper.make_node("LRN", ["x"], ["y"], size=3)]
    elif kind == "resize":
        nodes = [helper.make_node("Resize", ["x", "", "s"], ["y"], mode="linear")]
        inits = [helper.make_tensor("s", TensorProto.FLOAT, [4], [1, 1, 0.6, 0.6])]
    else:
        nodes, shape, opset = [helper.make_node("STFT", ["x", "step", "", "n"], ["y"])], \
            [1, 64, 1], 17
        inits = [helper.make_tensor("step", TensorProto.INT64, [], [8]),
                 helper.make_tensor("n", TensorProto.INT64, [], [16])]
    model = _model(nodes, [helper.make_tensor_value_info("x", dtype, shape)],
                   [helper.make_tensor_value_info("y", dtype, None)], inits, opset=opset)
    feeds = {"x": (rng.integers(0, 9, shape) if kind == "add" else
                   rng.uniform(0.1, 1.5, shape)).astype(np_dtype)}
    got = _outputs(tvm_hybrid.compile(model), feeds)[0]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got.astype("float64"), want.astype("float64"), rtol=2e-3,
                               atol=2e-3)


def test_swiglu_matches_the_reference(rng):
    """``SwiGLU`` (opset 28; missing in TVM's importer): ``A * sigmoid(alpha * A) * B``."""
    from onnx.reference import ReferenceEvaluator

    model = _model([helper.make_node("SwiGLU", ["a", "b"], ["y"], alpha=1.5)],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 24]) for n in "ab"],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=28)
    feeds = {n: (rng.standard_normal((4, 24)) * 3).astype("float32") for n in "ab"}
    np.testing.assert_allclose(_outputs(tvm_hybrid.compile(model), feeds)[0],
                               ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5,
                               atol=1e-6)


def test_swish_matches_the_reference(rng):
    """``Swish`` (opset 24; missing in TVM's importer): ``x * sigmoid(alpha * x)``."""
    from onnx.reference import ReferenceEvaluator

    model = _model([helper.make_node("Swish", ["x"], ["y"], alpha=0.7)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 40])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=24)
    feeds = {"x": (rng.standard_normal((3, 40)) * 4).astype("float32")}
    np.testing.assert_allclose(_outputs(tvm_hybrid.compile(model), feeds)[0],
                               ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("base,exponent", [("float32", "int64"), ("int64", "int64"),
                                           ("int32", "float32")])
def test_pow_on_mixed_types_matches_onnxruntime(base, exponent, rng):
    """``Pow`` with an integer exponent (or base): TVM refused the mix on its type check and
    failed on integer ``Pow`` in constant folding."""
    types = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64,
             "int32": TensorProto.INT32}
    model = _model([helper.make_node("Pow", ["x", "y"], ["z"])],
                   [helper.make_tensor_value_info("x", types[base], [5, 4]),
                    helper.make_tensor_value_info("y", types[exponent], [4])],
                   [helper.make_tensor_value_info("z", types[base], None)], opset=15)
    feeds = {"x": (rng.integers(-4, 5, (5, 4)) if base != "float32"
                   else rng.standard_normal((5, 4)) * 2).astype(base),
             "y": (np.array([0, 1, 2, 3]) if exponent != "float32"
                   else np.array([0.0, 1.0, 2.0, 3.0])).astype(exponent)}
    got = _outputs(tvm_hybrid.compile(model), feeds)[0]
    want = _ort(model, feeds)[0]
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6)
