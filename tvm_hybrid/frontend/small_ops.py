"""Small ops TVM 0.27's ONNX importer lacks or gets wrong on valid models.

* ``Elu``, ``Selu`` and ``ThresholdedRelu``: TVM's converters write float32 constants, so
  float16 and float64 models failed on the type check; here the constants take the input's
  type.
* ``Celu`` (opset 12) is missing: ``max(0, x) + min(0, alpha * (exp(x / alpha) - 1))``.
* ``Swish`` (opset 24) is missing: ``x * sigmoid(alpha * x)``.
* ``SwiGLU`` (opset 28) is missing: ``A * sigmoid(alpha * A) * B``.
* ``CenterCropPad`` (opset 18) is missing: a centred slice where the input is larger than the
  target (the window's start rounded down), zeros around it where smaller (the odd one after).
* ``RMSNormalization`` over every axis (``axis`` 0) failed in TVM's constant folding (its
  ``rms_norm`` kernel indexes the scalar statistic with the input's indices): the input gets
  a leading axis of 1 for the kernel, removed after.
* ``CumProd`` (opset 26) is missing: ``relax.op.cumprod`` along the constant axis, with
  ``exclusive`` and ``reverse`` as ``CumSum`` has them.
* ``Pow`` with operands of different types (``float ** int64``, as exporters write integer
  exponents, or an integer base) fails in TVM on the type check, and integer ``Pow`` fails in
  its constant folding: the exponent is cast to a float base's type; an integer base is
  raised in float64 and cast back (rounded for an integer exponent, truncated otherwise, as
  ONNX's reference casts).
* ``LpNormalization`` is missing: ``x / (sum |x|^p)^(1/p)`` along ``axis`` (``p`` 1 or 2), 0
  where that norm is 0 (ONNX's reference).
* ``OneHot``: TVM's converter reads ``depth`` with ``tolist()`` (the spec's rank-1,
  one-element ``depth``, what exporters write, becomes a list that ``relax.op.one_hot``
  rejects), makes ``values`` Python floats (a float32 model got a float64 output), and
  refuses float indices. Here: ``depth`` a scalar (integer or float, as the spec allows),
  float indices cast to int64 (the spec), the output in the type of ``values``; ``depth``
  and ``values`` computed at run time are refused naming the node.
* ``MaxUnpool`` with its ``output_shape`` operand fails in TVM's converter (it calls
  ``tolist()`` on the Relax constant), which also scatters into that shape where ONNX's
  reference scatters into the shape the pooling implies and pads it with zeros after: done so
  here for a constant ``output_shape``; one computed at run time is refused naming the node.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import MaxUnpool as _StockMaxUnpool
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter
from tvm.relax.frontend.onnx.onnx_frontend import RMSNormalization as _StockRMSNorm

from ..errors import UnsupportedModelError
from .static_dims import constant_int, constant_operand, static_dims


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


class Elu(OnnxOpConverter):
    """ONNX ``Elu``: ``x`` where positive, else ``alpha * (exp(x) - 1)``."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return _elu(inputs[0], float(attr.get("alpha", 1.0)), 1.0)


class Selu(OnnxOpConverter):
    """ONNX ``Selu``: ``gamma`` times ``Elu`` with ``alpha``."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return _elu(inputs[0], float(attr.get("alpha", 1.67326319217681884765625)),
                    float(attr.get("gamma", 1.05070102214813232421875)))


def _elu(x, alpha: float, gamma: float):
    dtype = str(x.ty.dtype)
    negative = relax.op.multiply(relax.const(alpha, dtype), relax.op.subtract(
        relax.op.exp(x), relax.const(1.0, dtype)))
    out = relax.op.where(relax.op.greater(x, relax.const(0.0, dtype)), x, negative)
    return out if gamma == 1.0 else relax.op.multiply(relax.const(gamma, dtype), out)


class ThresholdedRelu(OnnxOpConverter):
    """ONNX ``ThresholdedRelu``: ``x`` where above ``alpha``, else 0."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x = inputs[0]
        dtype = str(x.ty.dtype)
        above = relax.op.greater(x, relax.const(float(attr.get("alpha", 1.0)), dtype))
        return relax.op.where(above, x, relax.const(0.0, dtype))


class Swish(OnnxOpConverter):
    """ONNX ``Swish``: ``x * sigmoid(alpha * x)``."""

    @classmethod
    def _impl_v24(cls, bb, inputs, attr, params):
        x = inputs[0]
        alpha = relax.const(float(attr.get("alpha", 1.0)), str(x.ty.dtype))
        return relax.op.multiply(x, relax.op.sigmoid(relax.op.multiply(x, alpha)))


class SwiGLU(OnnxOpConverter):
    """ONNX ``SwiGLU``: ``Swish_alpha(A) * B`` (inputs of one shape)."""

    @classmethod
    def _impl_v28(cls, bb, inputs, attr, params):
        gate, value = inputs[0], inputs[1]
        alpha = relax.const(float(attr.get("alpha", 1.0)), str(gate.ty.dtype))
        swish = relax.op.multiply(gate, relax.op.sigmoid(relax.op.multiply(alpha, gate)))
        return relax.op.multiply(swish, value)


class CenterCropPad(OnnxOpConverter):
    """ONNX ``CenterCropPad``: each of ``axes`` cropped or zero-padded, centred, to ``shape``."""

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        node = f"CenterCropPad node {attr.get('tvm_custom', {}).get('name', '')!r}"
        sizes = [int(v) for v in constant_operand(inputs[1], params, "shape", node).reshape(-1)]
        x = inputs[0]
        dims = static_dims(x, "input", node)
        axes = [a + len(dims) if a < 0 else a for a in attr.get("axes", range(len(dims)))]
        if len(axes) != len(sizes):
            raise UnsupportedModelError(f"{node}: {len(sizes)} sizes for axes {axes}")
        pads = [0] * (2 * len(dims))
        for axis, size in zip(axes, sizes):
            if dims[axis] > size:
                start = (dims[axis] - size) // 2
                x = bb.emit(relax.op.strided_slice(x, [axis], [start], [start + size]))
            elif dims[axis] < size:
                pads[2 * axis] = (size - dims[axis]) // 2
                pads[2 * axis + 1] = size - dims[axis] - pads[2 * axis]
        return bb.emit(relax.op.nn.pad(x, pads)) if any(pads) else x


class RMSNormalization(OnnxOpConverter):
    """ONNX ``RMSNormalization``: TVM's conversion, over every axis through a leading 1."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        x = inputs[0]
        rank = len(x.ty.shape)
        axis = int(attr.get("axis", -1))
        if (axis + rank if axis < 0 else axis) != 0:
            return _StockRMSNorm._impl_v23(bb, inputs, attr, params)
        shape = [d for d in x.ty.shape]
        lifted = bb.emit(relax.op.expand_dims(x, 0))
        out = bb.normalize(_StockRMSNorm._impl_v23(bb, [lifted, *inputs[1:]],
                                                   {**attr, "axis": 1}, params))
        return relax.op.reshape(out, shape)


class CumProd(OnnxOpConverter):
    """ONNX ``CumProd``: the running product along ``axis`` (``exclusive``: of the elements
    before; ``reverse``: from the end)."""

    @classmethod
    def _impl_v26(cls, bb, inputs, attr, params):
        node = f"CumProd node {attr.get('tvm_custom', {}).get('name', '')!r}"
        axis = constant_int(inputs[1], params, "axis", node)
        data = inputs[0]
        reverse = bool(attr.get("reverse", 0))
        if reverse:
            data = bb.emit(relax.op.flip(data, axis))
        out = bb.emit(relax.op.cumprod(data, axis, exclusive=bool(attr.get("exclusive", 0))))
        return bb.emit(relax.op.flip(out, axis)) if reverse else out


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
    """ONNX ``OneHot``: ``values[1]`` where the (negative: counted from ``depth``) index is
    the position along ``axis``, else ``values[0]``, in the type of ``values``."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        return cls._impl_v11(bb, inputs, attr, params)

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        node = f"OneHot node {attr.get('tvm_custom', {}).get('name', '')!r}"
        depth_value = constant_operand(inputs[1], params, "depth", node).reshape(-1)
        pair = constant_operand(inputs[2], params, "values", node).reshape(-1)
        if depth_value.size != 1 or pair.size != 2:
            raise UnsupportedModelError(f"{node}: depth must have one element and values two, "
                                        f"got {depth_value.size} and {pair.size}")
        count = int(depth_value[0])
        indices = inputs[0]
        if "int" not in str(indices.ty.dtype):  # the specification: cast to int64
            indices = bb.emit(relax.op.astype(indices, "int64"))
        dtype = str(indices.ty.dtype)
        negative = relax.op.less(indices, relax.const(0, dtype))
        indices = bb.emit(relax.op.where(negative, relax.op.add(
            indices, relax.const(count, dtype)), indices))
        axis = int(attr.get("axis", -1))
        axis = axis + len(indices.ty.shape) + 1 if axis < 0 else axis
        hot = bb.emit(relax.op.one_hot(indices, relax.prim_value(1), relax.prim_value(0),
                                       count, axis))
        # bfloat16 values are selected in float32 (exact) and cast back.
        out_dtype = str(inputs[2].ty.dtype)
        pair = pair.astype("float32") if out_dtype == "bfloat16" else pair
        chosen = bb.emit(relax.op.where(
            relax.op.equal(hot, relax.const(1, str(hot.ty.dtype))),
            relax.const(pair[1], str(pair.dtype)),
            relax.const(pair[0], str(pair.dtype))))
        return bb.emit(relax.op.astype(chosen, out_dtype)) if out_dtype == "bfloat16" else chosen


class MaxUnpool(OnnxOpConverter):
    """ONNX ``MaxUnpool``: TVM's conversion into the shape the pooling implies, then, with
    ``output_shape``, zeros after it up to that shape (ONNX's reference)."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        inputs = list(inputs) + [None] * (3 - len(inputs))
        unpooled = bb.normalize(_StockMaxUnpool._impl_v9(bb, [*inputs[:2], None], attr, params))
        if inputs[2] is None:
            return unpooled
        name = attr.get("tvm_custom", {}).get("name", "")
        wanted = [int(d) for d in constant_operand(inputs[2], params, "output_shape",
                                                   f"MaxUnpool node {name!r}").reshape(-1)]
        implied = [int(d) for d in unpooled.ty.shape]
        if len(wanted) != len(implied) or any(w < i for w, i in zip(wanted, implied)):
            raise UnsupportedModelError(f"MaxUnpool node {name!r}: output_shape {wanted} is "
                                        f"smaller than the unpooled shape {implied}")
        widths = [v for w, i in zip(wanted, implied) for v in (0, w - i)]
        return relax.op.nn.pad(unpooled, widths)


CONVERTERS = {"Elu": Elu, "Selu": Selu, "ThresholdedRelu": ThresholdedRelu, "Celu": Celu,
              "OneHot": OneHot, "Swish": Swish, "SwiGLU": SwiGLU,
              "CumProd": CumProd, "CenterCropPad": CenterCropPad, "MaxUnpool": MaxUnpool,
              "RMSNormalization": RMSNormalization, "LpNormalization": LpNormalization,
              "Pow": Pow}
