"""Models with dynamic input dimensions: compiled per input shape on first use
(``specializing_model.py``), with the speed of a static compile and ONNX Runtime's results."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvm_hybrid
from tvm_hybrid import SpecializingModel
from tvm_hybrid.errors import InputError, OptionError, UnsupportedModelError


def _mlp(batch="batch", seq="seq") -> onnx.ModelProto:
    """``relu(x @ W1 + b) @ W2`` over ``x[batch, seq, 64]``."""
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype("float32") * 0.1, n)
             for n, s in (("W1", (64, 96)), ("b", (96,)), ("W2", (96, 32)))]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]),
             helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"])]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _reference(model, x):
    h = np.maximum(x @ _init(model, "W1") + _init(model, "b"), 0)
    return h @ _init(model, "W2")


def _init(model, name):
    return next(onnx.numpy_helper.to_array(i) for i in model.graph.initializer if i.name == name)


def test_dynamic_model_specializes_per_shape_and_matches(rng, caplog):
    model = _mlp()
    compiled = tvm_hybrid.compile(model)
    assert isinstance(compiled, SpecializingModel)
    assert compiled.specializations == []
    with caplog.at_level(logging.INFO, logger="tvm_hybrid.specializing_model"):
        for batch, seq in ((1, 7), (4, 33), (1, 7)):
            x = rng.standard_normal((batch, seq, 64)).astype("float32")
            np.testing.assert_allclose(compiled(x), _reference(model, x), rtol=1e-4, atol=1e-4)
    # least recently used first: (1, 7) was used again last
    assert compiled.specializations == [{"x": (4, 33, 64)}, {"x": (1, 7, 64)}]
    compiles = [r for r in caplog.records if "compiled" in r.getMessage()]
    assert len(compiles) == 2  # the repeated shape is not compiled again


def test_specialization_is_the_static_compile(rng):
    """The same kernels as compiling with input_shapes: the GEMM template, not the symbolic
    fallback (that is what makes it as fast as a static compile)."""
    dynamic = tvm_hybrid.compile(_mlp()).specialize(x=(2, 16, 64))
    static = tvm_hybrid.compile(_mlp(), input_shapes={"x": (2, 16, 64)})
    assert dynamic.kernel_names() == static.kernel_names()
    schedules = {k.schedule for k in dynamic.kernels.values() if "matmul" in k.name}
    assert schedules == {"template"}
    symbolic = tvm_hybrid.compile(_mlp(), dynamic="symbolic")
    assert not isinstance(symbolic, SpecializingModel)
    assert {k.schedule for k in symbolic.kernels.values()} != {"template"}


def test_least_recently_used_specialization_is_dropped():
    compiled = tvm_hybrid.compile(_mlp(batch=1), max_specializations=2)
    for seq in (3, 5, 3, 9):
        compiled(np.zeros((1, seq, 64), "float32"))
    assert [s["x"][1] for s in compiled.specializations] == [3, 9]


def test_dynamic_model_rejects_bad_inputs_and_single_shape_calls():
    compiled = tvm_hybrid.compile(_mlp(batch=2))
    with pytest.raises(InputError, match=r"input 'x' must have shape 2xseqx64, got 3x4x64"):
        compiled(np.zeros((3, 4, 64), "float32"))
    with pytest.raises(InputError, match="rank 3"):
        compiled(np.zeros((2, 64), "float32"))
    with pytest.raises(OptionError, match=r"dynamic dimensions \(x: 2xseqx64\).*specialize"):
        compiled.export("model.so")
    with pytest.raises(OptionError, match="dynamic must be one of"):
        tvm_hybrid.compile(_mlp(), dynamic="buckets")
    with pytest.raises(OptionError, match="needs a shape for input 'x'"):
        compiled.specialize()


def test_input_shapes_still_give_one_static_model(rng):
    compiled = tvm_hybrid.compile(_mlp(), input_shapes={"x": (1, 8, 64)})
    assert not isinstance(compiled, SpecializingModel)
    x = rng.standard_normal((1, 8, 64)).astype("float32")
    np.testing.assert_allclose(compiled(x), _reference(_mlp(), x), rtol=1e-4, atol=1e-4)


def _by_value() -> onnx.ModelProto:
    """``ReduceMax(x, axes)`` and ``TopK(x, k)`` with ``axes`` and ``k`` graph inputs (TVM's
    importer needs both constant)."""
    nodes = [helper.make_node("ReduceMax", ["x", "axes"], ["m"], keepdims=1),
             helper.make_node("TopK", ["x", "k"], ["top", "where"], axis=-1)]
    graph = helper.make_graph(
        nodes, "by_value", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, "n"]),
                            helper.make_tensor_value_info("axes", TensorProto.INT64, ["r"]),
                            helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info(n, t, None) for n, t in
         (("m", TensorProto.FLOAT), ("top", TensorProto.FLOAT), ("where", TensorProto.INT64))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def test_inputs_needed_at_compile_time_are_specialized_per_value(rng, caplog):
    """A reduction's axes and TopK's k given as graph inputs: TVM's importer refuses them
    ("Only constant axes"); compiled once per value (and shape) instead, matching numpy."""
    from tvm_hybrid.frontend.value_inputs import value_inputs

    model = _by_value()
    assert value_inputs(model) == ["axes", "k"]
    compiled = tvm_hybrid.compile(model)
    assert isinstance(compiled, SpecializingModel)
    with caplog.at_level(logging.INFO, logger="tvm_hybrid.specializing_model"):
        for n, axis, k in ((6, 1, 2), (6, 0, 2), (8, 1, 3), (6, 1, 2)):
            x = rng.permutation(3 * n).reshape(3, n).astype("float32")  # no ties
            m, top, where = compiled(x, np.array([axis]), np.array([k]))
            np.testing.assert_array_equal(m, x.max(axis=axis, keepdims=True))
            order = np.argsort(-x, axis=-1)[:, :k]
            np.testing.assert_array_equal(where, order)
            np.testing.assert_array_equal(top, np.take_along_axis(x, order, -1))
    assert len([r for r in caplog.records if "compiled" in r.getMessage()]) == 3
    assert compiled.specializations[-1] == {"x": (3, 6), "axes": [1], "k": [2]}
    one = compiled.specialize({"axes": [0], "k": [1]}, x=(3, 4))
    assert [spec.name for spec in one.inputs] == ["x"]
    with pytest.raises(OptionError, match=r"exactly \['axes', 'k'\]"):
        compiled.specialize(x=(3, 4))
    with pytest.raises(OptionError, match=r"compiled per value of its inputs \['axes', 'k'\]"):
        compiled.export("model.so")
    with pytest.raises(UnsupportedModelError, match=r"takes \['axes', 'k'\] as inputs, "
                                                    "operands TVM needs at compile time"):
        tvm_hybrid.compile(model, dynamic="symbolic")  # one binary (what the CLI exports)
    with pytest.raises(InputError, match="'axes'.*has 100 elements; at most 64"):
        compiled(np.zeros((3, 6), "float32"), np.zeros(100, "int64"), np.array([1]))
    # Values the model cannot take are the caller's error, named (TVM read past the input
    # for a k larger than the axis).
    for axes, k, what in (([1], [7], "k = 7 is not within the 6 elements"),
                          ([1], [-1], "k = -1 is not within"), ([4], [1], "ReduceMax")):
        with pytest.raises(InputError, match=rf"cannot run with axes = \[{axes[0]}\], "
                                             rf"k = \[{k[0]}\]: .*{what}"):
            compiled(np.zeros((3, 6), "float32"), np.array(axes), np.array(k))
