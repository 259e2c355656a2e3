"""Importing ONNX ``QLinearMatMul``, which TVM's ONNX frontend lacks.

``QLinearMatMul(a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp)`` is, by its definition,
``QuantizeLinear(MatMul(DequantizeLinear(a), DequantizeLinear(b)), y_scale, y_zp)``. The model
is rewritten to that QDQ form before import (per-column ``b`` scales keep ``axis=1``); the
hybrid pipeline's ``FoldQDQ`` pass then computes it as an int8 GEMM with integer
requantization, and the stock pipeline in float, as for any QDQ model.
"""

from __future__ import annotations

import onnx
from onnx import helper


def decompose_qlinear_matmul(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with every ``QLinearMatMul`` node replaced by its QDQ decomposition.

    Returns ``proto`` itself when it has none; otherwise a modified copy.
    """
    if not any(n.op_type == "QLinearMatMul" for n in proto.graph.node):
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    inits = {t.name: t for t in out.graph.initializer}
    nodes = []
    for index, node in enumerate(out.graph.node):
        if node.op_type != "QLinearMatMul":
            nodes.append(node)
            continue
        a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = node.input
        base = f"{node.name or node.output[0]}__qlinear{index}"
        b_axis = {}
        scale = inits.get(b_scale)
        if scale is not None and len(scale.dims) == 1 and scale.dims[0] > 1:
            b_axis = {"axis": 1}  # one scale per output column
        nodes += [
            helper.make_node("DequantizeLinear", [a, a_scale, a_zp], [f"{base}_a"]),
            helper.make_node("DequantizeLinear", [b, b_scale, b_zp], [f"{base}_b"], **b_axis),
            helper.make_node("MatMul", [f"{base}_a", f"{base}_b"], [f"{base}_y"]),
            helper.make_node("QuantizeLinear", [f"{base}_y", y_scale, y_zp], list(node.output)),
        ]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out
