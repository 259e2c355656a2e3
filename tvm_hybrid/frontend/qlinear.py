"""Importing ONNX ``QLinearMatMul`` and ``QLinearConv``, which TVM's ONNX frontend lacks.

``QLinearMatMul(a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp)`` is, by its definition,
``QuantizeLinear(MatMul(DequantizeLinear(a), DequantizeLinear(b)), y_scale, y_zp)``, and
``QLinearConv(x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp[, B])`` is
``QuantizeLinear(Conv(DequantizeLinear(x), DequantizeLinear(w), DequantizeLinear(B,
x_scale * w_scale)), y_scale, y_zp)`` with the convolution's attributes (the int32 bias has
the scale of the products and zero point 0). The model is rewritten to that QDQ form before
import (per-column ``b`` scales keep ``axis=1``, per-output-channel ``w`` scales ``axis=0``);
the hybrid pipeline's ``FoldQDQ`` pass then computes it on the integer kernels with integer
requantization, and the stock pipeline in float, as for any QDQ model.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

_OPS = ("QLinearMatMul", "QLinearConv")


def decompose_qlinear(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with every ``QLinearMatMul`` and ``QLinearConv`` node replaced by its QDQ
    decomposition.

    Returns ``proto`` itself when it has none; otherwise a modified copy.
    """
    if not any(n.op_type in _OPS for n in proto.graph.node):
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    inits = {t.name: t for t in out.graph.initializer}
    nodes = []
    for index, node in enumerate(out.graph.node):
        if node.op_type == "QLinearConv":
            nodes += _conv(node, index, inits, out.graph)
            continue
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


def _conv(node: onnx.NodeProto, index: int, inits: dict, graph: onnx.GraphProto) -> list:
    """The QDQ nodes of one ``QLinearConv`` (module docstring); a bias scale computable from
    constant scales becomes a constant, as quantizers write it, else a ``Mul`` node."""
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, *rest = [*node.input, ""][:9]
    bias = rest[0] if rest else ""
    base = f"{node.name or node.output[0]}__qlinear{index}"
    scale = inits.get(w_scale)
    per_channel = scale is None or (len(scale.dims) == 1 and scale.dims[0] > 1)
    w_axis = {"axis": 0} if per_channel else {}  # (an unknown scale's axis is harmless)
    nodes = [
        helper.make_node("DequantizeLinear", [x, x_scale, x_zp], [f"{base}_x"]),
        helper.make_node("DequantizeLinear", [w, w_scale, w_zp], [f"{base}_w"], **w_axis),
    ]
    conv_inputs = [f"{base}_x", f"{base}_w"]
    if bias:
        bias_scale = f"{base}_bias_scale"
        if x_scale in inits and w_scale in inits:
            product = (numpy_helper.to_array(inits[x_scale]).astype(np.float32)
                       * numpy_helper.to_array(inits[w_scale]).astype(np.float32))
            graph.initializer.append(numpy_helper.from_array(product.astype(np.float32),
                                                             bias_scale))
        else:
            nodes.append(helper.make_node("Mul", [x_scale, w_scale], [bias_scale]))
        nodes.append(helper.make_node("DequantizeLinear", [bias, bias_scale], [f"{base}_b"],
                                      **w_axis))
        conv_inputs.append(f"{base}_b")
    nodes += [
        helper.make_node("Conv", conv_inputs, [f"{base}_y"], name=node.name,
                         **{a.name: helper.get_attribute_value(a) for a in node.attribute}),
        helper.make_node("QuantizeLinear", [f"{base}_y", y_scale, y_zp], list(node.output)),
    ]
    return nodes
