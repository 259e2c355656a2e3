"""``Clip`` with constant bounds as Relax ``maximum``/``minimum``.

TVM 0.27 imports ``Clip`` as two ``call_te`` kernels (``topi.maximum``, ``topi.minimum``): opaque
``call_tir`` calls that layout conversion, constant folding and the epilogue patterns cannot
look into, so every ReLU6 or clip after a convolution stopped the NHWC layout (a transpose on
each side) and the GEMM epilogue. With constant (or absent) bounds they are plain Relax ops
here; other bounds keep TVM's conversion.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import Clip as _StockClip
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

_FLOATS = ("float32", "float16", "float64")


def _bound(value) -> relax.Expr | None:
    if isinstance(value, tvm.ir.GenericConst) and value.value.numpy().size == 1:
        return value
    return None


def _clip(x: relax.Expr, lo, hi) -> relax.Expr:
    dtype = str(x.ty.dtype)
    out = x
    if lo is not None and not np.isnan(lo):
        out = relax.op.maximum(out, relax.const(lo, dtype))
    if hi is not None and not np.isnan(hi):
        out = relax.op.minimum(out, relax.const(hi, dtype))
    return out


class Clip(OnnxOpConverter):
    """ONNX ``Clip`` (attribute bounds before opset 11, input bounds after)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if str(inputs[0].ty.dtype) not in _FLOATS:
            return _StockClip._impl_v1(bb, inputs, attr, params)
        return _clip(inputs[0], float(attr.get("min", -np.inf)), float(attr.get("max", np.inf)))

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        return cls._impl_v13(bb, inputs, attr, params)

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        bounds = [inputs[i] if i < len(inputs) else None for i in (1, 2)]
        consts = [None if b is None else _bound(b) for b in bounds]
        if str(inputs[0].ty.dtype) not in _FLOATS or any(
                b is not None and c is None for b, c in zip(bounds, consts)):
            return _StockClip._impl_v13(bb, inputs, attr, params)
        lo, hi = (None if c is None else float(c.value.numpy().reshape(())) for c in consts)
        return _clip(inputs[0], lo, hi)


CONVERTERS = {"Clip": Clip}
