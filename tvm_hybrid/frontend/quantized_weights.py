"""Weights quantized inside the graph become integer initializers before import.

ONNX Runtime's quantizer, when a model keeps its weights in ``Constant`` nodes (Paddle
exports do), cannot quantize them offline: it writes ``QuantizeLinear(w, scale, zero_point)``
in front of each ``QLinearConv`` or ``DequantizeLinear``. The int8 passes (``FoldQDQ``) look for
``DequantizeLinear`` of an integer constant and did not see one, so constant folding made those
weights fp32 again and the convolutions ran as fp32 GEMMs with the quantization around them.

:func:`fold_weight_quantization` computes each ``QuantizeLinear`` whose inputs are all
constants (initializers or ``Constant`` nodes) by the operator's definition, in float32 as ONNX
Runtime does: ``saturate(round_half_to_even(w / scale) + zero_point)``, per tensor or per
``axis``; blocked quantization (opset 21's ``block_size``) and other output types are left as
they are.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper


def fold_weight_quantization(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with every ``QuantizeLinear`` of constants replaced by the integer initializer
    it computes; ``proto`` itself when there is none (otherwise a modified copy)."""
    graph = proto.graph
    constants = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and len(node.output) == 1:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None and value.ByteSize():
                constants[node.output[0]] = value
    folded = {}
    for node in graph.node:
        if node.op_type == "QuantizeLinear":
            tensor = _quantize(node, constants)
            if tensor is not None:
                folded[node.output[0]] = tensor
    if not folded:
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    kept = [n for n in out.graph.node
            if not (n.op_type == "QuantizeLinear" and n.output[0] in folded)]
    del out.graph.node[:]
    out.graph.node.extend(kept)
    out.graph.initializer.extend(folded.values())
    return out


def _quantize(node: onnx.NodeProto, constants: dict) -> onnx.TensorProto | None:
    """The integer initializer ``node`` (a ``QuantizeLinear``) computes, or None when an input
    is not constant or the form is not the plain one."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("block_size") or attrs.get("output_dtype") or len(node.output) != 1:
        return None
    names = [n for n in node.input if n]
    if len(names) < 2 or any(n not in constants for n in names):
        return None
    x = numpy_helper.to_array(constants[names[0]])
    scale = numpy_helper.to_array(constants[names[1]]).astype(np.float32)
    zero = (numpy_helper.to_array(constants[names[2]]) if len(names) > 2
            else np.zeros(scale.shape, np.uint8))  # no zero point: u8, zero
    if zero.dtype not in (np.uint8, np.int8) or x.dtype != np.float32 or scale.ndim > 1 or \
            zero.shape != scale.shape or not np.all(np.isfinite(scale)) or np.any(scale == 0):
        return None  # (the spec's forms only: a zero point shaped as its scale)
    if scale.ndim == 1 and scale.size > 1:  # per axis: the scales run along ``axis``
        axis = int(attrs.get("axis", 1)) % max(x.ndim, 1)
        if x.ndim == 0 or x.shape[axis] != scale.size:
            return None
        shape = [1] * x.ndim
        shape[axis] = scale.size
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    info = np.iinfo(zero.dtype)
    q = np.rint(x / scale) + zero.astype(np.float32)  # rint: round half to even
    q = np.clip(q, info.min, info.max).astype(zero.dtype)
    return numpy_helper.from_array(q, node.output[0])
