"""Two ops TVM 0.27's ONNX importer lacks or gets wrong on valid models.

* ``Celu`` (opset 12) is missing: ``max(0, x) + min(0, alpha * (exp(x / alpha) - 1))``.
* ``OneHot`` reads ``depth`` with ``tolist()``: the spec's rank-1, one-element ``depth`` (what
  exporters write) becomes a list and ``relax.op.one_hot`` rejects it with a type error. Here a
  constant one-element ``depth`` (integer or float, as the spec allows) is made a scalar first;
  anything else is left to TVM's converter and its message.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OneHot as _StockOneHot
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter, get_constant


class Celu(OnnxOpConverter):
    """ONNX ``Celu``: ``max(0, x) + min(0, alpha * (exp(x / alpha) - 1))``."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        x = inputs[0]
        dtype = str(x.ty.dtype)
        alpha = float(attr.get("alpha", 1.0))
        zero = relax.const(0.0, dtype)
        scaled = relax.op.multiply(x, relax.const(1.0 / alpha, dtype))
        expm1 = relax.op.subtract(relax.op.exp(scaled), relax.const(1.0, dtype))
        negative = relax.op.multiply(relax.const(alpha, dtype), expm1)
        return relax.op.add(relax.op.maximum(x, zero), relax.op.minimum(negative, zero))


class OneHot(OnnxOpConverter):
    """ONNX ``OneHot`` with its ``depth`` a scalar, then TVM's conversion."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        return cls._impl_v11(bb, inputs, attr, params)

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        depth = get_constant(inputs[1], params)
        if isinstance(depth, tvm.ir.GenericConst) and depth.value.numpy().size == 1:
            value = int(np.asarray(depth.value.numpy()).reshape(()))
            inputs = [inputs[0], relax.const(value, "int64"), *inputs[2:]]
        return _StockOneHot._impl_v11(bb, inputs, attr, params)


CONVERTERS = {"Celu": Celu, "OneHot": OneHot}
