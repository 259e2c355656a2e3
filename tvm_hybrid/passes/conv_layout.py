"""Graph forms that let ``ConvertLayout`` carry NHWC through a chain of convolutions.

A 1-D convolution becomes a 2-D one of height 1 (:class:`Conv1dAs2d`), and
:class:`LayoutFriendly` rewrites ops TVM's layout rules stop at into equivalent forms they
carry (clips, lower-rank constants, per-tensor fake quantization). ``conv_gemm.py`` runs both
before ``ConvertLayout``, and :class:`ChannelShuffleNHWC` after it.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .relax_rewrite import bound_value, constant_value, is_op, is_static_tensor, static_shape


def fp32_operands(mutator: relax.PyExprMutator, call: relax.Call,
                   ndim: int) -> tuple[relax.Expr, np.ndarray] | None:
    """``(x, weight value)`` of a convolution whose input and output are static fp32 tensors of
    rank ``ndim`` and whose weight is an fp32 constant of that rank; None otherwise."""
    x, weight = call.args
    w = constant_value(mutator, weight)
    if (w is None or w.dtype != np.float32 or w.ndim != ndim
            or not is_static_tensor(x.ty, ("float32",), min_ndim=ndim)
            or not is_static_tensor(call.ty, ("float32",), min_ndim=ndim)):
        return None
    return x, w


@relax.expr_functor.mutator
class Conv1dAs2d(relax.PyExprMutator):
    """``conv1d(x[N, C, W], w[O, C/g, KW])`` with a constant weight as
    ``squeeze(conv2d(x[N, C, 1, W], w[O, C/g, 1, KW]), 2)``."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not is_op(call, "relax.nn.conv1d"):
            return call
        attrs = call.attrs
        operands = fp32_operands(self, call, ndim=3)
        if (str(attrs.data_layout) != "NCW" or str(attrs.kernel_layout) != "OIW"
                or str(attrs.out_layout) not in ("NCW", "") or operands is None):
            return call
        x, w = operands
        pads = [int(p) for p in attrs.padding]
        conv = relax.op.nn.conv2d(
            relax.op.expand_dims(x, 2), relax.const(np.ascontiguousarray(w[:, :, None, :])),
            strides=(1, int(attrs.strides[0])), padding=(0, pads[0], 0, pads[-1]),
            dilation=(1, int(attrs.dilation[0])), groups=int(attrs.groups))
        return relax.op.squeeze(self.builder_.emit(conv), [2])


@relax.expr_functor.mutator
class LayoutFriendly(relax.PyExprMutator):
    """Forms ``ConvertLayout`` carries a layout through: float ``clip(x, lo, hi)`` as
    ``minimum(maximum(x, lo), hi)``, and a constant operand of an elementwise op with fewer
    axes than the other (``x + c[1]``, ``x * c[C, 1, 1]`` as exporters write them) as a scalar
    or at the other's rank (TVM's layout rule keeps such a pair in the old layout), and a
    per-tensor ``dequantize(quantize(x))`` (fake quantization between the convolutions of a
    QDQ model) as ``clip(round(x / s), -zp, qmax - zp) * s``, the same values bit for bit;
    the output of an inference ``dropout`` (a tuple, which TVM's layout rules fail on for the
    whole model: SqueezeNet, Inception) as its input (the dropout's mask, when read, keeps
    the dropout), and ``stack(xs, axis)`` (whose layout rule fails too: the LSTM after a CNN)
    as ``concat(expand_dims(x, axis) for x in xs, axis)``."""

    def visit_tuple_getitem_(self, item: relax.TupleGetItem) -> relax.Expr:
        item = super().visit_tuple_getitem_(item)
        dropout = bound_value(self, item.tuple_value)
        if is_op(dropout, "relax.nn.dropout") and item.index == 0:
            return dropout.args[0]
        return item

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name in _BINARY:
            return self._ranked(call)
        if is_op(call, "relax.dequantize"):
            return self._fake_quantization(call)
        if is_op(call, "relax.clip"):
            return self._clip(call)
        if is_op(call, "relax.stack"):
            return self._stack(call)
        return call

    def _stack(self, call: relax.Call) -> relax.Expr:
        items = bound_value(self, call.args[0])
        if not isinstance(items, relax.Tuple) or not isinstance(call.ty, relax.TensorType) \
                or call.ty.ndim < 1:
            return call
        axis = int(call.attrs.axis) % call.ty.ndim
        parts = [self.builder_.emit(relax.op.expand_dims(x, axis)) for x in items.fields]
        return relax.op.concat(parts, axis)

    def _clip(self, call: relax.Call) -> relax.Expr:
        if not is_static_tensor(call.ty, ("float32",), min_ndim=1):
            return call
        lo, hi = (_number(arg) for arg in call.args[1:])
        low = relax.op.maximum(call.args[0], relax.const(lo, "float32"))
        return relax.op.minimum(self.builder_.emit(low), relax.const(hi, "float32"))

    def _fake_quantization(self, call: relax.Call) -> relax.Expr:
        quantize = bound_value(self, call.args[0])
        if not is_op(quantize, "relax.quantize") or str(call.ty.dtype) != "float32" \
                or str(quantize.args[0].ty.dtype) != "float32":
            return call
        params = [constant_value(self, arg) for arg in (*quantize.args[1:], *call.args[1:])]
        if any(p is None or p.size != 1 for p in params):
            return call
        scale, zero, scale2, zero2 = (p.reshape(()) for p in params)
        qdtype = str(quantize.ty.dtype)
        if scale != scale2 or zero != zero2 or qdtype not in _QUANTIZED:
            return call
        qmin, qmax = _QUANTIZED[qdtype]
        zp = float(zero)
        steps = self.builder_.emit(relax.op.round(relax.op.divide(
            quantize.args[0], relax.const(np.float32(scale)))))
        low = self.builder_.emit(relax.op.maximum(steps, relax.const(qmin - zp, "float32")))
        high = self.builder_.emit(relax.op.minimum(low, relax.const(qmax - zp, "float32")))
        return relax.op.multiply(high, relax.const(np.float32(scale)))

    def _ranked(self, call: relax.Call) -> relax.Expr:
        args = list(call.args)
        if not all(isinstance(a.ty, relax.TensorType) and a.ty.ndim >= 0 for a in args):
            return call
        rank = max(a.ty.ndim for a in args)
        for i, arg in enumerate(args):
            value = constant_value(self, arg)
            if value is None or value.ndim in (0, rank):
                continue
            # In its own type (relax.const makes float64 float32 and int64 int32).
            args[i] = relax.const(value.reshape(()) if value.size == 1 else
                                  value.reshape((1,) * (rank - value.ndim) + value.shape),
                                  str(value.dtype))
        if all(a.same_as(b) for a, b in zip(args, call.args)):
            return call
        return relax.Call(call.op, args, call.attrs)


@relax.expr_functor.mutator
class ElementwiseQuantize(relax.PyExprMutator):
    """A per-tensor ``quantize(x, s, zp)`` of an fp32 tensor to 8 or 16 bits as the elementwise
    ops TVM legalizes it to, ``astype(min(max(round(x / s) + zp, qmin), qmax))``, the same
    values bit for bit: ``ConvertLayout`` has no rule for ``quantize`` and would keep it in the
    old layout, with a transpose each side. Run after :class:`LayoutFriendly` (which turns
    ``dequantize(quantize(x))`` pairs into float ops first); what is left are quantized tensors
    that integer kernels read (a quantized 1x1 convolution's input)."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not is_op(call, "relax.quantize") or str(call.args[0].ty.dtype) != "float32":
            return call
        qdtype = str(call.ty.dtype)
        params = [constant_value(self, arg) for arg in call.args[1:]]
        if qdtype not in _QUANTIZED or any(p is None or p.size != 1 for p in params):
            return call
        scale, zero = (p.reshape(()) for p in params)
        qmin, qmax = _QUANTIZED[qdtype]
        bb = self.builder_
        steps = bb.emit(relax.op.round(relax.op.divide(call.args[0],
                                                       relax.const(np.float32(scale)))))
        shifted = bb.emit(relax.op.add(steps, relax.const(np.float32(zero))))
        low = bb.emit(relax.op.maximum(shifted, relax.const(qmin, "float32")))
        high = bb.emit(relax.op.minimum(low, relax.const(qmax, "float32")))
        return relax.op.astype(high, qdtype)


_QUANTIZED = {"uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535),
              "int16": (-32768, 32767)}
_BINARY = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide",
                     "relax.maximum", "relax.minimum", "relax.power"})


def _number(value) -> float:
    """A ``PrimValue``'s number (its ``value`` is a Python number or an ``IntImm``/``FloatImm``)."""
    value = value.value
    return float(getattr(value, "value", value))


@relax.expr_functor.mutator
class ChannelShuffleNHWC(relax.PyExprMutator):
    """A channel shuffle between NHWC convolutions in its NHWC form.

    Exporters write ShuffleNet's channel shuffle in NCHW (``Reshape`` to ``[N, G, C/G, H, W]``,
    ``Transpose`` of the two channel axes, ``Reshape`` back); ``ConvertLayout`` has no rule
    for a reshape, so between NHWC convolutions it becomes five ops, a layout change each side::

        permute(reshape(permute(reshape(permute(x, to NCHW), [N, G, C/G, H, W]),
                                [0, 2, 1, 3, 4]), [N, C, H, W]), to NHWC)

    whose fused kernel computes the channel index through divisions of the flattened index. It
    is the permutation of the last two axes of ``x`` viewed as ``[N, H, W, G, C/G]``::

        reshape(permute(reshape(x, [N, H, W, G, C/G]), [0, 1, 2, 4, 3]), [N, H, W, C])
    """

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not _is_permute(call, [0, 2, 3, 1]):
            return call
        merged = bound_value(self, call.args[0])
        if not is_op(merged, "relax.reshape"):
            return call
        swapped = bound_value(self, merged.args[0])
        if not _is_permute(swapped, [0, 2, 1, 3, 4]):
            return call
        split = bound_value(self, swapped.args[0])
        if not is_op(split, "relax.reshape"):
            return call
        nchw = bound_value(self, split.args[0])
        if not _is_permute(nchw, [0, 3, 1, 2]):
            return call
        x = nchw.args[0]
        shape = static_shape(x)
        split_shape = static_shape(split)
        if shape is None or split_shape is None or len(shape) != 4 or len(split_shape) != 5:
            return call
        n, h, w, c = shape
        groups, per_group = split_shape[1], split_shape[2]
        if (split_shape[0], split_shape[3], split_shape[4]) != (n, h, w) \
                or groups * per_group != c or static_shape(merged) != (n, c, h, w):
            return call
        grid = self.builder_.emit(relax.op.reshape(x, (n, h, w, groups, per_group)))
        moved = self.builder_.emit(relax.op.permute_dims(grid, [0, 1, 2, 4, 3]))
        return relax.op.reshape(moved, (n, h, w, c))


def _is_permute(expr: relax.Expr, axes: list[int]) -> bool:
    return is_op(expr, "relax.permute_dims") and expr.attrs.axes is not None and \
        [int(a) for a in expr.attrs.axes] == axes


@relax.expr_functor.mutator
class CancelPermutes(relax.PyExprMutator):
    """``permute_dims(permute_dims(x, a), b)`` as one ``permute_dims`` of ``x``, or ``x``
    itself where the two cancel, and an identity ``permute_dims`` as its input.

    A kernel written for NHWC between NCHW ops (``frontend/lrn.py``) is imported between two
    permutes; once ``ConvertLayout`` has made its neighbours NHWC, each meets the permute the
    layout change put there, and the pair would otherwise be a copy kernel of its own. A pool
    that ``ConvertLayout`` left NCHW after such a permute (it follows its input's layout)
    pools the NHWC tensor instead, the permute after it::

        pool(permute(x, to NCHW), NCHW)  ->  permute(pool(x, NHWC), to NCHW)
    """

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if any(is_op(call, op) for op in _POOLS):
            return self._pool(call)
        if not is_op(call, "relax.permute_dims") or call.attrs.axes is None:
            return call
        outer = [int(a) for a in call.attrs.axes]
        source = call.args[0]
        inner = bound_value(self, source)
        if is_op(inner, "relax.permute_dims") and inner.attrs.axes is not None:
            axes = [int(a) for a in inner.attrs.axes]
            outer = [axes[a] for a in outer]
            source = inner.args[0]
        if outer == list(range(len(outer))):
            return source
        return call if source is call.args[0] else relax.op.permute_dims(source, outer)

    def _pool(self, call: relax.Call) -> relax.Expr:
        attrs = call.attrs
        source = bound_value(self, call.args[0])
        if (str(attrs.layout) != "NCHW" or str(attrs.out_layout) not in ("NCHW", "")
                or not _is_permute(source, [0, 3, 1, 2])):
            return call
        fields = dict(pool_size=attrs.pool_size, strides=attrs.strides, padding=attrs.padding,
                      dilation=attrs.dilation, ceil_mode=attrs.ceil_mode, layout="NHWC",
                      out_layout="NHWC")
        if is_op(call, "relax.nn.avg_pool2d"):
            fields["count_include_pad"] = attrs.count_include_pad
        pooled = self.builder_.emit(_POOLS[call.op.name](source.args[0], **fields))
        return relax.op.permute_dims(pooled, [0, 3, 1, 2])


_POOLS = {"relax.nn.max_pool2d": relax.op.nn.max_pool2d,
          "relax.nn.avg_pool2d": relax.op.nn.avg_pool2d}
