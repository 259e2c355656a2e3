"""Small ops TVM 0.27's ONNX importer lacks or gets wrong on valid models.

* ``Celu`` (opset 12) is missing: ``max(0, x) + min(0, alpha * (exp(x / alpha) - 1))``.
* ``Swish`` (opset 24) is missing: ``x * sigmoid(alpha * x)``.
* ``Pow`` with operands of different types (``float ** int64``, as exporters write integer
  exponents, or an integer base) fails in TVM on the type check, and integer ``Pow`` fails in
  its constant folding: the exponent is cast to a float base's type; an integer base is
  raised in float64 and cast back (rounded for an integer exponent, truncated otherwise, as
  ONNX's reference casts).
* ``LpNormalization`` is missing: ``x / (sum |x|^p)^(1/p)`` along ``axis`` (``p`` 1 or 2), 0
  where that norm is 0 (ONNX's reference).
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

from ..errors import UnsupportedModelError


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


class Swish(OnnxOpConverter):
    """ONNX ``Swish``: ``x * sigmoid(alpha * x)``."""

    @classmethod
    def _impl_v24(cls, bb, inputs, attr, params):
        x = inputs[0]
        alpha = relax.const(float(attr.get("alpha", 1.0)), str(x.ty.dtype))
        return relax.op.multiply(x, relax.op.sigmoid(relax.op.multiply(x, alpha)))


class Pow(OnnxOpConverter):
    """ONNX ``Pow`` on any mix of float and integer operands (the result has the base's type)."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        x, y = inputs[0], inputs[1]
        base, exponent = str(x.ty.dtype), str(y.ty.dtype)
        if base.startswith("float"):
            if exponent != base:
                y = bb.emit(relax.op.astype(y, base))
            return relax.op.power(x, y)
        wide = bb.emit(relax.op.power(bb.emit(relax.op.astype(x, "float64")),
                                      bb.emit(relax.op.astype(y, "float64"))))
        if not exponent.startswith("float"):
            wide = bb.emit(relax.op.round(wide))
        return relax.op.astype(wide, base)


class LpNormalization(OnnxOpConverter):
    """ONNX ``LpNormalization``: ``x`` over its ``p``-norm along ``axis`` (0 where it is 0)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        dtype = str(x.ty.dtype)
        axis, p = int(attr.get("axis", -1)), int(attr.get("p", 2))
        if p not in (1, 2):
            raise UnsupportedModelError(
                f"LpNormalization node {attr.get('tvm_custom', {}).get('name', '')!r}: p = "
                f"{p}; the specification allows 1 or 2")
        if p == 1:
            norm = relax.op.sum(relax.op.abs(x), axis=[axis], keepdims=True)
        else:
            norm = relax.op.sqrt(relax.op.sum(relax.op.multiply(x, x), axis=[axis],
                                              keepdims=True))
        norm = bb.emit(norm)
        zero = relax.const(0.0, dtype)
        safe = relax.op.where(relax.op.equal(norm, zero), relax.const(1.0, dtype), norm)
        return relax.op.where(relax.op.equal(norm, zero), zero, relax.op.divide(x, safe))


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


CONVERTERS = {"Celu": Celu, "OneHot": OneHot, "Swish": Swish,
              "LpNormalization": LpNormalization, "Pow": Pow}
