"""Ops TVM 0.27's ONNX importer converts with a wrong answer instead of an error.

* ``NonMaxSuppression``: ``max_output_boxes_per_class``, ``iou_threshold`` and
  ``score_threshold`` given at run time (graph inputs, not initializers) are replaced by
  defaults (0, 0.5, 0.0): with the default 0 the op selects no box at all. Such inputs now raise
  an error naming the node and the input; constant ones convert as before.
* ``IsInf`` ignores ``detect_positive`` and ``detect_negative``: here they select the sign.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import NonMaxSuppression as _StockNMS
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from ..errors import UnsupportedModelError

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


CONVERTERS = {"NonMaxSuppression": NonMaxSuppression, "IsInf": IsInf}
