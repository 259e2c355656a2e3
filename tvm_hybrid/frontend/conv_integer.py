"""ONNX ``ConvInteger`` (what ONNX Runtime's ``quantize_dynamic`` makes of every Conv) for TVM's
Relax importer, which lacks it.

``ConvInteger(x, w, x_zp, w_zp) = conv(int32(x) - x_zp, int32(w) - w_zp)`` in int32: exact.
Padding is zero in that shifted domain, as ONNX specifies (``x``'s padding is ``x_zp``). The
weight side folds to a constant at compile time; ``x_zp`` may be a run-time scalar (the
``DynamicQuantizeLinear`` before it). The convolution itself reuses TVM's ``Conv`` converter,
so every attribute (``auto_pad``, ``group``, strides, dilations, 1-D to 3-D) means the same.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import Conv, OnnxOpConverter, onnx_input


def _shifted(bb, value: relax.Expr, zero_point: relax.Expr | None,
             axis_shape=None) -> relax.Expr:
    shifted = bb.emit(relax.op.astype(value, "int32"))
    if zero_point is None:
        return shifted
    zp = bb.emit(relax.op.astype(zero_point, "int32"))  # emitted: reshape needs its type
    if axis_shape is not None:  # per-output-channel weight zero point [M] -> [M, 1, ...]
        zp = bb.emit(relax.op.reshape(zp, axis_shape))
    return bb.emit(relax.op.subtract(shifted, zp))


class ConvInteger(OnnxOpConverter):
    """ONNX ``ConvInteger`` (opset 10)."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x, w, x_zp, w_zp = inputs[0], inputs[1], inputs[2], inputs[3]
        rank = w.ty.ndim
        w_axis = None
        if w_zp is not None and w_zp.ty.ndim == 1:
            w_axis = [-1] + [1] * (rank - 1)
        if x_zp is not None and x_zp.ty.ndim == 1:
            x_zp = relax.op.reshape(x_zp, ())
        data = _shifted(bb, x, x_zp)
        weight = _shifted(bb, w, w_zp, w_axis)
        return Conv._impl_v11(bb, onnx_input([data, weight, None]), attr, params)


CONVERTERS = {"ConvInteger": ConvInteger}
