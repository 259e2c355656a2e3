"""Ops TVM 0.27's ONNX importer converts with a wrong answer instead of an error.

* ``NonMaxSuppression``: ``max_output_boxes_per_class``, ``iou_threshold`` and
  ``score_threshold`` given at run time (graph inputs, not initializers) are replaced by
  defaults (0, 0.5, 0.0): with the default 0 the op selects no box at all. Such inputs now raise
  an error naming the node and the input; constant ones convert as before (graph inputs are
  made constants per value first: ``value_inputs.py``).
* ``IsInf`` ignores ``detect_positive`` and ``detect_negative``: here they select the sign.
* ``ConvTranspose`` ignores ``output_shape`` (tf2onnx writes it): the output had the size of no
  padding. Here the specification's padding is derived from it (the total split as ``auto_pad``
  says, ``SAME_UPPER`` putting the odd unit at the end, anything else at the start); a
  negative end (an output longer than the full transposed convolution) becomes
  ``output_padding``. Output sizes that would need rows before the start, or more extra rows
  than the stride, are refused by name.
* ``Expand`` with a shape computed at run time broadcast to that shape as given, so a 1 in it
  against a larger input dimension gave that dimension 1 (the specification broadcasts both
  ways: ``[3, 1]`` expanded by ``[2, 1, 6]`` is ``[2, 3, 6]``). Here the shape is first
  raised to the input's dimensions (an element-wise maximum, right-aligned).
* ``LayerNormalization`` returns 0 for its optional ``Mean`` and ``InvStdDev`` outputs: here
  they are computed (over the normalised axes, kept as 1s) when the node has them.
* ``TopK``: opset 10's ``k`` input was read as opset 1's attribute (absent, so ``k = 1``);
  a ``k`` larger than the axis gave an output of ``k`` elements past the input's end
  (uninitialised memory), and a negative one a deep TVM error. Here ``k`` is read where the
  opset puts it and checked against the axis (an error naming the node); ``sorted = 0``
  (any order) is served sorted.
* ``SpaceToDepth`` ignores ``mode`` (opset 28's ``CRD``: each channel's block together) and
  always moved blocks in ``DCR`` order.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import ConvTranspose as _StockConvTranspose
from tvm.relax.frontend.onnx.onnx_frontend import Expand as _StockExpand
from tvm.relax.frontend.onnx.onnx_frontend import LayerNormalization as _StockLayerNorm
from tvm.relax.frontend.onnx.onnx_frontend import NonMaxSuppression as _StockNMS
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from ..errors import UnsupportedModelError
from .static_dims import constant_int, static_dims

_NMS_SCALARS = ("max_output_boxes_per_class", "iou_threshold", "score_threshold")


class NonMaxSuppression(OnnxOpConverter):
    """ONNX ``NonMaxSuppression`` with its scalar inputs constant, by TVM's conversion."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        node = attr.get("tvm_custom", {}).get("name", "")
        for name, value in zip(_NMS_SCALARS, list(inputs)[2:5]):
            if value is None or isinstance(value, tvm.ir.GenericConst):
                continue
            if isinstance(value, relax.Var) and value.name in params[1]:
                continue  # an initializer kept as a parameter: TVM reads its value
            raise UnsupportedModelError(
                f"NonMaxSuppression node {node!r}: {name} is given at run time; TVM's "
                "conversion needs it constant (an initializer), and would otherwise use a "
                "default and select wrong boxes")
        return _StockNMS._impl_v10(bb, inputs, attr, params)


class IsInf(OnnxOpConverter):
    """ONNX ``IsInf`` with ``detect_positive`` and ``detect_negative``."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x = inputs[0]
        positive = bool(int(attr.get("detect_positive", 1)))
        negative = bool(int(attr.get("detect_negative", 1)))
        inf = relax.op.isinf(x)
        if positive and negative:
            return inf
        if not (positive or negative):
            return relax.op.logical_and(inf, relax.op.logical_not(inf))  # all False
        zero = relax.const(0, str(x.ty.dtype))
        sign = relax.op.greater(x, zero) if positive else relax.op.less(x, zero)
        return relax.op.logical_and(bb.emit(inf), bb.emit(sign))


class ConvTranspose(OnnxOpConverter):
    """ONNX ``ConvTranspose`` with ``output_shape`` turned into pads, then TVM's conversion."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if "output_shape" not in attr:
            return _StockConvTranspose._impl_v1(bb, inputs, attr, params)
        node = f"ConvTranspose node {attr.get('tvm_custom', {}).get('name', '')!r}"
        out = [int(v) for v in attr["output_shape"]]
        dims = static_dims(inputs[0], "the input", node, " (output_shape needs its size)")[2:]
        if len(dims) != len(out):
            raise UnsupportedModelError(f"{node}: output_shape {out} has {len(out)} dimensions, "
                                        f"the input {len(dims)} spatial ones")
        n = len(out)
        strides = list(attr.get("strides", [1] * n))
        dilations = list(attr.get("dilations", [1] * n))
        extra = list(attr.get("output_padding", [0] * n))
        kernel = list(attr.get("kernel_shape", [int(k) for k in inputs[1].ty.shape.values[2:]]))
        auto_pad = attr.get("auto_pad", "NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        begin, end = [], []
        for i in range(n):
            total = (strides[i] * (dims[i] - 1) + extra[i]
                     + (kernel[i] - 1) * dilations[i] + 1 - out[i])
            first = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            last = total - first
            if last < 0:
                extra[i], last = extra[i] - last, 0
            if first < 0 or extra[i] >= max(strides[i], dilations[i]):
                raise UnsupportedModelError(
                    f"{node}: output_shape {out} is larger than the transposed convolution of "
                    f"{dims} can produce with its pads")
            begin.append(first)
            end.append(last)
        attr = {k: v for k, v in attr.items() if k not in ("output_shape", "auto_pad")}
        attr.update(pads=begin + end, output_padding=extra)
        return _StockConvTranspose._impl_v1(bb, inputs, attr, params)


class LayerNormalization(OnnxOpConverter):
    """ONNX ``LayerNormalization`` with its ``Mean`` and ``InvStdDev`` outputs computed."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        stock = _StockLayerNorm._impl_v17(bb, inputs, attr, params)
        if int(attr.get("tvm_custom", {}).get("num_outputs", 1)) < 2:
            return stock
        x = inputs[0]
        rank = len(x.ty.shape.values)
        axis = int(attr.get("axis", -1)) % rank
        axes = list(range(axis, rank))
        mean = bb.emit(relax.op.mean(x, axis=axes, keepdims=True))
        centred = bb.emit(relax.op.subtract(x, mean))
        variance = bb.emit(relax.op.mean(bb.emit(relax.op.multiply(centred, centred)),
                                         axis=axes, keepdims=True))
        epsilon = relax.const(float(attr.get("epsilon", 1e-5)), str(x.ty.dtype))
        inv_std = bb.emit(relax.op.rsqrt(bb.emit(relax.op.add(variance, epsilon))))
        return relax.Tuple([bb.emit(relax.TupleGetItem(bb.emit(stock), 0)), mean, inv_std])


class Expand(OnnxOpConverter):
    """ONNX ``Expand`` broadcasting both ways when its shape is known only at run time."""

    @classmethod
    def _impl_v8(cls, bb, inputs, attr, params):
        return cls._impl_v13(bb, inputs, attr, params)

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, shape = inputs[0], inputs[1]
        runtime = not isinstance(shape, (relax.ShapeExpr, tvm.ir.GenericConst)) and isinstance(
            getattr(shape, "ty", None), relax.TensorType)
        dims = list(data.ty.shape.values) if runtime and data.ty.shape is not None else None
        length = shape.ty.shape.values[0] if runtime and shape.ty.shape is not None else None
        if dims is not None and isinstance(length, tvm.tirx.IntImm) and all(
                isinstance(d, tvm.tirx.IntImm) for d in dims) and int(length) >= len(dims):
            floor = [1] * (int(length) - len(dims)) + [int(d) for d in dims]
            shape = bb.emit(relax.op.maximum(bb.emit(relax.op.astype(shape, "int64")),
                                             relax.const(np.array(floor), "int64")))
            inputs = [data, shape, *inputs[2:]]
        return _StockExpand._impl_v13(bb, inputs, attr, params)


class TopK(OnnxOpConverter):
    """ONNX ``TopK``: ``k`` (attribute in opset 1, input from opset 10) checked against the
    axis, then ``relax.op.topk``."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return cls._topk(bb, inputs[0], int(attr.get("k", 1)), attr)

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        node = f"TopK node {attr.get('tvm_custom', {}).get('name', '')!r}"
        return cls._topk(bb, inputs[0], constant_int(inputs[1], params, "k", node), attr)

    @classmethod
    def _topk(cls, bb, data, k: int, attr):
        node = f"TopK node {attr.get('tvm_custom', {}).get('name', '')!r}"
        axis = int(attr.get("axis", -1))
        dims = data.ty.shape.values if data.ty.shape is not None else None
        if dims is not None and -len(dims) <= axis < len(dims):
            size = dims[axis]
            if isinstance(size, tvm.tirx.IntImm) and not 0 <= k <= int(size):
                raise UnsupportedModelError(f"{node}: k = {k} is not within the {int(size)} "
                                            f"elements of axis {axis}")
        if k < 0:
            raise UnsupportedModelError(f"{node}: k = {k} is negative")
        return relax.op.topk(data, k, axis, ret_type="both",
                             largest=bool(attr.get("largest", 1)), dtype="int64")


class SpaceToDepth(OnnxOpConverter):
    """ONNX ``SpaceToDepth`` in either ``mode``: output channel ``(i * b + j) * C + c``
    (``DCR``, the default) or ``c * b * b + i * b + j`` (``CRD``) holds block offset ``(i, j)``
    of channel ``c``."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        node = f"SpaceToDepth node {attr.get('tvm_custom', {}).get('name', '')!r}"
        mode = attr.get("mode", b"DCR")
        mode = mode.decode() if isinstance(mode, bytes) else str(mode)
        if mode not in ("DCR", "CRD"):
            raise UnsupportedModelError(f"{node}: unknown mode {mode!r}")
        size = int(attr["blocksize"])
        n, c, h, w = inputs[0].ty.shape  # sizes or symbolic dimensions
        blocks = relax.op.reshape(inputs[0], (n, c, h // size, size, w // size, size))
        order = [0, 3, 5, 1, 2, 4] if mode == "DCR" else [0, 1, 3, 5, 2, 4]
        moved = relax.op.permute_dims(blocks, order)
        return relax.op.reshape(moved, (n, c * size * size, h // size, w // size))


CONVERTERS = {"NonMaxSuppression": NonMaxSuppression, "IsInf": IsInf, "Expand": Expand,
              "ConvTranspose": ConvTranspose, "LayerNormalization": LayerNormalization,
              "SpaceToDepth": SpaceToDepth, "TopK": TopK}
