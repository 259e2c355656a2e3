"""Models and checks the tests share: a constant-weight Linear + ReLU model, a compiled ONNX
model against ONNX Runtime (or a given reference), and the kernels its ``main`` calls."""

from __future__ import annotations

import re

import numpy as np


def linear_relu(m: int, n: int, k: int, rng: np.random.Generator):
    """A constant-weight ``relu(x @ w + b)`` model of ``x[m, k]`` (opset 17, IR version 8),
    with its ``w[k, n]`` and ``b[n]`` (standard normal float32)."""
    from onnx import TensorProto, helper, numpy_helper

    w = rng.standard_normal((k, n)).astype("float32")
    b = rng.standard_normal(n).astype("float32")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    return proto, w, b


def compiles_and_matches(model, feeds: dict, *, target=None, rtol: float = 1e-4,
                         expected: np.ndarray | None = None):
    """Compile ``model`` (for ``target``, else the host) and check its first output on
    ``feeds`` against ``expected`` (ONNX Runtime's when None) within ``rtol`` relative and
    ``rtol`` of the output's scale; return the compiled model."""
    import tvm_hybrid

    compiled = tvm_hybrid.compile(model, target)
    if expected is None:
        import onnxruntime as ort

        expected = ort.InferenceSession(model.SerializeToString(),
                                        providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = np.asarray(compiled(**feeds))
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * np.abs(expected).max())
    return compiled


def main_calls(compiled) -> list[str]:
    """The functions ``main`` of a compiled model calls, once per call, in order."""
    return re.findall(r"^\s*(\w+)\(", compiled.lowered["main"].script(), re.MULTILINE)
