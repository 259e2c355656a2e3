"""A corpus of bad models, bad inputs and damaged artifacts, each with the error it must raise.

Every entry is something a careless or hostile user can hand tvm_hybrid; none may crash the
process (a signal) or return a silent wrong answer. ``tests/test_reliability.py`` runs each
through the Python API and the CLI, in a subprocess.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _model(nodes, inputs, outputs, inits=(), opset: int = 17, ir: int = 8,
           domains: tuple = ()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "corpus", inputs, outputs, list(inits))
    imports = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domains)]
    proto = helper.make_model(graph, opset_imports=imports)
    proto.ir_version = ir
    return proto


def _value(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(shape))


def gather_model(vocab: int = 10, dim: int = 4, ids_shape=(3,), id_type: int = TensorProto.INT64,
                 op: str = "Gather") -> onnx.ModelProto:
    """``op`` (Gather or GatherElements) on a constant ``vocab x dim`` table by input ``ids``."""
    table = np.arange(vocab * dim, dtype=np.float32).reshape(vocab, dim)
    if op == "GatherElements":
        ids_shape = (*ids_shape[:-1], dim) if len(ids_shape) == 2 else (2, dim)
        out_shape = ids_shape
    else:
        out_shape = (*ids_shape, dim)
    return _model([helper.make_node(op, ["table", "ids"], ["y"], axis=0)],
                  [_value("ids", id_type, ids_shape)], [_value("y", TensorProto.FLOAT, out_shape)],
                  [numpy_helper.from_array(table, "table")])


def relu_model(opset: int = 17, ir: int = 8, domain: str = "") -> onnx.ModelProto:
    """``y = Relu(x)`` on [2, 3], with the given opset, IR version and node domain."""
    node = helper.make_node("Relu", ["x"], ["y"], domain=domain)
    return _model([node], [_value("x", TensorProto.FLOAT, (2, 3))],
                  [_value("y", TensorProto.FLOAT, (2, 3))], opset=opset, ir=ir,
                  domains=(domain,) if domain else ())


def erf_model() -> onnx.ModelProto:
    return _model([helper.make_node("Erf", ["x"], ["y"])], [_value("x", TensorProto.FLOAT, (8,))],
                  [_value("y", TensorProto.FLOAT, (8,))])


def scalar_model() -> onnx.ModelProto:
    """``y = x * 2 + 1`` on a 0-d input."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["m"]),
             helper.make_node("Add", ["m", "one"], ["y"])]
    return _model(nodes, [_value("x", TensorProto.FLOAT, ())], [_value("y", TensorProto.FLOAT, ())],
                  [numpy_helper.from_array(np.array(2, np.float32), "two"),
                   numpy_helper.from_array(np.array(1, np.float32), "one")])


def bad_reshape_model() -> onnx.ModelProto:
    """A Reshape of 6 elements to 7: TVM's importer fails (and leaves a C++ warning behind)."""
    node = helper.make_node("Reshape", ["x", "shape"], ["y"])
    return _model([node], [_value("x", TensorProto.FLOAT, (2, 3))],
                  [_value("y", TensorProto.FLOAT, (7,))],
                  [numpy_helper.from_array(np.array([7], np.int64), "shape")])


def huge_model(rows: int = 1 << 22, cols: int = 1 << 22) -> onnx.ModelProto:
    """An outer product whose [rows, cols] fp32 result (64 TiB by default) fits no memory."""
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"])]
    return _model(nodes, [_value("a", TensorProto.FLOAT, (rows, 1)),
                          _value("b", TensorProto.FLOAT, (1, cols))],
                  [_value("y", TensorProto.FLOAT, (rows, cols))])


def bad_index_inputs(vocab: int = 10) -> dict[str, np.ndarray]:
    """Index arrays a Gather on a table of ``vocab`` rows must refuse, by name."""
    return {
        "equal to the size": np.array([1, vocab, 0], np.int64),
        "just below -size": np.array([0, -vocab - 1, 0], np.int64),
        "1e6": np.array([1_000_000, 0, 0], np.int64),
        "2**40": np.array([2**40, 0, 0], np.int64),
        "INT64_MIN": np.array([np.iinfo(np.int64).min, 0, 0], np.int64),
        "INT64_MAX": np.array([np.iinfo(np.int64).max, 0, 0], np.int64),
    }


def damaged_libraries(good: bytes) -> dict[str, bytes]:
    """Damaged copies of an exported library's bytes, by name."""
    return {
        "cut to 10%": good[: len(good) // 10],
        "cut to 50%": good[: len(good) // 2],
        "empty": b"",
        "one byte flipped": good[:1000] + bytes([good[1000] ^ 0xFF]) + good[1001:],
        "not ELF": b"#!/bin/sh\necho hello\n" + bytes(100),
    }
